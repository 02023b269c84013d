"""NNX modules of the committed tiny Qwen3-MoE on the layouts the NNX tests use."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

import moe_jax.nnx
from moe_jax import DistributedConfig

from ..training.hf_training import CHECKPOINT, CONFIG_CHANGES, training_batches

LAYOUTS = {
    "one_device": None,
    "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4),
    "fsdp8_ep8": dict(fsdp_size=8, ep_size=8),
}
LEARNING_RATE, WEIGHT_DECAY = 3e-3, 0.01


def load_module(layout: str | dict | None, **module_options) -> moe_jax.nnx.MoeCausalLM:
    """The fixture as an NNX module on `layout` (a name of LAYOUTS, or DistributedConfig sizes; None: one
    device), with the training fixture's router loss switched on."""
    options = LAYOUTS[layout] if isinstance(layout, str) else layout
    model = moe_jax.nnx.AutoModelForCausalLM.from_pretrained(
        CHECKPOINT, None if options is None else DistributedConfig(**options),
        devices=jax.devices()[:1] if options is None else None, progress=False, **module_options)
    model.engine.config = dataclasses.replace(model.engine.config, **CONFIG_CHANGES)
    return model


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)


def batches(steps: int = 5) -> list[dict[str, np.ndarray]]:
    input_ids, attention_mask = training_batches(128, steps=steps)
    return [{"input_ids": input_ids[i], "attention_mask": attention_mask[i]} for i in range(steps)]


def nnx_train_step(model, optimizer, batch):
    """An existing-style NNX step: loss and gradients of the module, then the optimizer's update."""
    (_, metrics), grads = nnx.value_and_grad(lambda module: module.loss(**batch), has_aux=True)(model)
    optimizer.update(model, grads)
    return metrics
