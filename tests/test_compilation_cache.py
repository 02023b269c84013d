"""`moe_jax.compilation_cache`: where JAX's persistent compilation cache goes (a flag's directory, else
JAX_COMPILATION_CACHE_DIR, else the user's cache directory), that every program is cached unless the environment
says otherwise, and that it can be turned off (jax.config's updates recorded, not applied)."""

from __future__ import annotations

import jax
import pytest

from moe_jax.compilation_cache import default_cache_dir, use_compilation_cache


@pytest.fixture
def updates(monkeypatch):
    recorded = {}
    monkeypatch.setattr(jax.config, "update", lambda name, value: recorded.__setitem__(name, value))
    for variable in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        monkeypatch.delenv(variable, raising=False)
    return recorded


def test_the_default_is_the_users_cache_directory(updates, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "moe_jax" / "jax_compilation_cache"
    assert use_compilation_cache(None) == str(default_cache_dir()) and default_cache_dir().is_dir()
    assert updates == {"jax_enable_compilation_cache": True, "jax_compilation_cache_dir": str(default_cache_dir()),
                       "jax_persistent_cache_min_compile_time_secs": 0.0,
                       "jax_persistent_cache_min_entry_size_bytes": -1}
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "moe_jax" / "jax_compilation_cache"


def test_a_directory_given_wins_then_the_environment(updates, monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")
    assert use_compilation_cache(None) == str(tmp_path / "env")
    assert "jax_persistent_cache_min_compile_time_secs" not in updates   # the environment's threshold stands
    assert use_compilation_cache(tmp_path / "flag") == str(tmp_path / "flag")
    assert updates["jax_compilation_cache_dir"] == str(tmp_path / "flag")


def test_off_and_unusable(updates, tmp_path):
    assert use_compilation_cache(False) is None and updates == {"jax_enable_compilation_cache": False}
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot create it"):
        use_compilation_cache(tmp_path / "file" / "cache")
