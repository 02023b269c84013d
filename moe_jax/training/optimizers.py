"""Optimizers by name, and separate settings for expert and dense parameters.

    build_optimizer("adamw", learning_rate=1e-3, weight_decay=0.01)
    build_optimizer("muon", learning_rate=1e-3, weight_decay=0.1)   # Muon on the layers' matrices, AdamW on the rest
    experts_and_dense(optax.adamw(1e-4), optax.adamw(1e-3))     # any two optax transformations

Any optax `GradientTransformation` works with `make_train_step`; these are what `moe-jax train` offers.
"""

from __future__ import annotations

from collections.abc import Callable

import optax

from ..models.layer_stack import module_path
from .muon import muon

EXPERT_MARKER = ".experts."  # routed experts (`mlp.experts`, `feed_forward.experts`), not `shared_experts`


LearningRate = float | Callable[[int], float]   # a rate, or a schedule of the update count (`schedules.py`)


def _adamw(learning_rate: LearningRate, weight_decay: float | None) -> optax.GradientTransformation:
    # PyTorch's AdamW defaults (betas, eps); decoupled decay on every parameter, as torch.optim.AdamW.
    return optax.adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8,
                       weight_decay=0.0 if weight_decay is None else weight_decay)


def _sgd(learning_rate: LearningRate, weight_decay: float | None) -> optax.GradientTransformation:
    if weight_decay:
        raise ValueError(f"--optimizer sgd is plain SGD (no momentum, no weight decay); got weight decay "
                         f"{weight_decay}. Use --optimizer adamw for weight decay.")
    return optax.sgd(learning_rate)


OPTIMIZERS: dict[str, Callable[[LearningRate, float | None], optax.GradientTransformation]] = {
    "adamw": _adamw,
    "muon": muon,     # `muon.py`: its AdamW part shares the rate and the decay
    "sgd": _sgd,
}


def build_optimizer(name: str, learning_rate: LearningRate, weight_decay: float | None = None, *,
                    expert_learning_rate: LearningRate | None = None) -> optax.GradientTransformation:
    """The optimizer `name` (one of `OPTIMIZERS`) at `learning_rate`, a rate or a schedule of the update count
    (`schedules.learning_rate_schedule`); with `expert_learning_rate`, the experts get their own."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {sorted(OPTIMIZERS)}.")
    if not callable(learning_rate) and learning_rate <= 0:
        raise ValueError(f"learning rate {learning_rate} must be > 0.")
    if expert_learning_rate is not None and not callable(expert_learning_rate) and expert_learning_rate <= 0:
        raise ValueError(f"expert learning rate {expert_learning_rate} must be > 0.")
    if weight_decay is not None and weight_decay < 0:  # as torch.optim refuses it: it would grow the weights
        raise ValueError(f"weight decay {weight_decay} must be >= 0.")
    dense = OPTIMIZERS[name](learning_rate, weight_decay)
    if expert_learning_rate is None:
        return dense
    return experts_and_dense(OPTIMIZERS[name](expert_learning_rate, weight_decay), dense)


def parameter_groups(params: dict) -> dict[str, str]:
    """Storage name -> "experts" (routed expert weights) or "dense" (everything else)."""
    return {name: "experts" if EXPERT_MARKER in name else "dense" for name in params}


def experts_and_dense(experts: optax.GradientTransformation, dense: optax.GradientTransformation
                      ) -> optax.GradientTransformation:
    """`experts` for the routed experts' weights, `dense` for every other parameter (optax.multi_transform)."""
    return optax.multi_transform({"experts": experts, "dense": dense}, parameter_groups)


def buffer_storage_names(model) -> set[str]:
    """Storage names of `model.params` that hold buffers (`ModuleTree.buffer`)."""
    buffers = set(model.module_tree.buffers())
    return {storage for storage in model.layer_stack.members if model.layer_stack.first_member(storage) in buffers}


def freeze_buffers(optimizer: optax.GradientTransformation, model) -> optax.GradientTransformation:
    """`optimizer` on the model's trainable parameters; its buffers get zero updates and no optimizer state
    (a torch optimizer never sees them: they are not `Parameter`s). Unchanged for a model without buffers.
    Buffers are told by module path, so the same optimizer also labels another layer layout's storage (a train
    state restored across pipeline layouts)."""
    buffers = {module_path(name) for name in buffer_storage_names(model)}
    if not buffers:
        return optimizer
    return optax.multi_transform(
        {"trainable": optimizer, "buffer": optax.set_to_zero()},
        lambda params: {name: "buffer" if module_path(name) in buffers else "trainable" for name in params},
    )
