"""What is quiet unless asked (`moe_jax.verbosity`): gloo's connection lines under `moe-jax launch`, the
huge-pages hint in a user's script, Transformers' notice that torch is missing; `--verbose` (or
MOE_JAX_VERBOSE=1) shows each."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from moe_jax import host_memory
from moe_jax.cli import build_parser
from moe_jax.cli.launch import launch

ROOT = Path(__file__).resolve().parents[1]
GLOO_LINE = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def launched_output(verbose: bool) -> list[str]:
    """The relayed stdout of 2 processes that print gloo's connection line, their verbosity and a line of their own."""
    script = (f"import os; print({GLOO_LINE!r}); print({GLOO_LINE!r}); "
              "print('verbose', os.environ.get('MOE_JAX_VERBOSE', '0')); print('[Gloo] the rest stays')")
    out = io.BytesIO()
    assert launch([sys.executable, "-c", script], 2, stdout=out, stderr=io.BytesIO(), verbose=verbose) == 0
    return sorted(out.getvalue().decode().splitlines())


def test_launch_relays_gloo_s_connection_lines_only_when_verbose():
    assert launched_output(verbose=False) == ["[0] [Gloo] the rest stays", "[0] verbose 0",
                                              "[1] [Gloo] the rest stays", "[1] verbose 0"]
    verbose = launched_output(verbose=True)
    assert verbose.count(f"[0] {GLOO_LINE}") == 2 and verbose.count(f"[1] {GLOO_LINE}") == 2
    assert "[0] verbose 1" in verbose and "[1] verbose 1" in verbose


def test_every_command_has_verbose():
    parser = build_parser()
    for command in ("train", "eval", "generate", "serve", "convert", "launch", "plan", "demo"):
        assert parser.parse_args([command, "--verbose", *REQUIRED.get(command, [])]).verbose, command
        assert not parser.parse_args([command, *REQUIRED.get(command, [])]).verbose, command


REQUIRED = {"eval": ["--model", "m", "--data", "d"], "generate": ["--model", "m", "--prompt-ids", "1"],
            "serve": ["--model", "m"],
            "convert": ["--from", "hf", "--to", "orbax", "a", "b"], "launch": ["--nproc", "1"],
            "plan": ["--model", "m"]}


@pytest.fixture
def started_without_huge_pages(monkeypatch):
    monkeypatch.setattr(host_memory, "_warned", False)
    monkeypatch.setattr(host_memory, "starting_environ", lambda: {"PATH": "/usr/bin"})
    monkeypatch.setattr(host_memory, "huge_page_tunables", lambda environ: f"{host_memory.TUNABLE}=1")


def test_the_huge_pages_hint_is_quiet_unless_verbose(started_without_huge_pages, monkeypatch):
    monkeypatch.delenv("MOE_JAX_VERBOSE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host_memory.warn_without_huge_pages()
    monkeypatch.setenv("MOE_JAX_VERBOSE", "1")
    with pytest.warns(UserWarning, match="GLIBC_TUNABLES=glibc.malloc.hugetlb=1"):
        host_memory.warn_without_huge_pages()


# Transformers imported where torch is not found (find_spec hides it), after moe_jax.
WITHOUT_TORCH = """
import importlib.util
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: None if name == "torch" else find_spec(name, *args)
import moe_jax
import transformers
"""


@pytest.mark.parametrize("verbose", ["0", "1"])
def test_transformers_notice_that_torch_is_missing_only_when_verbose(verbose):
    pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**_environ(), "MOE_JAX_VERBOSE": verbose})
    assert result.returncode == 0, result.stderr
    assert ("PyTorch was not found" in result.stderr) == (verbose == "1"), result.stderr


def _environ() -> dict[str, str]:
    import os

    return {name: value for name, value in os.environ.items()
            if name not in ("TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS")}
