"""Huge pages for XLA:CPU's host buffers (moe_jax/host_memory.py): when the tunable is added, how the
command restarts itself with it, and that the launcher hands it to every process."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from moe_jax import host_memory
from moe_jax.host_memory import (
    TUNABLE,
    huge_page_tunables,
    restart_with_huge_pages,
    transparent_huge_page_mode,
)

LINUX = dict(system="Linux", libc=("glibc", "2.36"), thp_mode="madvise")


def test_added_on_linux_glibc_with_madvise_huge_pages():
    assert huge_page_tunables({}, **LINUX) == f"{TUNABLE}=1"


def test_other_tunables_are_kept():
    tunables = huge_page_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **LINUX)
    assert tunables == f"glibc.malloc.arena_max=2:{TUNABLE}=1"


@pytest.mark.parametrize("environ, overrides", [
    ({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, {}),                      # the user's own setting stands
    ({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=2"}, {}),
    ({"MOE_JAX_HUGE_PAGES": "0"}, {}),                            # opted out
    ({}, {"thp_mode": "always"}),                                 # the kernel gives huge pages already
    ({}, {"thp_mode": "never"}),                                  # the kernel refuses them
    ({}, {"thp_mode": None}),                                     # no THP at all
    ({}, {"libc": ("glibc", "2.31")}),                            # no such tunable before glibc 2.35
    ({}, {"libc": ("", "")}),                                     # musl and others
    ({}, {"system": "Darwin"}),
])
def test_left_alone_where_it_changes_nothing(environ, overrides):
    assert huge_page_tunables(environ, **{**LINUX, **overrides}) is None


def test_thp_mode_is_the_bracketed_word(tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert transparent_huge_page_mode(mode) == "madvise"
    mode.write_text("[always] madvise never\n")
    assert transparent_huge_page_mode(mode) == "always"
    assert transparent_huge_page_mode(tmp_path / "missing") is None


def test_the_command_restarts_itself_once_with_the_tunable(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "huge_page_tunables", lambda environ: f"{TUNABLE}=1")
    monkeypatch.setattr(os, "execve", lambda path, argv, environ: calls.append((path, argv, environ)))
    restart_with_huge_pages(["layout", "--tp", "2"])
    (path, argv, environ), = calls
    assert path == sys.executable and argv == [sys.executable, "-m", "moe_jax.cli", "layout", "--tp", "2"]
    assert environ["GLIBC_TUNABLES"] == f"{TUNABLE}=1"


def test_no_restart_when_nothing_changes(monkeypatch):
    monkeypatch.setattr(host_memory, "huge_page_tunables", lambda environ: None)
    monkeypatch.setattr(os, "execve", lambda *args: pytest.fail("restarted although nothing changes"))
    restart_with_huge_pages(["layout"])


def test_the_command_runs_after_its_restart():
    """`python -m moe_jax.cli` end to end from an environment without the tunable: it restarts (where this
    machine qualifies) and runs the command as asked."""
    environ = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-m", "moe_jax.cli", "layout", "--tp", "2", "--ep", "2"],
                            env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tp" in result.stdout


@pytest.mark.skipif(huge_page_tunables({key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"})
                    is None, reason="this machine gains nothing from the tunable (not Linux glibc >= 2.35 with "
                                    "THP in madvise mode), so the launcher leaves it out")
def test_the_launcher_gives_every_process_the_tunable():
    environ = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    result = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "launch", "--nproc", "2", "--", sys.executable, "-c",
         "import os; print('tunables', os.environ['GLIBC_TUNABLES'])"],
        env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"tunables {TUNABLE}=1") == 2, result.stdout


def test_a_process_started_without_it_is_told_once_when_verbose(monkeypatch):
    monkeypatch.setenv("MOE_JAX_VERBOSE", "1")   # quiet otherwise: tests/test_verbosity.py
    monkeypatch.setattr(host_memory, "_warned", False)
    monkeypatch.setattr(host_memory, "starting_environ", lambda: {"PATH": "/usr/bin"})
    monkeypatch.setattr(host_memory, "huge_page_tunables", lambda environ: f"{TUNABLE}=1")
    with pytest.warns(UserWarning, match="GLIBC_TUNABLES=glibc.malloc.hugetlb=1"):
        host_memory.warn_without_huge_pages()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host_memory.warn_without_huge_pages()  # once per process


def test_no_word_when_started_with_it_or_opted_out(monkeypatch):
    monkeypatch.setattr(host_memory, "_warned", False)
    monkeypatch.setattr(host_memory, "starting_environ", lambda: {"GLIBC_TUNABLES": f"{TUNABLE}=1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host_memory.warn_without_huge_pages()
        monkeypatch.setattr(host_memory, "starting_environ", lambda: {})
        monkeypatch.setenv("MOE_JAX_HUGE_PAGES", "0")
        host_memory.warn_without_huge_pages()


def test_starting_environ_reads_the_process_environment(tmp_path):
    environ = tmp_path / "environ"
    environ.write_bytes(b"A=1\0GLIBC_TUNABLES=glibc.malloc.hugetlb=1\0B=x=y\0")
    assert host_memory.starting_environ(environ) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
                                                     "B": "x=y"}
    assert host_memory.starting_environ(tmp_path / "missing") is None
