"""`MoeCausalLM`: a Flax NNX module over a moe_jax model, for training loops written with NNX.

    model = moe_jax.nnx.AutoModelForCausalLM.from_pretrained(path, DistributedConfig(fsdp_size=4, ep_size=4))
    optimizer = moe_jax.nnx.commit_to_mesh(nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param), model)

    @nnx.jit
    def train_step(model, optimizer, batch):
        (loss, metrics), grads = nnx.value_and_grad(lambda m: m.loss(**batch), has_aux=True)(model)
        optimizer.update(model, grads)
        return metrics

The module is a thin face: each parameter of `engine.params` (the storage layout: HF names, scanned
layer runs stacked) becomes an `nnx.Param` at the same dotted path (`model.layers.0-3.mlp.experts.
gate_up_proj`), holding the same sharded array, with its PartitionSpec in the `out_sharding` metadata and
the mesh in `mesh`; `__call__` and `loss` run the engine's pure step on them: inside the caller's jit
(`nnx.jit`) its `step_math`, traced into that one program; called eagerly, its compiled `apply`.
Nothing is read on the host inside a call. The dispatch capacity is a static attribute (a change
recompiles, as in the pure API) and each call writes its dispatch statistics into `dispatch_statistics`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..causal_lm.model import MoeForCausalLM
from ..distributed.capacity import CapacityState, CapacityTracker, DispatchStatistics
from ..models.step_checks import check_params
from ..module_tree import unflatten
from ..training.loss import (
    DEFAULT_LOSS_CHUNK,
    aux_loss_coefficient,
    model_loss,
    predicted_tokens,
    prediction_targets,
)
from ..training.optimizers import buffer_storage_names
from .variables import Buffer, DispatchStats

# Attributes of the module itself; a parameter tree may not start with one of these names.
_OWN_ATTRIBUTES = frozenset({"engine", "capacity", "capacity_streak", "capacity_tracker", "deterministic",
                             "compute_dtype", "dispatch_statistics", "storage_names"})


def partition_names(spec, ndim: int) -> tuple:
    """PartitionSpec -> the `out_sharding` metadata Flax expects: one entry per dim (axis name, tuple of
    names, or None)."""
    entries = tuple(spec)
    return entries + (None,) * (ndim - len(entries))


class MoeCausalLM(nnx.Module):
    """An `nnx.Module` whose variables are a moe_jax model's parameters.

    engine: the `MoeForCausalLM` that owns the mesh, plans and step (static). params: its storage-layout
    parameters (default `engine.params`, which the module then takes over: `engine.params` is cleared so
    the first update does not keep a second copy alive). capacity: the dispatch capacity in force, a value
    of `engine.capacity_schedule.ladder`; None: the largest, whose buffers hold every pair (exact with no
    checks). deterministic: inference mode (True, as Transformers' `from_pretrained` returns a model in
    eval mode); `model.train()` / `model.eval()` switch it (Mixtral's router jitter, `auto` EP's path).
    compute_dtype: the activations' dtype (None: the parameters'; default bfloat16 when the
    `DistributedConfig` asks for `fsdp_mixed_precision`, as `make_train_step`).
    """

    def __init__(self, engine: MoeForCausalLM, params: Mapping[str, Any] | None = None, *,
                 capacity: float | None = None, deterministic: bool = True, compute_dtype=None):
        took_over = params is None
        params = engine.params if params is None else params
        if params is None:
            raise ValueError("The engine has no parameters: call init_params(), set_params() or from_pretrained() "
                             "first, or pass params=.")
        check_params(params, engine.layer_stack, engine.param_layouts.keys())
        clashes = {name.split(".", 1)[0] for name in params} & (_OWN_ATTRIBUTES | set(dir(type(self))))
        if clashes:
            raise ValueError(f"parameter tree(s) {sorted(clashes)} clash with MoeCausalLM's own attributes.")
        self.engine = engine
        self.storage_names = tuple(params)
        buffers = buffer_storage_names(engine)
        shardings = engine.storage_shardings()
        variables = {}
        for name, value in params.items():
            kind = Buffer if name in buffers else nnx.Param
            # Placed in the plans' sharding (a no-op for the engine's own arrays), so the metadata is true.
            value = jax.device_put(value, shardings[name])
            variables[name] = kind(value, out_sharding=partition_names(shardings[name].spec, len(value.shape)),
                                   mesh=engine.mesh)
        for attribute, tree in unflatten(variables).items():
            setattr(self, attribute, nnx.data(tree))
        schedule = engine.capacity_schedule
        # Static: each capacity is its own compilation, as in the pure API.
        self.capacity = (None if engine.layout.ep_size == 1 else
                         schedule.largest if capacity is None else schedule.check(capacity))
        # Host bookkeeping, compared by identity (its calm streak moves without changing the module's graph
        # definition, which a changed static attribute does: that recompiles an `nnx.jit` step).
        self.capacity_tracker = CapacityTracker(
            schedule, None if self.capacity is None else CapacityState(self.capacity),
            dispatches=self.capacity is not None)
        self.deterministic = deterministic
        mixed = engine.distributed_config.fsdp_mixed_precision
        self.compute_dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else (
            jnp.dtype(jnp.bfloat16) if mixed and engine.dtype == jnp.float32 else None)
        # Replicated on the mesh, as each call writes it: an input sharding that changed after the first
        # call would compile the jitted step a second time.
        self.dispatch_statistics = DispatchStats(jax.device_put(DispatchStatistics.zeros(),
                                                                NamedSharding(engine.mesh, P())))
        if took_over:
            engine.params = None

    # ---- parameters ----------------------------------------------------------------------------------
    def variable(self, name: str) -> nnx.Variable:
        """The `nnx.Param` (or `Buffer`) of storage name `name`."""
        first, *rest = name.split(".")
        node = getattr(self, first)
        for part in rest:
            node = node[part]
        return node

    def weights(self) -> dict[str, jax.Array]:
        """Storage name -> array of every parameter and buffer: the `params` of `engine.apply`."""
        return {name: self.variable(name).get_value() for name in self.storage_names}

    @property
    def config(self):
        return self.engine.config

    # ---- dispatch capacity ---------------------------------------------------------------------------
    # `capacity_tracker` holds the capacity (`moe_jax.distributed.capacity.CapacityTracker`); `capacity` is
    # its static copy, the compilation key of the next call (None: no dispatch buffers, ep 1).
    @property
    def capacity_streak(self) -> CapacityState | None:
        """The tracker's state: the capacity in force and its calm streak (`calm_calls`, `calm_peak`)."""
        return self.capacity_tracker.state

    def set_capacity(self, capacity: float) -> None:
        """Use `capacity` (a value of `engine.capacity_schedule.ladder`) from the next call on."""
        if self.capacity is not None:
            self.capacity_tracker.restart(capacity)
            self.capacity = self.capacity_tracker.capacity

    def update_capacity(self) -> bool:
        """Read the last call's statistics on the host (one read: dropped pairs and required capacity) and
        move the capacity by its tracker (`CapacityTracker.observe`): straight up after an overflow, one rung down
        after a calm streak. Returns whether the last call dropped pairs: its results lack them and it must
        be run again (at the raised capacity). Call it outside the jitted step, when convenient."""
        if self.capacity is None:
            return False
        replay = self.capacity_tracker.observe(self.dispatch_statistics.get_value(), ran_at=self.capacity)
        self.capacity = self.capacity_tracker.capacity
        return replay

    # ---- the step ------------------------------------------------------------------------------------
    def __call__(self, input_ids, attention_mask=None, *, positions=None, rng: jax.Array | None = None,
                 return_output: bool = False, routing=None):
        """input_ids, attention_mask, positions: [B, S] -> logits [B, S, V] (or the whole `ModelOutput` with
        `return_output=True`: router logits, aux loss, statistics). B must be a multiple of the layout's
        data-parallel size. rng: key for training-time randomness (Mixtral's router jitter). routing: [B, L, S, K]
        expert ids to replay (`models.routing_replay`)."""
        weights = self.weights()
        output = self._step(weights, input_ids, routing)(
            weights, input_ids, attention_mask=attention_mask, positions=positions, capacity=self.capacity,
            rng=rng, inference=self.deterministic, compute_dtype=self.compute_dtype, routing=routing)
        self.dispatch_statistics.set_value(output.statistics)
        return output if return_output else output.logits

    def loss(self, input_ids, attention_mask=None, labels=None, *, rng: jax.Array | None = None,
             loss_chunk: int = DEFAULT_LOSS_CHUNK, routing=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The reference's causal-LM loss of one batch ([B, S] each; labels default to the inputs, -100 and
        padding ignored), plus `router_aux_loss_coef * aux_loss` when the config has
        `output_router_logits=True`: the loss `moe_jax.training`'s step computes, by the same code, from
        hidden states in chunks of `loss_chunk` positions. -> (loss, metrics: loss, ce_loss, aux_loss,
        tokens). routing: [B, L, S, K] expert ids to replay, as the train step's `routing_replay`."""
        targets = prediction_targets(input_ids, attention_mask, labels)
        tokens = predicted_tokens(targets)
        coefficient = aux_loss_coefficient(self.engine.config)
        weights = self.weights()
        loss, terms = model_loss(self.engine, weights, input_ids, attention_mask, targets,
                                 total_tokens=tokens, aux_weight=coefficient, capacity=self.capacity, rng=rng,
                                 compute_dtype=self.compute_dtype, inference=self.deterministic,
                                 loss_chunk=loss_chunk, step=self._step(weights, input_ids, routing), routing=routing)
        self.dispatch_statistics.set_value(terms["statistics"])
        ce_loss = terms["ce_sum"] / tokens
        return loss, {"loss": loss, "ce_loss": ce_loss, "aux_loss": terms["aux"], "tokens": tokens.astype(jnp.int32)}

    def _step(self, weights: dict, input_ids, routing=None):
        """The engine's step for one call. Traced (the ids and parameters are tracers, as in an `nnx.jit`
        step): `step_math`, checked here, once per trace, and traced into the caller's one program. Eager:
        `apply`, which checks and runs its own compiled program (and keeps an eager `nnx.grad` compiled)."""
        if not (isinstance(input_ids, jax.core.Tracer)
                and any(isinstance(leaf, jax.core.Tracer) for leaf in weights.values())):
            return self.engine.apply
        self.engine.check_step(weights, jnp.shape(input_ids), capacity=self.capacity,
                               compute_dtype=self.compute_dtype, routing=routing)
        return self.engine.step_math

    # ---- checkpoints and generation (the engine's, on this module's arrays) ---------------------------
    def save_pretrained(self, out_dir, **kwargs):
        """Write the module's parameters as an HF checkpoint (`MoeForCausalLM.save_pretrained`)."""
        return self.engine.save_pretrained(out_dir, params=self.weights(), **kwargs)

    def generate(self, input_ids, attention_mask=None, **kwargs):
        """Transformers' `generate` on the module's parameters (`MoeForCausalLM.generate`)."""
        return self.engine.generate(input_ids, attention_mask, params=self.weights(), **kwargs)
