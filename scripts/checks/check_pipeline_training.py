"""Training through pipeline stages against one stage: 10 AdamW steps and every parameter's gradient.

    python scripts/checks/check_pipeline_training.py [--steps 10]

A 4-layer tiny Qwen3-MoE (dense layer 0, sparse 1-3, router loss on) with a sharpened router. For each layout of
the issue's list (pp2 x fsdp2 x ep2 all_to_all, pp2 x tp2 x fsdp2, pp4 x fsdp2, pp2 x dp_replicate2 x fsdp2) and
each schedule that splits the layers (gpipe with M = P and 2P, circular with 2 repeats and M = 2P): the losses of
`--steps` AdamW steps (TrainLoop, replays included) against the one-device run (relative, bar 1e-5), and the
first step's gradient of every parameter against the one-device gradient (bar: atol 1e-6 + rtol 1e-5). The suite
runs three gradient cases and one curve (tests/models/test_pipeline.py). Exits 1 on any failure.
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
import optax  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.training import TrainLoop, make_train_step  # noqa: E402
from tests.models.test_pipeline import FOUR_LAYERS, loss_and_grads  # noqa: E402

LAYOUTS = [dict(pp_size=2, fsdp_size=2, ep_size=2), dict(pp_size=2, tp_size=2, fsdp_size=2),
           dict(pp_size=4, fsdp_size=2), dict(pp_size=2, dp_replicate_size=2, fsdp_size=2)]


def schedules(stages: int) -> list[dict]:
    options = [dict(pipeline_microbatches=stages), dict(pipeline_microbatches=2 * stages)]
    if FOUR_LAYERS["num_hidden_layers"] % (2 * stages) == 0:
        options.append(dict(pipeline_schedule="circular", pipeline_repeats=2, pipeline_microbatches=2 * stages))
    return options


class Batches:
    def batch(self, index: int) -> dict:
        return {"input_ids": np.random.default_rng(index).integers(0, 128, (16, 10)).astype(np.int32)}


def run(model, params, steps: int, ids, targets):
    model.set_params(params)
    _, grads = loss_and_grads(model, ids, targets)
    train_step = make_train_step(model, optax.adamw(3e-3), grad_clip=1.0)
    records = []
    TrainLoop(train_step, Batches(), on_step=records.append).run(train_step.init_state(), steps)
    return [record["loss"] for record in records], grads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    began = time.perf_counter()
    base = Qwen3MoeForCausalLM(FOUR_LAYERS, devices=jax.devices()[:1])
    base.init_params(seed=5)
    params = {name: np.asarray(value * 20 if name.endswith("mlp.gate.weight") else value)
              for name, value in base.hf_params().items()}
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 128, (16, 10)).astype(np.int32)
    targets = rng.integers(0, 128, (16, 10)).astype(np.int32)
    expected_losses, expected_grads = run(base, params, args.steps, ids, targets)
    failures = []
    for layout in LAYOUTS:
        for options in schedules(layout["pp_size"]):
            config = DistributedConfig(**layout)
            model = Qwen3MoeForCausalLM(FOUR_LAYERS, config, devices=jax.devices()[:config.num_devices], **options)
            losses, grads = run(model, params, args.steps, ids, targets)
            loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, expected_losses))
            grad_excess = max(float(np.max(np.abs(grads[name] - expected) - (1e-6 + 1e-5 * np.abs(expected))))
                              for name, expected in expected_grads.items())
            ok = loss_error <= 1e-5 and grad_excess <= 0
            print(f"{'ok  ' if ok else 'FAIL'} {layout} {options}: losses within {loss_error:.1e} relative, "
                  f"gradients {'within' if grad_excess <= 0 else 'beyond'} the bar", flush=True)
            if not ok:
                failures.append(f"{layout} {options}")
    print(f"{len(failures)} failed in {time.perf_counter() - began:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
