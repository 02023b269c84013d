"""Timing shared by the benchmark scripts: the median of repeated calls after a warm-up."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, *args, repeats: int) -> float:
    """Median seconds of `fn(*args)` (jitted by the caller) over `repeats` calls, after one call that compiles
    and warms up; every call is waited for (`jax.block_until_ready`)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
