"""Expert load balance terms of the train step beyond the reference's aux loss; both are off by default.

    make_train_step(model, optimizer, router_z_loss_coef=1e-3)        # ST-MoE's router z-loss
    make_train_step(model, optimizer, router_bias_update_rate=1e-3)   # DeepSeek-V3's aux-loss-free balancing

- **Router z-loss**: `coef * z` joins the loss, z = the mean over the real tokens of logsumexp(router logits)^2
  per sparse layer, averaged over the layers (`moe_jax.ops.routing.router_z_loss`; with micro-batches, averaged
  over them as the aux loss is). Reported as the `router_z_loss` metric.
- **Router bias update**: after each applied step, every sparse layer's router bias
  (`mlp.gate.e_score_correction_bias`, which chooses the experts but not their weights) moves by
  `rate * sign(mean load - load)` per expert, from the global batch's `expert_load` (the tokens each expert
  received in this step, summed over micro-batches): an overloaded expert is chosen less next step, an idle one
  more. It runs inside the jitted step on the state's parameters, the same on every rank, and not on a skipped
  (overflowed) step. The bias is a buffer: the optimizer gives it no update and no state
  (`optimizers.freeze_buffers`) and the loss no gradient (it only picks experts), so this update is its only
  change; checkpoints and `save_pretrained` carry it under its HF name.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..models.family import FAMILIES
from ..module_tree import ModuleTree

ROUTER_BIAS = "e_score_correction_bias"


def families_with_router_bias() -> list[str]:
    """The registered families whose sparse layers hold a router bias (their default configs' declarations)."""
    found = []
    for name, family in sorted(FAMILIES.items()):
        config, tree = family.config_class(), ModuleTree()
        try:
            family.declare_sparse_mlp(tree, config, family.experts_intermediate_size(config))
        except (AttributeError, TypeError, ValueError):   # a config class that needs more than its defaults
            continue
        if any(buffer.endswith("." + ROUTER_BIAS) for buffer in tree.buffers()):
            found.append(name)
    return found


def no_router_bias(rate: float, model_type: str) -> str:
    """The error for a bias update on a family without a router bias."""
    return (f"router_bias_update_rate={rate} updates the router's {ROUTER_BIAS}, which a {model_type} model does not "
            f"have; it is aux-loss-free balancing of the families whose routers hold one: "
            f"{', '.join(families_with_router_bias())}. Balance this one with its aux loss (output_router_logits="
            "True, router_aux_loss_coef) or the router z-loss.")


def check_router_z_loss(model, coef: float) -> float:
    """`coef` as a float, after checking that the model's step returns what the z-loss reads."""
    coef = float(coef)
    if coef < 0:
        raise ValueError(f"router_z_loss_coef={coef} must be >= 0 (0: no router z-loss).")
    if coef and not model.sparse_layers():
        raise ValueError(f"router_z_loss_coef={coef}: the model has no sparse layers, so no router to penalise.")
    if coef and model.layer_stack.pipeline is not None:
        raise ValueError(f"router_z_loss_coef={coef} needs the router logits, which pipeline stages keep in their "
                         "stage: train with pp_size=1, or without the z-loss.")
    return coef


@dataclass(frozen=True)
class RouterBiasUpdate:
    """The bias update of one model's train state: `targets` holds (storage name, the `expert_load` row of each
    stored layer (None: a zero row of a pipeline group), whether the entry stacks layers)."""

    rate: float
    targets: tuple[tuple[str, tuple[int | None, ...], bool], ...]

    @classmethod
    def of(cls, model, rate: float, trainable) -> RouterBiasUpdate | None:
        """The update at `rate` (None for rate 0); ValueError for a model without a router bias, or a state that
        does not hold it."""
        rate = float(rate)
        if rate < 0:
            raise ValueError(f"router_bias_update_rate={rate} must be >= 0 (0: the router bias stays as loaded).")
        if not rate:
            return None
        stack = model.layer_stack
        targets = []
        rows = {layer: row for row, layer in enumerate(model.sparse_layers())}
        # The MTP layers' routers (`models.mtp`) report no expert load: their biases stay as loaded.
        buffers = {name for name in model.module_tree.buffers()
                   if name.endswith("." + ROUTER_BIAS) and int(name.split(".")[2]) in rows}
        for storage, members in stack.members.items():
            if any(name in buffers for name in members):
                layers = [None if name is None else int(name.split(".")[2]) for name in members]
                targets.append((storage, tuple(None if layer is None else rows[layer] for layer in layers),
                                stack.is_stacked(storage)))
        if not targets:
            raise ValueError(no_router_bias(rate, model.config.model_type))
        if not trainable.everything:
            raise ValueError(f"router_bias_update_rate={rate} updates the router bias in the train state, which holds "
                             "it only when the step trains every parameter (no adapter, no trainable selection).")
        return cls(rate, tuple(targets))

    def __call__(self, params: dict[str, jax.Array], expert_load: jax.Array) -> dict[str, jax.Array]:
        """params (the state's, storage layout) with each router bias moved by rate * sign(mean - load);
        expert_load: [sparse layers, E] tokens per expert in this step."""
        load = expert_load.astype(jnp.float32)
        change = self.rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)     # [L, E]
        zeros = jnp.zeros_like(change[0])
        updated = dict(params)
        for storage, rows, stacked in self.targets:
            delta = (jnp.stack([zeros if row is None else change[row] for row in rows]) if stacked
                     else change[rows[0]])
            updated[storage] = (params[storage] + delta).astype(params[storage].dtype)
        return updated
