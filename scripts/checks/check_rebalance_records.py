"""Why a training run's expert re-placement did or did not even out the ep ranks, from its metrics JSONL.

    moe-jax train ... --fsdp 8 --ep 8 --num-redundant-experts 8 --rebalance-every 3 --metrics-jsonl run.jsonl
    python scripts/checks/check_rebalance_records.py run.jsonl --num-redundant-experts 8

Replays the loop's re-placements from the records (the identity placement first; at each `rebalanced` step the
`replacement` for two loads, as `TrainLoop` does: the window's `expert_load`, each step's decayed by the next as
the train step does (`LOAD_WINDOW_DECAY`), and the next batch's, which is the next record's `expert_load`, as
`load_probe.NextLoadProbe` measured it; that alone where every step re-placed; the window alone after the last
record) and prints per step and sparse layer the busiest rank's share (max / mean of the ranks' pairs). A run with
`--rebalance-lookahead B > 1` measured the later batches under the parameters of the re-placement, which the
records do not hold; the replay takes the next record's load alone then, as for B = 1:

    actual     the step's `ep_rank_load`
    placed     what the placement in force predicts for the step's own `expert_load` (each expert's tokens split
               evenly over its replicas: `eplb.expected_rank_load`)
    own        the same for the balanced placement of the step's own load: what a forward pass re-placed from
               that very batch gets, which no placement chosen before the step can promise

actual ~ placed: the window's placement ran as computed (a gap is the replica choice's split of each expert's tokens;
a large one would be a placement that did not carry over). placed >> own: the load moved since the window (the
router's hot experts changed with training, or the batch's mix); the `moved` column is the share of the step's
(token, expert) pairs whose expert's load differs from the window's, normalised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

from moe_jax.distributed.eplb import expected_rank_load, identity_placement  # noqa: E402
from moe_jax.distributed.placement_search import replacement, searched_placement  # noqa: E402
from moe_jax.training.step import LOAD_WINDOW_DECAY  # noqa: E402


def share(rank_load) -> np.ndarray:
    load = np.asarray(rank_load, np.float64)
    return load.max(1) / np.maximum(load.mean(1), 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl")
    parser.add_argument("--num-redundant-experts", type=int, required=True)
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in open(args.jsonl) if line.strip()]
    records = [record for record in records if "expert_load" in record and "ep_rank_load" in record]
    if not records:
        raise SystemExit(f"{args.jsonl}: no records with expert_load and ep_rank_load.")
    redundant = args.num_redundant_experts
    layers, experts = np.asarray(records[0]["expert_load"]).shape
    ep = len(records[0]["ep_rank_load"][0])
    placement = identity_placement(layers, experts, num_redundant_experts=redundant, ep_size=ep)
    window = np.zeros((layers, experts))
    last_window = None
    every_step = all(record.get("rebalanced") for record in records)
    print("step  actual / placed / own (per sparse layer)  moved")
    for index, record in enumerate(records):
        load = np.asarray(record["expert_load"], np.float64)
        own = searched_placement(load, num_redundant_experts=redundant, ep_size=ep)
        moved = "" if last_window is None else " ".join(
            f"{0.5 * np.abs(load[i] / load[i].sum() - last_window[i] / last_window[i].sum()).sum():.2f}"
            for i in range(layers))
        columns = [share(record["ep_rank_load"]), share(expected_rank_load(placement, load, ep)),
                   share(expected_rank_load(own, load, ep))]
        print(f"{record['step']:4d}  " + "  ".join(" / ".join(f"{column[i]:.2f}" for column in columns)
                                               for i in range(layers)) + f"  {moved}"
              + ("  re-placed" if record.get("rebalanced") else ""))
        window = window * LOAD_WINDOW_DECAY + load
        if record.get("rebalanced"):
            loads = window
            if index + 1 < len(records):
                upcoming = np.asarray(records[index + 1]["expert_load"], np.float64)
                loads = upcoming if every_step else np.stack([window, upcoming])
            placement = replacement(placement, loads, num_redundant_experts=redundant, ep_size=ep)
            last_window, window = window, np.zeros_like(window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
