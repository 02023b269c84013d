"""Check redundant expert slots on every family with an EP plan x every 8-device EP layout x ep_implementation.

    python scripts/checks/check_redundant_experts.py [qwen3_moe deepseek_v3 ...] [--scan-layers both|true|false]

For each case a model with R redundant slots (the smallest R > 0 that splits over ep, and R = ep) runs the
fixture's padded batch under the identity placement, a balanced placement (from the batch's `expert_load`) and a
random one (every expert in some slot, the rest random replicas, shuffled), and each must give the plain model's
logits (max |difference| <= 1e-5 on the real tokens), its `expert_load`, and `ep_rank_load` rows that add up to
the real pairs. The printed imbalance is max / mean of `ep_rank_load` over the ranks, worst layer, plain and
balanced. tests/distributed/test_redundant_experts.py runs two layouts of Qwen3-MoE and one of DeepSeek-V3.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.distributed.eplb import balanced_placement, placement_from_slots  # noqa: E402
from tests.models.test_fixture_parity import FAMILIES, FIXTURES, every_layout_and_implementation  # noqa: E402

SCAN_MODES = {"both": (False, True), "true": (True,), "false": (False,)}


def random_placement(layers: int, experts: int, redundant: int, seed: int):
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, redundant)]))
            for _ in range(layers)]
    return placement_from_slots(np.stack(rows), experts)


def imbalance(rank_load) -> float:
    load = np.asarray(rank_load, np.float64)
    return float((load.max(1) / np.maximum(load.mean(1), 1e-9)).max())


def check_case(family: str, layout: dict, scan: bool) -> list[str]:
    reference = np.load(FIXTURES / family / "reference.npz")
    ids, mask = reference["input_ids"], reference["attention_mask"]
    load = lambda **kwargs: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        FIXTURES / family, DistributedConfig(**layout), progress=False, scan_layers=scan, **kwargs)
    plain = load()
    base = plain.forward(ids, mask)
    experts, ep = plain.config.num_experts, layout["ep_size"]
    real, lines = mask.astype(bool), []
    for redundant in sorted({-experts % ep or ep, ep}):
        model = load(num_redundant_experts=redundant)
        layers = len(model.sparse_layers())
        placements = {"identity": None,
                      "balanced": balanced_placement(base.expert_load, num_redundant_experts=redundant, ep_size=ep),
                      "random": random_placement(layers, experts, redundant, seed=redundant)}
        for name, placement in placements.items():
            model.set_expert_placement(placement if placement is not None else model.identity_expert_placement())
            output = model.forward(ids, mask)
            difference = float(np.abs(np.asarray(output.logits)[real] - np.asarray(base.logits)[real]).max())
            np.testing.assert_array_equal(output.expert_load, base.expert_load)
            np.testing.assert_array_equal(np.asarray(output.ep_rank_load).sum(1), np.asarray(base.expert_load).sum(1))
            assert difference <= 1e-5, (family, layout, redundant, name, difference)
            lines.append(f"  R={redundant} {name:8s} max|logits - plain| {difference:.1e}  imbalance "
                         f"{imbalance(output.ep_rank_load):.2f} (plain {imbalance(base.ep_rank_load):.2f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", metavar="FAMILY", help="families with an EP plan (default: all)")
    parser.add_argument("--scan-layers", choices=sorted(SCAN_MODES), default="false")
    args = parser.parse_args(argv)
    families = args.families or [family for family in FAMILIES if family != "llama4_text"]
    for family in families:
        for layout in every_layout_and_implementation(family):
            if layout["ep_size"] == 1:
                continue
            for scan in SCAN_MODES[args.scan_layers]:
                start = time.perf_counter()
                lines = check_case(family, layout, scan)
                print(f"{family} {layout} ({'scanned' if scan else 'unrolled'}): ok "
                      f"({time.perf_counter() - start:.0f} s)", *lines, sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
