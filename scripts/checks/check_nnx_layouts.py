"""Check the NNX face on every legal 8-device layout x ep_implementation, and on one device.

    python scripts/checks/check_nnx_layouts.py [--limit N] [--steps 5]

For each case the committed tiny Qwen3-MoE is loaded as a `moe_jax.nnx` module: its logits must equal the
engine's `apply` (the same compiled program, so exactly), and `--steps` AdamW steps of an NNX loop
(`nnx.Optimizer` inside `nnx.jit`, router loss on, padded rows) must give the losses of
`moe_jax.training`'s step with the same optimizer and batches within rtol 1e-6. The suite runs three layouts
(tests/nnx/); this is the full grid, about 20-30 s per case on 2 cores.
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

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import moe_jax.nnx  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from tests.models.test_fixture_parity import every_layout_and_implementation  # noqa: E402
from tests.nnx.conftest import adamw, batches, load_module, nnx_train_step  # noqa: E402


def check_case(layout: dict | None, steps: int) -> tuple[float, float]:
    """(max |NNX logits - apply logits|, max relative loss difference over `steps` steps)."""
    model = load_module(layout)
    engine = model.engine
    data = batches(steps)
    logits = np.asarray(model(data[0]["input_ids"], data[0]["attention_mask"]))
    expected = np.asarray(engine.apply(model.weights(), data[0]["input_ids"],
                                       attention_mask=data[0]["attention_mask"], capacity=model.capacity).logits)
    logits_error = float(np.max(np.abs(logits - expected)))

    model.train()
    optimizer = moe_jax.nnx.commit_to_mesh(nnx.Optimizer(model, adamw(), wrt=nnx.Param), model)
    step = nnx.jit(nnx_train_step)
    train_step = make_train_step(engine, adamw())
    state = train_step.init_state(params=model.weights(), capacity=model.capacity)
    ours, theirs = [], []
    for batch in data:
        ours.append(float(step(model, optimizer, batch)["loss"]))
        state, metrics = train_step(state, batch)
        theirs.append(float(metrics["loss"]))
    return logits_error, float(np.max(np.abs(np.array(ours) / np.array(theirs) - 1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=None, help="run only the first N cases")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    cases = [None, *every_layout_and_implementation()][: args.limit]
    worst, failures = [0.0, 0.0], []
    for layout in cases:
        start = time.perf_counter()
        errors = check_case(layout, args.steps)
        worst = [max(w, e) for w, e in zip(worst, errors)]
        ok = errors[0] == 0.0 and errors[1] <= 1e-6
        failures += [] if ok else [layout]
        print(f"{'ok  ' if ok else 'FAIL'} {layout or 'one device'}: logits {errors[0]:.1e}, losses {errors[1]:.1e} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{len(cases) - len(failures)}/{len(cases)} cases: NNX logits equal apply's and NNX AdamW losses equal the "
          f"train step's; worst: logits {worst[0]:.1e}, relative loss {worst[1]:.1e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
