"""Train steps on the committed tiny Qwen3-MoE, built once per session and shared by the training tests
(each layout's step compiles once per capacity; rebuilding it per test would compile it again)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.training import make_train_step

from .hf_training import CHECKPOINT, CONFIG_CHANGES, CURVE, SETUP, training_batches

# A representative set: one device; token dispatch with tp, fsdp and ep; HSDP replicas with the masked
# all-reduce path. scripts/checks/check_training_layouts.py runs every legal 8-device layout x ep_implementation.
LAYOUTS = {
    "one_device": None,
    "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4),
    "hsdp2_fsdp2_tp2_ep2_all_reduce": dict(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=2,
                                           ep_implementation="all_reduce"),
}


def reference_optimizer() -> optax.GradientTransformation:
    """torch.optim.AdamW with the fixture's settings."""
    return optax.adamw(SETUP["learning_rate"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=SETUP["weight_decay"])


def build_trainer(layout: dict | None, *, optimizer: optax.GradientTransformation | None = None,
                  config_changes: dict | None = None, **step_options):
    """(model, train_step) of the fixture checkpoint with the curve's config changes on `layout`."""
    distributed_config = None if layout is None else DistributedConfig(**layout)
    model = AutoModelForCausalLM.from_pretrained(
        CHECKPOINT, distributed_config, devices=jax.devices()[:1] if layout is None else None, progress=False)
    model.config = dataclasses.replace(model.config, **(CONFIG_CHANGES | (config_changes or {})))
    options = dict(grad_clip=SETUP["grad_clip"], loss_chunk=5) | step_options
    return model, make_train_step(model, optimizer or reference_optimizer(), **options)


class FixtureBatches:
    """The fixture's batches as a BatchSource; `replace` swaps batch `index` for another."""

    def __init__(self, replace: dict[int, np.ndarray] | None = None):
        self.input_ids, self.attention_mask = training_batches(128)
        self.replace = replace or {}

    def batch(self, index: int) -> dict[str, np.ndarray]:
        input_ids = self.replace.get(index, self.input_ids[index % len(self.input_ids)])
        return {"input_ids": input_ids, "attention_mask": self.attention_mask[index % len(self.input_ids)]}


@pytest.fixture(scope="session")
def trainers():
    """layout name -> (model, train_step), built on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_trainer(LAYOUTS[name])
        return cache[name]

    return get


@pytest.fixture(scope="session")
def reference_curve() -> dict[str, np.ndarray]:
    return dict(np.load(CURVE))
