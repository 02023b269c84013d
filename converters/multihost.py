"""What checkpoint writers need in a multi-process job: one writer, shared decisions, gathered tensors.

In a job of several processes (`jax.process_count() > 1`) every process runs the same save call: each
takes part in gathering every tensor (a collective), process 0 alone touches the files, and decisions made
on process 0 (the destination is unusable, a write failed, where the staging directory is) are broadcast so
every process returns or raises the same way instead of waiting in a collective the others never reach.
In a one-process job these helpers reduce to plain local operations.
"""

from __future__ import annotations

import jax
import numpy as np

MESSAGE_BYTES = 4096


def is_writer() -> bool:
    """The process that writes shared files (process 0)."""
    return jax.process_index() == 0


def multi_process() -> bool:
    return jax.process_count() > 1


def share_text(text: str | None) -> str | None:
    """Process 0's `text` (None included) on every process; other processes' arguments are ignored."""
    if not multi_process():
        return text
    from jax.experimental import multihost_utils

    payload = np.zeros(MESSAGE_BYTES + 1, np.uint8)
    if is_writer() and text is not None:
        encoded = text.encode("utf-8")[:MESSAGE_BYTES]
        payload[0] = 1
        payload[1:1 + len(encoded)] = np.frombuffer(encoded, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(payload))
    if not shared[0]:
        return None
    return bytes(shared[1:]).rstrip(b"\0").decode("utf-8", errors="replace")


def raise_everywhere(failure: Exception | None, what: str) -> None:
    """Process 0's `failure` (None: it succeeded) raised on every process: the error itself on process 0, an
    OSError naming it on the others. Every process must call this (it is a broadcast)."""
    shared = share_text(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if shared is not None:
        raise OSError(f"process 0 could not write {what}: {shared}")


def barrier(name: str) -> None:
    """Every process waits here until all arrive (no-op in one process)."""
    if multi_process():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def gather_to_host(array) -> np.ndarray:
    """One tensor as a numpy array on every process (`moe_jax.distributed.host_arrays.to_host`; every process
    must call this for the same array)."""
    # Imported at call time: converters import no moe_jax module at import time (moe_jax imports converters).
    from moe_jax.distributed.host_arrays import to_host

    return to_host(array)
