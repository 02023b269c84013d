"""Expert re-placement in training on a stationary skew: the busiest ep rank's share per sparse layer after each
re-placement, the placement search against DeepSeek's EPLB on the same windows.

    python scripts/bench/bench_rebalance.py [--model DIR] [--steps 30] [--every 3] [--lrs 0,0.005,0.05]

A corpus of 512 rows of 64 tokens where 3 tokens in 4 are one id (the rest uniform), the Qwen3-MoE fixture
(2 sparse layers of 8 experts, top-2) on fsdp8/ep8 with 8 redundant slots, SGD at each rate, `TrainLoop(
rebalance_every=every)` (what `moe-jax train --rebalance-every` runs). For every step after the first
re-placement, per sparse layer, the busiest rank's pairs over the mean rank's:

    searched   what the step ran (its `ep_rank_load`: the loop re-places with `searched_placement`)
    eplb       what EPLB's placements of the same windows give each step's load (`expected_rank_load`, replayed)
    own        a placement searched from the step's own load: what a forward pass re-placed from that very
               batch gets, which no placement chosen before the step can promise

Rate 0 keeps the router: the skew is stationary and only the batches change. At a rate the router moves, and
a window's placement then serves a load that has moved.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from moe_jax.host_devices import use_cpu_devices  # noqa: E402

use_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.distributed.eplb import (  # noqa: E402
    balanced_placement,
    better_placement,
    expected_rank_load,
    identity_placement,
)
from moe_jax.distributed.placement_search import searched_placement  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from moe_jax.training.loop import TrainLoop  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "models", "qwen3_moe")
REDUNDANT, EP = 8, 8


class SkewedCorpus:
    """512 rows of 64 tokens, 3 in 4 of them `hot`; batch i is rows 8i..8i+7 (wrapping)."""

    def __init__(self, vocab: int, hot: int = 75, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.rows = rng.integers(0, vocab, (512, 64)).astype(np.int32)
        self.rows[rng.random(self.rows.shape) < 0.75] = hot

    def batch(self, index: int) -> dict[str, np.ndarray]:
        start = (8 * index) % len(self.rows)
        return {"input_ids": self.rows[start:start + 8]}


def share(rank_load) -> np.ndarray:
    load = np.asarray(rank_load, np.float64)
    return load.max(-1) / load.mean(-1)


def replayed(records: list[dict], every: int, balance) -> np.ndarray:
    """[steps, layers]: each step's busiest share under the placements `balance` makes of the windows."""
    loads = [np.asarray(record["expert_load"], np.float64) for record in records]
    layers, experts = loads[0].shape
    placement = identity_placement(layers, experts, num_redundant_experts=REDUNDANT, ep_size=EP)
    shares = []
    for step, load in enumerate(loads, start=1):
        shares.append(share(expected_rank_load(placement, load, EP)))
        if step % every == 0:
            window = sum(loads[step - every:step])
            proposed = balance(window, num_redundant_experts=REDUNDANT, ep_size=EP)
            placement = better_placement(placement, proposed, window, EP)
    return np.array(shares)


def own(records: list[dict]) -> np.ndarray:
    rows = []
    for record in records:
        load = np.asarray(record["expert_load"], np.float64)
        rows.append(share(expected_rank_load(searched_placement(load, num_redundant_experts=REDUNDANT,
                                                                ep_size=EP), load, EP)))
    return np.array(rows)


def summary(shares: np.ndarray) -> str:
    per_layer = " / ".join(f"{high:.2f} {mean:.2f}" for high, mean in zip(shares.max(0), shares.mean(0)))
    return f"{per_layer}  ({(shares > 1.3).mean():.0%} of step-layers > 1.3)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=FIXTURE)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--lrs", default="0,0.005,0.05")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="the router of layer")   # the skew is the point here
    model = AutoModelForCausalLM.from_pretrained(args.model, DistributedConfig(fsdp_size=8, ep_size=EP),
                                                 progress=False, num_redundant_experts=REDUNDANT)
    corpus = SkewedCorpus(model.config.vocab_size)
    print(f"busiest rank / mean per sparse layer after the first re-placement (max mean per layer), "
          f"{args.steps} steps, re-placed every {args.every}")
    for lr in (float(value) for value in args.lrs.split(",")):
        model.set_expert_placement(model.identity_expert_placement())
        train_step = make_train_step(model, optax.sgd(lr))
        records = []
        state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
        TrainLoop(train_step, corpus, rebalance_every=args.every, on_step=records.append).run(state, args.steps)
        ran = np.array([share(record["ep_rank_load"]) for record in records])
        after = slice(args.every, None)
        print(f"lr {lr:g}: identity (steps 1-{args.every}) {summary(ran[:args.every])}")
        print(f"  searched (ran) {summary(ran[after])}")
        print(f"  eplb (replayed) {summary(replayed(records, args.every, balanced_placement)[after])}")
        print(f"  own load       {summary(own(records)[after])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
