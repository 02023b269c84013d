"""Check mixed precision on every legal 8-device layout: bf16 compute, fp32 gradient reduction (SPEC §6).

    python scripts/checks/check_mixed_precision.py [--start K] [--limit N]

For each layout of the parity grid, the mixed-precision train step of the committed tiny Qwen3-MoE is
compiled with XLA dumping the SPMD partitioner's output (`moe_jax.reporting.collectives_report`: the
dtypes the program asks for, the same on CPU and GPU), run once, and compared with the full-precision
one-device step. Printed per layout: the collectives by (op, dtype), the loss difference, and a verdict.

Which bf16 sums are allowed: with tp > 1 the forward and input-gradient activation sums over tp (row
parallel projections, the experts' tp slices) and with the `all_reduce` EP implementation the experts'
output sum are activations, bf16 in the reference too. A layout with neither has only weight-gradient
sums, so any bf16 reduction there is a failure.
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

from moe_jax.reporting.collectives_report import REDUCTIONS, compile_with_collectives  # noqa: E402
from tests.models.test_fixture_parity import every_layout_and_implementation  # noqa: E402
from tests.training.conftest import FixtureBatches, build_trainer  # noqa: E402


def has_activation_sums(layout: dict) -> bool:
    return layout.get("tp_size", 1) > 1 or (layout.get("ep_size", 1) > 1
                                             and layout.get("ep_implementation") == "all_reduce")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=0, help="skip the first K layouts of the grid")
    parser.add_argument("--limit", type=int, default=None, help="check at most N layouts")
    args = parser.parse_args()
    batch = FixtureBatches().batch(0)
    _, full = build_trainer(None)
    _, full_metrics = full(full.init_state(), batch)
    full_loss = float(full_metrics["loss"])
    print(f"one device, float32: loss {full_loss:.6f} (jax {jax.__version__}, {jax.devices()[0].device_kind})")
    failures = 0
    layouts = every_layout_and_implementation()[args.start:]
    layouts = layouts[: args.limit]
    for layout in layouts:
        start = time.perf_counter()
        _, mixed = build_trainer(layout, mixed_precision=True)
        state = mixed.init_state()
        compiled, collectives = compile_with_collectives(mixed.lower(state, batch))
        _, metrics = compiled(state, batch)
        bf16_sums = sum(n for (op, dtype), n in collectives.items() if op in REDUCTIONS and dtype == "bf16")
        f32_sums = sum(n for (op, dtype), n in collectives.items() if op in REDUCTIONS and dtype == "f32")
        gathers = sum(n for (op, dtype), n in collectives.items() if op == "all-gather" and dtype == "bf16")
        loss_error = abs(float(metrics["loss"]) - full_loss) / full_loss
        ok = (bf16_sums == 0 or has_activation_sums(layout)) and f32_sums > 0 and loss_error < 2e-2
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {layout}: sums f32 {f32_sums}, bf16 {bf16_sums}"
              f"{' (activations)' if bf16_sums else ''}; bf16 all-gathers {gathers}; "
              f"loss {float(metrics['loss']):.6f} ({loss_error:.1e} from fp32) ({time.perf_counter() - start:.0f} s)")
        jax.clear_caches()
    print(f"{len(layouts) - failures}/{len(layouts)} layouts pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
