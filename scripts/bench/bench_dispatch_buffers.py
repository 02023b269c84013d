"""Dispatch-buffer rows at the capacity the schedule settles on, against the rows actually routed (no timing).

    python scripts/bench/bench_dispatch_buffers.py [--batches 20] [--skew 0.0]

For each shape (tokens per device, experts, top-k, ep) it routes `--batches` random batches through the real
router (`softmax_top_k` on the logits of random hidden states and a random router; `--skew` adds a bias that
favours low expert ids), counts the pairs each device sends each EP peer as the all_to_all layer does (peer =
expert // experts-per-peer), takes the lowest ladder capacity whose `buffer_rows` hold the busiest
sender-peer buffer (`required_capacity`'s rule) and runs a `CapacitySchedule` over the batches. It prints the
capacity the schedule holds at the end and the buffer rows it allocates over the rows routed (the issue's goal:
<= 1.5x), for the doubling ladder of earlier releases (1.25, 2, 4, ...) and for `capacity_ladder` now.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax.distributed.capacity import CapacitySchedule, buffer_rows, capacity_ladder  # noqa: E402
from moe_jax.ops.routing import softmax_top_k  # noqa: E402

SHAPES = [  # (tokens per device, experts, top_k, ep)
    (32, 16, 2, 8), (128, 16, 2, 8), (512, 16, 2, 8), (2048, 16, 2, 8),
    (128, 64, 8, 8), (512, 64, 8, 8), (512, 128, 8, 8), (128, 16, 4, 4), (1024, 16, 4, 4),
]
HIDDEN = 64


def doubling_ladder(ep_size: int, first: float = 1.25) -> tuple[float, ...]:
    """The ladder before the finer steps: `first`, then powers of two up to `ep_size`."""
    ladder = [first]
    while ladder[-1] < ep_size:
        ladder.append(min(float(ep_size), 2.0 ** (int(ladder[-1]).bit_length())))
    return tuple(ladder)


def peak_rows(rng, tokens: int, experts: int, top_k: int, ep: int, skew: float) -> tuple[int, int]:
    """(busiest sender-peer buffer's pairs, pairs each device sends) for one random batch on `ep` devices."""
    router = rng.normal(size=(HIDDEN, experts)).astype(np.float32) / np.sqrt(HIDDEN)
    bias = -skew * np.arange(experts, dtype=np.float32) / experts
    peak = 0
    for _ in range(ep):
        hidden = rng.normal(size=(tokens, HIDDEN)).astype(np.float32)
        _, index = softmax_top_k(jnp.asarray(hidden @ router + bias), top_k, normalize=True)
        peers = np.asarray(index) // (experts // ep)
        peak = max(peak, int(np.bincount(peers.ravel(), minlength=ep).max()))
    return peak, tokens * top_k


def settle(ladder: tuple[float, ...], peaks: list[int], pairs: int, ep: int) -> float:
    """The capacity a schedule (patience 4) holds after the batches: up at once on overflow, down when calm."""
    schedule = CapacitySchedule(ladder, patience=4)
    state = schedule.start()
    for peak in peaks:
        required = next((c for c in ladder if buffer_rows(c, pairs, ep) >= peak), ladder[-1])
        state = schedule.update(state, required)
    return state.capacity


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--skew", type=float, default=0.0)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{args.batches} random batches per shape, skew {args.skew}; capacity held at the end: buffer rows / "
          "routed rows (all_to_all, per sender-peer buffer)")
    print(f"{'tokens/dev':>10} {'E':>4} {'K':>3} {'ep':>3} {'peak/share':>11} | {'doubling ladder':>17} | "
          f"{'capacity_ladder':>17}")
    for tokens, experts, top_k, ep in SHAPES:
        samples = [peak_rows(rng, tokens, experts, top_k, ep, args.skew) for _ in range(args.batches)]
        pairs = samples[0][1]
        peaks = [peak for peak, _ in samples]
        cells = []
        for ladder in (doubling_ladder(ep), capacity_ladder(ep)):
            capacity = settle(ladder, peaks, pairs, ep)
            cells.append(f"{capacity:>5.2f}: {buffer_rows(capacity, pairs, ep) * ep / pairs:>5.2f}x")
        print(f"{tokens:>10} {experts:>4} {top_k:>3} {ep:>3} {max(peaks) * ep / pairs:>11.2f} | "
              f"{cells[0]:>17} | {cells[1]:>17}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
