"""Expert re-placement in training on a stationary skew: the busiest ep rank's share per sparse layer after the first
re-placement, what ran against the rules it replaced and against a placement that knew the loads to come.

    python scripts/bench/bench_rebalance.py [--models fixture,demo] [--steps 30] [--every 3] [--lookahead 1]
                                            [--lrs 0,0.005,0.05] [--optimizer sgd] [--deepseek]

A corpus of 512 rows of 64 tokens where 3 tokens in 4 are one id (the rest uniform); the Qwen3-MoE test fixture
(2 sparse layers of 8 experts, top-2) and `moe-jax demo`'s model (3 sparse layers of 8 experts, top-2) on
fsdp8/ep8 with 8 redundant slots; SGD (or AdamW) at each rate with `TrainLoop(rebalance_every=every)` (what `moe-jax
train --rebalance-every` runs). For every step after the first re-placement, per sparse layer, the busiest rank's
pairs over the mean rank's:

    ran        what the steps ran (their `ep_rank_load`): the window and the next batch's load (`load_probe`)
               served together (`--lookahead B`: the next B batches', `TrainLoop(rebalance_lookahead=B)`)
    ran, even  (B = 1) the same placements replayed with each expert's pairs split evenly over its replicas, as the
               rows below are (`eplb.expected_rank_load`); `spread_replicas` leaves a gap of a pair per shard
    window     replayed: `replacement` of the window alone (the rule before the next batch's load was measured)
    eplb       replayed: DeepSeek's EPLB of each window (`balanced_placement`, kept only where better)
    hindsight  replayed: a placement searched from the loads of the very steps it then runs (the `every` steps to
               come): what no placement held that long can beat, as far as the search finds it
    own        each step under a placement searched from its own load (a forward pass re-placed from that batch)

Rate 0 keeps the router: the skew is stationary and only the batches change. At a rate the router moves its hot
tokens between experts from step to step. Also printed: the re-placement's seconds (the next batch's forward
pass and the search: records' `rebalance_s`) against a step's. `--deepseek` times the search alone for two loads
on DeepSeek-V3's 58 layers of 256 + 32 experts over 32 ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from moe_jax.host_devices import use_cpu_devices  # noqa: E402

use_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.cli.demo import DEMO_CONFIG  # noqa: E402
from moe_jax.distributed.eplb import (  # noqa: E402
    balanced_placement,
    better_placement,
    expected_rank_load,
    identity_placement,
)
from moe_jax.distributed.placement_search import replacement, searched_placement  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from moe_jax.training.loop import TrainLoop  # noqa: E402
from moe_jax.training.step import LOAD_WINDOW_DECAY  # noqa: E402

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


def replayed(loads: list[np.ndarray], every: int, place) -> np.ndarray:
    """[steps, layers]: each step's busiest share under the placements `place(step, window, current)` makes after
    every `every`-th step (step counted from 1; `window`: the decayed window as the train step keeps it)."""
    layers, experts = loads[0].shape
    placement = identity_placement(layers, experts, num_redundant_experts=REDUNDANT, ep_size=EP)
    window, shares = np.zeros((layers, experts)), []
    for step, load in enumerate(loads, start=1):
        shares.append(share(expected_rank_load(placement, load, EP)))
        window = window * LOAD_WINDOW_DECAY + load
        if step % every == 0:
            placement = place(step, window, placement)
            window = np.zeros_like(window)
    return np.array(shares)


def rules(loads: list[np.ndarray], every: int, lookahead: int) -> dict[str, np.ndarray]:
    def loop(step, window, current):       # TrainLoop's: the next batches' loads are the next records'
        coming = loads[step:step + lookahead]
        served = ([window] if every > 1 or not coming else []) + coming
        return replacement(current, np.stack(served), num_redundant_experts=REDUNDANT, ep_size=EP)

    def eplb(step, window, current):
        proposed = balanced_placement(window, num_redundant_experts=REDUNDANT, ep_size=EP)
        return better_placement(current, proposed, window, EP)

    def hindsight(step, window, current):
        coming = loads[step:step + every]
        return current if not coming else searched_placement(np.stack(coming), num_redundant_experts=REDUNDANT,
                                                             ep_size=EP)

    return {
        # The records hold the next batch's load under the parameters it was measured with only for B = 1.
        **({"ran, even": replayed(loads, every, loop)} if lookahead == 1 else {}),
        "window": replayed(loads, every, lambda step, window, current: replacement(
            current, window, num_redundant_experts=REDUNDANT, ep_size=EP)),
        "eplb": replayed(loads, every, eplb),
        "hindsight": replayed(loads, every, hindsight),
        "own": np.array([share(expected_rank_load(searched_placement(load, num_redundant_experts=REDUNDANT,
                                                                     ep_size=EP), load, EP)) for load in loads]),
    }


def summary(shares: np.ndarray) -> str:
    per_layer = " / ".join(f"{high:.2f} ({mean:.2f})" for high, mean in zip(shares.max(0), shares.mean(0)))
    return f"{per_layer}  {(shares > 1.3).mean():4.0%} > 1.3"


def build(name: str):
    layout = DistributedConfig(fsdp_size=8, ep_size=EP)
    if name == "fixture":
        return AutoModelForCausalLM.from_pretrained(FIXTURE, layout, progress=False, num_redundant_experts=REDUNDANT)
    model = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), layout, num_redundant_experts=REDUNDANT)
    model.init_params(seed=0)
    return model


def deepseek_search_seconds() -> float:
    rng = np.random.default_rng(0)
    skew = rng.gamma(0.3, 1.0, (58, 256))
    loads = np.stack([np.stack([rng.multinomial(32768, row / row.sum()) for row in skew]) for _ in range(2)])
    start = time.perf_counter()
    searched_placement(loads.astype(np.float64), num_redundant_experts=32, ep_size=32)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="fixture,demo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--lookahead", type=int, default=1)
    parser.add_argument("--lrs", default="0,0.005,0.05")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--deepseek", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="the router of layer")   # the skew is the point here
    print(f"busiest rank / mean per sparse layer after the first re-placement: worst step (mean), share of "
          f"step-layers over 1.3; {args.steps} steps, re-placed every {args.every} for the next "
          f"{args.lookahead} batch(es), {args.optimizer}")
    for name in args.models.split(","):
        model = build(name)
        corpus = SkewedCorpus(model.config.vocab_size)
        for lr in (float(value) for value in args.lrs.split(",")):
            model.set_expert_placement(model.identity_expert_placement())
            optimizer = optax.sgd(lr) if args.optimizer == "sgd" else optax.adamw(lr)
            train_step = make_train_step(model, optimizer, grad_clip=1.0)
            records = []
            state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
            TrainLoop(train_step, corpus, rebalance_every=args.every, rebalance_lookahead=args.lookahead,
                      on_step=records.append).run(state, args.steps)
            after = slice(args.every, None)
            ran = np.array([share(record["ep_rank_load"]) for record in records])
            print(f"{name}, rate {lr:g}")
            print(f"  ran        {summary(ran[after])}")
            for rule, shares in rules([np.asarray(r["expert_load"], np.float64) for r in records], args.every,
                                     args.lookahead).items():
                print(f"  {rule:10s} {summary(shares[after])}")
            placing = [record["rebalance_s"] for record in records[args.every:] if record.get("rebalanced")]
            stepping = [record["tokens"] / record["tokens_per_s"] for record in records[args.every:]]
            print(f"  re-placement {statistics.median(placing) * 1e3:.0f} ms, step "
                  f"{statistics.median(stepping) * 1e3:.0f} ms (medians)")
    if args.deepseek:
        print(f"search for two loads, DeepSeek-V3 sizes (58 x 256 + 32 on 32 ranks): {deepseek_search_seconds():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
