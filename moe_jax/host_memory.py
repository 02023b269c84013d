"""Transparent huge pages for the host buffers XLA:CPU allocates on every execution.

XLA:CPU allocates a program's temporaries with glibc's malloc on each execution (386 MB for a train step of
bench_vs_reference's model), and glibc serves blocks that large with a fresh `mmap`: 4 KiB pages the kernel
faults in and zeroes on first touch, about 94 thousand page faults per step there, a quarter to a third of the
step's CPU time spent in the kernel. glibc's `glibc.malloc.hugetlb=1` tunable (glibc >= 2.35) makes malloc ask
for transparent huge pages on such blocks (`madvise(MADV_HUGEPAGE)`: 2 MiB pages, 500x fewer faults), which
matters where the kernel's THP mode is `madvise`, the usual default; one-device train steps run markedly faster with it
(docs/benchmarks.md, "Host memory: huge pages").

Tunables are read when a process starts, so the `moe-jax` command restarts itself once with the tunable added
(`restart_with_huge_pages`); `MOE_JAX_HUGE_PAGES=0` opts out. A program that imports moe_jax sets it itself:
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python train.py`; a model built on CPU devices in a process started
without it says so once when verbose (`MOE_JAX_VERBOSE=1`, `moe_jax.verbosity`; `warn_without_huge_pages`).
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from .verbosity import verbose

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "MOE_JAX_HUGE_PAGES"
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
FIRST_GLIBC = (2, 35)  # the first glibc with the hugetlb tunable


def transparent_huge_page_mode(path: Path = THP_MODE_FILE) -> str | None:
    """The kernel's THP mode, the bracketed word of `always [madvise] never` (None: no such file)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _glibc_version(libc: tuple[str, str]) -> tuple[int, ...] | None:
    name, version = libc
    if name != "glibc":
        return None
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None


def huge_page_tunables(environ: Mapping[str, str], *, system: str | None = None,
                       libc: tuple[str, str] | None = None, thp_mode: str | None = "read") -> str | None:
    """The `GLIBC_TUNABLES` value with `glibc.malloc.hugetlb=1` added, or None where it would change nothing:
    not Linux with glibc >= 2.35, the kernel's THP mode not `madvise` (`always` already gives huge pages,
    `never` refuses them), the tunable already set (to anything: the user's choice stands), or opted out with
    `MOE_JAX_HUGE_PAGES=0`. `system`, `libc` and `thp_mode` default to this machine's."""
    if environ.get(OPT_OUT, "1") == "0":
        return None
    if (system or platform.system()) != "Linux":
        return None
    version = _glibc_version(libc or platform.libc_ver())
    if version is None or version < FIRST_GLIBC:
        return None
    if (transparent_huge_page_mode() if thp_mode == "read" else thp_mode) != "madvise":
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if any(item.split("=", 1)[0] == TUNABLE for item in current.split(":") if item):
        return None
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def restart_with_huge_pages(arguments: Sequence[str]) -> None:
    """Replace this process by `python -m moe_jax.cli *arguments` with the tunable set, when
    `huge_page_tunables` says it would help; return otherwise (nothing has run yet: call it first)."""
    tunables = huge_page_tunables(os.environ)
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    environ = {**os.environ, "GLIBC_TUNABLES": tunables}
    os.execve(sys.executable, [sys.executable, "-m", "moe_jax.cli", *arguments], environ)


def starting_environ(path: Path = Path("/proc/self/environ")) -> dict[str, str] | None:
    """The environment this process started with (what glibc read its tunables from), None where unreadable."""
    try:
        entries = path.read_bytes().split(b"\0")
    except OSError:
        return None
    pairs = (entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)
    return dict(pairs)


_warned = False


def warn_without_huge_pages() -> None:
    """Once per process, when verbose (`moe_jax.verbosity`: every user script would print it otherwise): a
    `UserWarning` when the process started without the tunable where it would help (a Python program importing
    moe_jax directly; the `moe-jax` command restarts itself with it)."""
    global _warned
    if _warned or not verbose():
        return  # every model build calls this: decide once, without reading /proc again
    _warned = True
    environ = starting_environ()
    if environ is None or os.environ.get(OPT_OUT) == "0" or huge_page_tunables(environ) is None:
        return
    warnings.warn(
        "This process started without glibc's huge-page tunable, so XLA:CPU faults in every step's buffers 4 KiB "
        "at a time (train steps run markedly slower: docs/benchmarks.md, \"Host memory: huge pages\"). Start Python with "
        "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (the moe-jax command does so itself); MOE_JAX_HUGE_PAGES=0 "
        "silences this.", UserWarning, stacklevel=3,
    )
