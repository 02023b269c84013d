"""Checkpoint directories appear whole or not at all: written into a hidden staging directory, renamed.

    problem = destination_problem(out_dir)    # None, or why out_dir cannot receive a checkpoint
    staging = staging_directory(out_dir)      # .out_dir.partial-XXXX beside it
    ...write into staging...
    publish(staging, out_dir)                 # one rename
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def destination_problem(out_dir: Path) -> str | None:
    """Why `out_dir` cannot receive a checkpoint (it holds files), or None."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        return f"{out_dir} already exists and is not an empty directory; choose a new directory or remove it first."
    return None


def staging_directory(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))


def publish(staging: Path, out_dir: Path) -> None:
    """Make the finished checkpoint appear at `out_dir` in one rename."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; give it a normal directory's mode
    if out_dir.is_dir():
        out_dir.rmdir()  # empty (checked before writing); rename cannot replace a non-empty directory
    os.rename(staging, out_dir)
