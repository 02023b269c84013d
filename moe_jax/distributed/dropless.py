"""Dropless token dispatch with static shapes: a ladder of capacity buckets and a runner that climbs it.

A jitted step is compiled for one capacity bucket (per-peer buffers of `bucket * S / ep` rows). If any
layer of the step overflowed, its statistics say `dropped > 0`; the runner then runs the same step again
at the next bucket (compiled once per bucket, cached) and keeps that bucket for later calls:

    buckets for ep=8:   1.25 -> 2 -> 4 -> 8   (8 = ep: a buffer holds everything a device sends)

So results are always those of the unsharded model; the price of an overflow is one rerun of the step
and a host read of one scalar per step (not per layer).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from .expert_parallel import DEFAULT_CAPACITY_BUCKET


def capacity_ladder(ep_size: int, first: float = DEFAULT_CAPACITY_BUCKET) -> list[float]:
    """Capacity buckets from `first` doubling up to `ep_size`, whose buffers cannot overflow."""
    ladder = [first]
    while ladder[-1] < ep_size:
        ladder.append(min(float(ep_size), 2.0 ** (int(ladder[-1]).bit_length())))
    return ladder


class DroplessRunner:
    """Calls `build(bucket)(*args)` and climbs the ladder until nothing was dropped.

    `build(bucket)` returns a callable whose output's `statistics_of(output)` is a `DispatchStatistics`
    (or anything with a `dropped` count). The bucket reached is kept for the next call.
    """

    def __init__(self, build: Callable[[float], Callable], ep_size: int,
                 statistics_of: Callable = lambda output: output[1]):
        self.build = build
        self.ladder = capacity_ladder(ep_size)
        self.statistics_of = statistics_of
        self.rung = 0
        self._compiled: dict[float, Callable] = {}
        self.reruns = 0

    @property
    def bucket(self) -> float:
        return self.ladder[self.rung]

    def __call__(self, *args, **kwargs):
        while True:
            bucket = self.bucket
            if bucket not in self._compiled:
                self._compiled[bucket] = self.build(bucket)
            output = self._compiled[bucket](*args, **kwargs)
            dropped = int(jax.device_get(self.statistics_of(output).dropped))
            if dropped == 0 or self.rung == len(self.ladder) - 1:
                if dropped:
                    raise RuntimeError(
                        f"{dropped} (token, expert) pairs were dropped at the last capacity bucket ({bucket}); "
                        "this cannot happen for dispatch, whose last bucket holds every pair a device sends."
                    )
                return output
            self.rung += 1
            self.reruns += 1
