"""Compiled steps kept on disk, so that planning the same model again reads them instead of compiling.

    cache = CompileCache.at(None)                  # $XDG_CACHE_HOME/moe_jax/plan, or ~/.cache/moe_jax/plan
    key, step = cache.lookup(config_values, layout, request, devices, for_cpu=True)   # step None: not cached
    cache.store(key, compile_layout_step(...))

An entry is keyed by a hash of everything the compiled program depends on: the config's values, the layout,
the request, whether XLA:CPU's own costs count (`for_cpu`), the compiler options, and the jax, jaxlib and
moe_jax versions. A new version or option is a new key: stale entries are never read. Entries are written to
a temporary file and renamed, so a plan interrupted mid-write leaves no partial entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .compiled_step import PLANNING_COMPILER_OPTIONS, CompiledStep
from .layouts import Layout
from .request import PlanRequest

CACHE_FORMAT = 1       # bump when CompiledStep's fields change


def default_cache_directory() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "moe_jax" / "plan"


def _versions() -> dict:
    import jax
    import jaxlib

    from .. import __version__

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "moe_jax": __version__}


def cache_key(config_values: dict, layout: Layout, request: PlanRequest, *, for_cpu: bool,
              compiler: str = "cpu") -> str:
    """compiler: what compiled the step ("cpu", or the GPU target's device kind)."""
    described = {"config": config_values, "layout": dataclasses.asdict(layout), "request": dataclasses.asdict(request),
                 "for_cpu": for_cpu, "compiler_options": PLANNING_COMPILER_OPTIONS, "versions": _versions(),
                 "format": CACHE_FORMAT, "compiler": compiler}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class CompileCache:
    """directory: where entries live; None: no cache (every step compiled)."""

    directory: Path | None

    @classmethod
    def at(cls, directory: str | Path | None, enabled: bool = True) -> CompileCache:
        return cls(None if not enabled else Path(directory) if directory else default_cache_directory())

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.pickle"

    def read(self, key: str) -> CompiledStep | None:
        path = self._path(key)
        if not path.exists():
            return None
        try:
            with path.open("rb") as handle:
                step = pickle.load(handle)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError) as error:
            raise RuntimeError(f"the planner's compile cache entry {path} cannot be read ({error}): delete it, or "
                               "plan with --no-cache") from error
        if not isinstance(step, CompiledStep):
            raise RuntimeError(f"the planner's compile cache entry {path} holds a {type(step).__name__}, not a "
                               "compiled step: delete it, or plan with --no-cache")
        return step

    def write(self, key: str, step: CompiledStep) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as output:
                pickle.dump(step, output)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def lookup(self, config_values: dict, layout: Layout, request: PlanRequest, devices, *,
               for_cpu: bool) -> tuple[str | None, CompiledStep | None]:
        """(the entry's key, its step or None when not cached); (None, None) without a cache."""
        if self.directory is None:
            return None, None
        device = devices[0]
        key = cache_key(config_values, layout, request, for_cpu=for_cpu,
                        compiler="cpu" if device.platform == "cpu" else device.device_kind)
        return key, self.read(key)

    def store(self, key: str | None, step: CompiledStep) -> None:
        if key is not None:
            self.write(key, step)
