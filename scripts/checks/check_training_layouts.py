"""Check the training loss curve against the reference on every legal 8-device layout x ep_implementation.

    python scripts/checks/check_training_layouts.py [--start-capacity first|largest] [--limit N]

10 AdamW steps of the committed tiny Qwen3-MoE (router loss on, clipping active, padded rows) must give the
reference's losses (torch AdamW, tests/fixtures/training/qwen3_moe_adamw.npz) within rtol 1e-4, and its
router losses and gradient norms within 1e-3, on one device and on every case of
`every_layout_and_implementation()` (the 48 cases of the parity grid); then a state saved at step 5 with
tp2/fsdp4/ep4 is restored with fsdp8/ep8 and must finish the same curve. The suite runs three layouts
(tests/training/test_loss_curves.py); this is the full grid, about 30-60 s per case on 2 cores (each
capacity the loop climbs to is its own compilation; `--start-capacity largest` compiles one per case).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

import numpy as np  # noqa: E402

from moe_jax.training import TrainCheckpoints, TrainLoop  # noqa: E402
from tests.models.test_fixture_parity import every_layout_and_implementation  # noqa: E402
from tests.training.conftest import FixtureBatches, build_trainer  # noqa: E402
from tests.training.hf_training import CURVE, SETUP  # noqa: E402


def curve_errors(layout: dict | None, start_capacity: str) -> tuple[float, float, float, int]:
    """Max relative errors (loss, aux loss, grad norm) against the reference, and the replays it took."""
    model, train_step = build_trainer(layout)
    capacity = model.capacity_schedule.largest if start_capacity == "largest" and model.layout.ep_size > 1 else None
    records = []
    loop = TrainLoop(train_step, FixtureBatches(), on_step=records.append)
    loop.run(train_step.init_state(capacity=capacity), SETUP["steps"])
    reference = np.load(CURVE)
    error = lambda key, ref: float(np.max(np.abs(np.array([r[key] for r in records]) / reference[ref] - 1)))  # noqa: E731
    return error("loss", "losses"), error("aux_loss", "aux_losses"), error("grad_norm", "grad_norms"), loop.replays


def restore_across_layouts(saved_with: dict, restored_with: dict, save_at: int = 5) -> float:
    """Train to `save_at` on one layout, checkpoint, restore on another, finish the curve there: the max
    relative loss error of the restored steps against the reference."""
    with tempfile.TemporaryDirectory() as directory:
        _, saving_step = build_trainer(saved_with)
        checkpoints = TrainCheckpoints(directory, saving_step.model, saving_step, save_every=save_at)
        TrainLoop(train_step=saving_step, data=FixtureBatches(), should_save=checkpoints.should_save,
                  save=checkpoints.save).run(saving_step.init_state(), save_at)
        checkpoints.close()
        _, restoring_step = build_trainer(restored_with)
        state, capacity_state = TrainCheckpoints(directory, restoring_step.model, restoring_step).restore()
        records = []
        TrainLoop(restoring_step, FixtureBatches(), on_step=records.append).run(state, SETUP["steps"], capacity_state)
    losses = np.array([r["loss"] for r in records])
    return float(np.max(np.abs(losses / np.load(CURVE)["losses"][save_at:] - 1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start-capacity", choices=("first", "largest"), default="first")
    parser.add_argument("--limit", type=int, default=None, help="run only the first N cases")
    args = parser.parse_args(argv)
    cases = [None, *every_layout_and_implementation()][: args.limit]
    worst, failures = [0.0, 0.0, 0.0], []
    for layout in cases:
        start = time.perf_counter()
        errors = curve_errors(layout, args.start_capacity)
        worst = [max(w, e) for w, e in zip(worst, errors[:3])]
        ok = errors[0] <= 1e-4 and errors[1] <= 1e-3 and errors[2] <= 1e-3
        failures += [] if ok else [layout]
        print(f"{'ok  ' if ok else 'FAIL'} {layout or 'one device'}: loss {errors[0]:.1e}, aux {errors[1]:.1e}, "
              f"grad norm {errors[2]:.1e}, {errors[3]} replay(s) ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{len(cases) - len(failures)}/{len(cases)} cases follow the reference curve; worst relative error: loss "
          f"{worst[0]:.1e}, aux loss {worst[1]:.1e}, grad norm {worst[2]:.1e}")
    saved_with, restored_with = dict(tp_size=2, fsdp_size=4, ep_size=4), dict(fsdp_size=8, ep_size=8)
    restored_error = restore_across_layouts(saved_with, restored_with)
    restored_ok = restored_error <= 1e-4
    print(f"{'ok  ' if restored_ok else 'FAIL'} saved at step 5 with {saved_with}, restored with {restored_with}: "
          f"steps 6-10 within {restored_error:.1e} of the reference losses")
    return 1 if failures or not restored_ok else 0


if __name__ == "__main__":
    sys.exit(main())
