"""JAX's persistent compilation cache for a command that compiles the same programs at every start (`moe-jax serve`).

    directory = use_compilation_cache(None)          # on, in default_cache_dir() unless JAX_COMPILATION_CACHE_DIR
    directory = use_compilation_cache("/data/xla")   # on, there
    use_compilation_cache(False)                     # off (None), whatever the environment says

A program found in the cache is read back instead of compiled: a second start lowers each program (to compute its
key) and loads it. Every program is cached, however small or quick to compile (JAX's defaults skip programs that
compiled in under a second), unless the environment sets JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS or
JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES. Call it before the process compiles anything: JAX opens the cache at its
first compilation. The cache is not bounded in size; removing the directory empties it.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
THRESHOLDS = {"jax_persistent_cache_min_compile_time_secs": ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0.0),
              "jax_persistent_cache_min_entry_size_bytes": ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", -1)}


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/moe_jax/jax_compilation_cache (~/.cache/... when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moe_jax" / "jax_compilation_cache"


def use_compilation_cache(directory: str | os.PathLike | None | bool) -> str | None:
    """Turn the cache on in `directory` (None: JAX_COMPILATION_CACHE_DIR if set, else `default_cache_dir()`), or
    off (False). Returns the directory in use, or None when off. Raises ValueError when a directory given cannot
    be created; the default one failing turns the cache off instead (returns None)."""
    import jax

    if directory is False:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    given = directory is not None or bool(os.environ.get(ENV_DIR))
    path = Path(directory if directory is not None else os.environ.get(ENV_DIR) or default_cache_dir()).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        if given:
            raise ValueError(f"compilation cache {path}: cannot create it ({error.strerror or error}).") from None
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    for option, (variable, value) in THRESHOLDS.items():
        if variable not in os.environ:
            jax.config.update(option, value)
    return str(path)
