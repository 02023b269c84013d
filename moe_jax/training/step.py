"""The train step: `train_step(state, batch) -> (state, metrics)`, jitted with explicit shardings, state donated.

    train_step = make_train_step(model, optax.adamw(1e-3), grad_clip=1.0, grad_accum=2)
    state = train_step.init_state(seed=0)
    state, metrics = train_step(state, {"input_ids": ids})        # ids: [B, S]; nothing read on the host

One step: the global batch is split into `grad_accum` micro-batches (each device keeps its own rows), each
runs the model's step (`model.step_math(..., inference=False, return_hidden=True)`, traced into this jit,
its inputs checked by `model.check_step` at each call) and the chunked loss; gradients are summed
in float32, clipped by their global norm over all parameters (PyTorch's `clip_grad_norm_` rule), and the
optimizer is applied. The loss is the reference's: token cross entropy averaged over every predicted
token of the global batch, plus `router_aux_loss_coef * aux_loss` (averaged over micro-batches) when the
config has `output_router_logits=True`, plus `router_z_loss_coef * router_z_loss` and `mtp_loss_coef *
mtp_loss` (DeepSeek-V3's multi-token prediction) when asked; with `router_bias_update_rate`, each applied step
also moves DeepSeek-V3's router bias (`training.balance`).

Dropless without a host round trip: a step whose dispatch dropped any (token, expert) pair returns its
input state unchanged (an elementwise select; no `lax.cond` around collectives) and sets the sticky
`state.skipping`, which makes every later step a no-op too. The loop reads each step's metrics one step
late and replays from the first overflowed step at a larger capacity (`moe_jax.training.loop`).

Metrics (device scalars, read one step late): step, loss, ce_loss, aux_loss, grad_norm, tokens, dropped, padded
(dispatch buffer rows that carried nothing), required_capacity, applied, data_position and, with sparse layers,
expert_load [L, E]: the real tokens each sparse layer sent to each expert in this step; where experts are
dispatched over ep ranks, ep_rank_load [L, ep]: the real (token, expert) pairs each rank computed (under the
state's expert placement with redundant slots); router_z_loss with a z-loss coefficient; mtp_loss with an MTP loss
coefficient (`training.mtp_loss`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from ..distributed.host_arrays import host_to_global
from ..models.core import step_math
from ..models.pipeline_layout import check_pipeline_options
from .balance import RouterBiasUpdate, check_router_z_loss
from .loss import DEFAULT_LOSS_CHUNK, aux_loss_coefficient, model_loss, predicted_tokens, prediction_targets
from .mtp_loss import MtpLoss
from .optimizers import freeze_buffers
from .precompiled import Precompiled, batch_signature, holds_program
from .state import TrainState, init_train_state, train_state_shardings
from .step_checks import check_batch_keys, check_no_quantized_codes_trained, check_offload_supported
from .step_options import TrainStepOptions, offload_memory_kinds
from .trainable import Selection, TrainableParameters, resolve_trainable

# Per-step load counts summed over micro-batches and reported as int metrics (`load_shapes`).
LOAD_METRICS = ("expert_load", "ep_rank_load")
# What the load window keeps of itself at each applied step: the latest step weighs most in the next re-placement,
# since a router that trains moves its load from batch to batch (docs/training.md, "Expert load balance").
LOAD_WINDOW_DECAY = 0.25


def clip_by_global_norm(grads, max_norm: float | None):
    """(clipped grads, the global norm before clipping) over all parameters at once (dense and experts),
    as `torch.nn.utils.clip_grad_norm_`: scale by min(1, max_norm / (norm + 1e-6))."""
    norm = optax.tree.norm(grads)
    # Without the barrier XLA shares the norm's g * g with AdamW's second-moment update by writing g * g out,
    # a full-size buffer per parameter read back twice (docs/benchmarks.md, "Train-step choices").
    grads, norm = jax.lax.optimization_barrier((grads, norm))
    if max_norm is None:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


def split_micro_batches(array: jax.Array, grad_accum: int) -> jax.Array:
    """[B, S] -> [A, B/A, S], micro-batch a = rows a, A + a, 2A + a, ...: every device keeps its own rows
    (the batch is split over devices in contiguous blocks), so the split moves no data."""
    batch = array.shape[0]
    return array.reshape(batch // grad_accum, grad_accum, *array.shape[1:]).swapaxes(0, 1)


class TrainStep:
    """The jitted step of one model and optimizer; one compilation per (capacity, batch keys)."""

    def __init__(self, model, optimizer: optax.GradientTransformation, options: TrainStepOptions,
                 trainable: TrainableParameters | None = None):
        if options.grad_accum < 1:
            raise ValueError(f"grad_accum={options.grad_accum} must be >= 1 (micro-batches per step).")
        if options.grad_clip is not None and options.grad_clip <= 0:
            raise ValueError(f"grad_clip={options.grad_clip} must be > 0, or None for no clipping.")
        offloaded = offload_memory_kinds(options.offload)
        if offloaded is not None and not model.compiles_only:   # abstract GPUs: target_compile.host_placement
            check_offload_supported(model)
        # What the state holds and trains (`training.trainable`): every parameter by default, the adapter alone
        # when the model has one. Buffers (DeepSeek-V3's e_score_correction_bias) are state, not weights: no
        # update, no decay (a selection never holds them).
        self.trainable = resolve_trainable(model) if trainable is None else trainable
        if self.trainable.everything:
            optimizer = freeze_buffers(optimizer, model)
        self.model, self.optimizer, self.options = model, optimizer, options
        # (parameters', optimizer state's) memory kinds between steps, or None: both on the device.
        self.memory_kind = offloaded
        self.aux_coefficient = aux_loss_coefficient(model.config)
        self.z_coefficient = check_router_z_loss(model, options.router_z_loss_coef)
        self.bias_update = RouterBiasUpdate.of(model, options.router_bias_update_rate, self.trainable)
        self.mtp_loss = MtpLoss.of(model, options.mtp_loss_coef)
        self._compiled: dict[tuple, callable] = {}
        self.pipeline_microbatches = model.pipeline_microbatches
        self._step_math = None   # the model's own step (`model.step_math`)
        if options.pipeline_microbatches is not None:
            layout = model.layer_stack.pipeline
            self.pipeline_microbatches = check_pipeline_options(
                model.layout.pp_size, options.pipeline_microbatches,
                "gpipe" if layout is None else layout.schedule, 1 if layout is None else layout.repeats)
            self._step_math = partial(step_math, replace(model.core, microbatches=self.pipeline_microbatches))

    # ---- state ---------------------------------------------------------------------------------------
    def shardings(self, capacity: float | None) -> TrainState:
        return train_state_shardings(self.model, self.optimizer, capacity, memory_kind=self.memory_kind,
                                     trainable=self.trainable)

    def init_state(self, *, seed: int = 0, params=None, capacity: float | None = None) -> TrainState:
        """A fresh state holding the trained arrays (`trainable`) and their optimizer state."""
        return init_train_state(self.model, self.optimizer, seed=seed, params=params, capacity=capacity,
                                memory_kind=self.memory_kind, trainable=self.trainable)

    def frozen(self) -> dict[str, dict[str, jax.Array]]:
        """The arrays a step reads but does not train, as the model holds them now (`TrainableParameters.frozen`)."""
        return self.trainable.frozen(self.model)

    def _frozen_arguments(self) -> tuple:
        """The jitted step's arguments after (state, batch): the frozen arrays, when part of the model is frozen
        (a step of the whole model takes just the two, as its compiled program's callers pass them)."""
        return () if self.trainable.everything else (self.frozen(),)

    def weights(self, state_params) -> tuple[dict, dict | None]:
        """(params, adapter or None) of the whole model with the state's trained arrays (`state.params`): what
        an evaluation, an export or `model.apply` takes."""
        return self.trainable.weights(self.model, state_params, self.frozen())

    def batch_size_error(self, batch_size: int) -> str | None:
        """Why `batch_size` cannot be a global batch of this step (None when it can)."""
        groups = self.model.data_parallel_size * self.options.grad_accum * self.pipeline_microbatches
        if batch_size % groups:
            pipeline = (f" x {self.pipeline_microbatches} pipeline microbatches" if self.pipeline_microbatches > 1
                        else "")
            return (f"batch size {batch_size} cannot be split into {self.options.grad_accum} micro-batch(es) over "
                    f"the {self.model.data_parallel_size} data-parallel group(s) of this layout{pipeline}; use a "
                    f"multiple of {groups}.")
        return None

    # ---- the step ------------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        self._check_model_inputs(state, self._batch_shape(batch))
        sharding = self.model.batch_sharding()
        # Host arrays hold the whole global batch (the same on every process of a multi-process job).
        batch = {name: host_to_global(value, sharding) for name, value in batch.items()}
        key = (state.capacity, tuple(sorted(batch)))
        if key not in self._compiled:
            self._compiled[key] = self._jit(state.capacity, key[1])
        return self._compiled[key](state, batch, *self._frozen_arguments())

    def precompile(self, state: TrainState, batch: dict, capacities=None, *, progress: bool = True
                   ) -> dict[float | None, float]:
        """Compile the step now for each of `capacities` (default: every rung of the model's capacity
        ladder; `state.capacity` alone without dispatch buffers), for batches shaped and keyed like `batch`.

        A run's capacity moves along the ladder (`CapacitySchedule`); the first step at a rung not seen before
        otherwise stops the run for that rung's compilation (tens of seconds at real sizes). Nothing is run
        and `state` is not consumed. A batch of another shape or dtype later compiles on first use, as without
        this. Returns {capacity: seconds spent compiling it} for the capacities that were not precompiled yet.
        """
        if capacities is None:
            capacities = (None,) if state.capacity is None else self.model.capacity_schedule.ladder
        schedule = self.model.capacity_schedule
        capacities = [None if capacity is None else schedule.check(capacity) for capacity in capacities]
        if None in capacities and state.capacity is not None:
            raise ValueError("capacity None (no dispatch buffers) cannot be compiled for a state with a capacity; "
                             f"pass rungs of the ladder {schedule.ladder}.")
        shape = self._batch_shape(batch)
        sharding = self.model.batch_sharding()
        # Shapes, dtypes (as `__call__` puts host arrays on the devices) and shardings: lowering reads no data.
        batch_spec = {name: jax.ShapeDtypeStruct(shape_, dtype, sharding=sharding)
                      for name, shape_, dtype in batch_signature(batch)}
        keys, signature = tuple(sorted(batch)), batch_signature(batch_spec)
        todo = [capacity for capacity in dict.fromkeys(capacities)
                if not holds_program(self._compiled.get((capacity, keys)), signature)]
        seconds = {}
        for capacity in tqdm(todo, desc="Compiling the train step per capacity", unit="program",
                             disable=not progress or not todo):
            at_capacity = state.replace(capacity=capacity)
            self._check_model_inputs(at_capacity, shape)
            start = time.perf_counter()
            jitted = self._jit(capacity, keys)
            lowered = jitted.lower(at_capacity, batch_spec, *self._frozen_spec())
            self._compiled[(capacity, keys)] = Precompiled(jitted, lowered.compile(), signature)
            seconds[capacity] = time.perf_counter() - start
        return seconds

    def trace(self, state: TrainState, batch: dict):
        """The step for `state`'s capacity and `batch`'s keys, traced (`jax.stages.Traced`: `.jaxpr` is the
        program as JAX sees it, `.lower()`). Tracing it does not fill the cache `__call__` uses. A step that
        trains part of the model (an adapter, a selection) takes the frozen arrays, `train_step.frozen()`, as its
        compiled program's third argument."""
        self._check_model_inputs(state, tuple(batch["input_ids"].shape))
        return self._jit(state.capacity, tuple(sorted(batch))).trace(state, batch, *self._frozen_arguments())

    def lower(self, state: TrainState, batch: dict):
        """The step for `state`'s capacity and `batch`'s keys, lowered (`jax.stages.Lowered`): for its cost
        and memory analyses, or `moe_jax.reporting.collectives_report`. Compiling it does not fill the
        cache `__call__` uses."""
        return self.trace(state, batch).lower()

    def _batch_shape(self, batch: dict) -> tuple[int, int]:
        """[B, S] of a valid batch (ValueError naming what is wrong otherwise)."""
        shape = check_batch_keys(batch, self.options.batch_keys(), self.model if self.options.routing_replay else None,
                                 objective=self.options.objective)
        if (error := self.batch_size_error(shape[0])) is not None:
            raise ValueError(error)
        return shape

    def _check_model_inputs(self, state: TrainState, shape: tuple) -> None:
        # What `model.apply` checks, once per call here: the step traces `model.step_math` directly.
        params, adapter = self.weights(state.params)
        self.model.check_step(params, (shape[0] // self.options.grad_accum, *shape[1:]),
                              capacity=state.capacity, compute_dtype=self.options.compute_dtype,
                              microbatches=self.pipeline_microbatches, adapter=adapter)

    def _frozen_spec(self) -> tuple:
        return jax.tree.map(lambda array: jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding),
                            self._frozen_arguments())

    def _jit(self, capacity, batch_keys):
        batch_sharding = self.model.batch_sharding()
        replicated = NamedSharding(self.model.mesh, P())
        state_shardings = self.shardings(capacity)
        # The frozen arrays come in as they are laid out in the model, never donated: the step only reads them.
        frozen = () if self.trainable.everything else (self.trainable.frozen_shardings(self.model),)
        return jax.jit(
            self._step,
            in_shardings=(state_shardings, {key: batch_sharding for key in batch_keys}, *frozen),
            out_shardings=(state_shardings, replicated),
            donate_argnums=(0,),
        )

    def _on_device(self, tree, shardings, part: int):
        """`tree` (part 0: the parameters, 1: the optimizer state) on the device for the step's compute."""
        if self.memory_kind is None or self.memory_kind[part] is None:
            return tree
        return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind("device")), tree, shardings)

    def _step(self, state: TrainState, batch: dict, frozen: dict | None = None) -> tuple[TrainState, dict]:
        options = self.options
        shardings = self.shardings(state.capacity)
        params = self._on_device(state.params, shardings.params, 0)
        opt_state = self._on_device(state.opt_state, shardings.opt_state, 1)
        micro, total_tokens, mtp_weights = self.micro_batches(batch)
        step_key = jax.random.fold_in(state.rng, state.step)

        loss_fn = partial(self._micro_loss, frozen=frozen, capacity=state.capacity, total_tokens=total_tokens,
                          placement=state.expert_placement, mtp_weights=mtp_weights)   # placement: an input
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def accumulate(carry, inputs):
            grads, totals = carry
            index, micro_batch = inputs
            (_, terms), micro_grads = grad_fn(params, micro_batch, jax.random.fold_in(step_key, index))
            grads = jax.tree.map(lambda g, m: g + m.astype(jnp.float32), grads, micro_grads)
            statistics = terms["statistics"]
            totals = {
                "ce_sum": totals["ce_sum"] + terms["ce_sum"], "aux_sum": totals["aux_sum"] + terms["aux"],
                **{name: totals[name] + terms[term] for name, term in (("z_sum", "z"), ("mtp_sums", "mtp_sums"))
                   if name in totals},
                "dropped": totals["dropped"] + statistics.dropped, "padded": totals["padded"] + statistics.padded,
                "required_capacity": jnp.maximum(totals["required_capacity"], statistics.required_capacity),
                **{name: totals[name] + terms[name] for name in LOAD_METRICS if name in totals},
                "objective_sums": jax.tree.map(jnp.add, totals["objective_sums"], terms["objective_sums"]),
            }
            return (grads, totals), None

        zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        zero_totals = {"ce_sum": jnp.zeros((), jnp.float32), "aux_sum": jnp.zeros((), jnp.float32),
                       "dropped": jnp.zeros((), jnp.int32), "padded": jnp.zeros((), jnp.int32),
                       "required_capacity": jnp.zeros((), jnp.float32),
                       "objective_sums": {name: jnp.zeros((), jnp.float32) for name in (
                           () if options.objective is None else options.objective.term_names)}}
        zero_totals.update({name: jnp.zeros(shape, jnp.float32) for name, shape in self.load_shapes().items()})
        if self.z_coefficient:
            zero_totals["z_sum"] = jnp.zeros((), jnp.float32)
        if self.mtp_loss is not None:
            zero_totals["mtp_sums"] = jnp.zeros((self.mtp_loss.depths,), jnp.float32)
        (grads, totals), _ = jax.lax.scan(
            accumulate, (zero_grads, zero_totals), (jnp.arange(options.grad_accum), micro)
        )
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        grads, grad_norm = clip_by_global_norm(grads, options.grad_clip)
        overflowed = totals["dropped"] > 0
        # Without dispatch buffers (capacity None: no expert parallelism) nothing can be dropped, so there is
        # no step to skip and no select over every parameter and optimizer moment (~6% of a large step).
        check_overflow = options.check_overflow and state.capacity is not None
        applied = ~state.skipping & ~overflowed if check_overflow else jnp.ones((), jnp.bool_)

        def update(operands):
            grads, opt_state, params = operands
            updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            if self.bias_update is not None:   # after the optimizer, which leaves the bias (a buffer) unchanged
                new_params = self.bias_update(new_params, totals["expert_load"])
            return new_params, new_opt_state

        def unchanged(operands):
            _, opt_state, params = operands
            return params, opt_state

        # A skipped step keeps the old parameters. XLA:CPU: by not running the update (a select over every
        # parameter and moment was slower there). Accelerators: by a select inside the update's elementwise
        # kernels, in place; a conditional's output holds a second copy of the whole state (XLA:GPU).
        operands = (grads, opt_state, params)
        if not check_overflow:
            new_params, new_opt_state = update(operands)
        elif self.model.platform == "cpu":
            new_params, new_opt_state = jax.lax.cond(applied, update, unchanged, operands)
        else:
            new_params, new_opt_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old),
                                                     update(operands), (params, opt_state))
        one = applied.astype(jnp.int32)
        new_state = state.replace(
            step=state.step + one,
            params=new_params,
            opt_state=new_opt_state,
            data_position=state.data_position + one,
            skipping=(state.skipping | overflowed) if check_overflow else state.skipping,
            **({} if state.expert_load_window is None else   # what TrainLoop(rebalance_every=) re-places from
               {"expert_load_window": state.expert_load_window * jnp.where(applied, LOAD_WINDOW_DECAY, 1.0)
                + totals["expert_load"] * one}),
        )
        ce_loss = totals["ce_sum"] / total_tokens
        aux_loss = totals["aux_sum"] / options.grad_accum
        loss, extra_losses = ce_loss + self.aux_coefficient * aux_loss, {}
        if self.z_coefficient:
            extra_losses["router_z_loss"] = totals["z_sum"] / options.grad_accum
            loss = loss + self.z_coefficient * extra_losses["router_z_loss"]
        if self.mtp_loss is not None:
            extra_losses["mtp_loss"] = self.mtp_loss.mean_loss(totals["mtp_sums"], mtp_weights)
            loss = loss + self.mtp_loss.coef * extra_losses["mtp_loss"]
        metrics = {
            "step": state.step + 1, "loss": loss, "ce_loss": ce_loss, **extra_losses,
            **{f"{options.objective.name}_{name}": total / total_tokens   # the objective's terms, token means
               for name, total in totals["objective_sums"].items()},
            "aux_loss": aux_loss, "grad_norm": grad_norm, "tokens": total_tokens.astype(jnp.int32),
            "dropped": totals["dropped"], "padded": totals["padded"], "required_capacity": totals["required_capacity"],
            "applied": applied, "data_position": state.data_position,
            **{name: totals[name].astype(jnp.int32) for name in LOAD_METRICS if name in totals},
        }
        return new_state, metrics

    def micro_batches(self, batch: dict) -> tuple[dict, jax.Array, jax.Array | None]:
        """(micro-batches [A, B/A, ...] with their targets, the batch's predicted tokens, MTP weights or None)."""
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        labels = batch.get("labels")
        segment_ids = batch.get("segment_ids")   # packed rows: documents 1, 2, ... per row (0: padding)
        targets = prediction_targets(input_ids, attention_mask if segment_ids is None else segment_ids, labels)
        total_tokens = predicted_tokens(targets)
        micro, mtp_weights = {"input_ids": input_ids, "targets": targets}, None
        if self.mtp_loss is not None:   # each depth's targets, and weights from the tokens it predicts in the batch
            micro["mtp_targets"], mtp_weights = self.mtp_loss.targets(
                targets, attention_mask if segment_ids is None else segment_ids)
        objective_keys = () if self.options.objective is None else tuple(self.options.objective.batch_keys)
        for name in ("attention_mask", "segment_ids", "positions", "routing", *objective_keys):
            if batch.get(name) is not None:
                micro[name] = batch[name]
        micro = {name: split_micro_batches(array, self.options.grad_accum) for name, array in micro.items()}
        return micro, total_tokens, mtp_weights

    def load_shapes(self) -> dict[str, tuple[int, int]]:
        """The load metrics this step reports (summed over the batch) and their shapes: expert_load [L, E] with
        sparse layers, and ep_rank_load [L, ep] (`ModelOutput.ep_rank_load`) where experts are dispatched over ep."""
        if not (sparse := self.model.sparse_layers()):
            return {}
        ep = self.model.core.ep_size
        return {"expert_load": (len(sparse), self.model.config.num_experts),
                **({} if ep == 1 else {"ep_rank_load": (len(sparse), ep)})}

    def _micro_loss(self, trained, micro_batch, rng, *, frozen, capacity, total_tokens, placement=None,
                    mtp_weights=None):
        # Differentiated with respect to the trained arrays only: the frozen ones are constants of the loss.
        # Masters stay float32 here: each is cast where it is used, and its gradient is reduced in float32.
        params, adapter = (trained, None) if frozen is None else self.trainable.weights(self.model, trained, frozen)
        return model_loss(self.model, params, micro_batch["input_ids"], micro_batch.get("attention_mask"),
                          micro_batch["targets"], total_tokens=total_tokens,
                          aux_weight=self.aux_coefficient / self.options.grad_accum, capacity=capacity, rng=rng,
                          compute_dtype=self.options.compute_dtype, loss_chunk=self.options.loss_chunk,
                          step=self._step_math, segment_ids=micro_batch.get("segment_ids"),
                          positions=micro_batch.get("positions"), adapter=adapter,
                          z_weight=self.z_coefficient / self.options.grad_accum, expert_placement=placement,
                          mtp_targets=micro_batch.get("mtp_targets"), mtp_weights=mtp_weights,
                          routing=micro_batch.get("routing"), objective=self.options.objective,
                          extras=None if self.options.objective is None else
                          {key: micro_batch[key] for key in self.options.objective.batch_keys})


def make_train_step(model, optimizer: optax.GradientTransformation, *, grad_accum: int = 1,
                    grad_clip: float | None = None, loss_chunk: int = DEFAULT_LOSS_CHUNK,
                    mixed_precision: bool | None = None, offload: bool | str | None = None,
                    check_overflow: bool = True, pipeline_microbatches: int | None = None,
                    trainable: Selection = None, router_z_loss_coef: float = 0.0,
                    router_bias_update_rate: float = 0.0, mtp_loss_coef: float = 0.0,
                    routing_replay: bool = False, objective=None) -> TrainStep:
    """The train step of `model` with any optax `optimizer`.

    Args:
        model: the `MoeForCausalLM` to train (its mesh, plans and adapter).
        optimizer: any optax `GradientTransformation` (`training.optimizers.build_optimizer` makes the usual ones).
        grad_accum: micro-batches per step whose gradients are summed before the update (default 1).
        grad_clip: max global gradient norm (None: no clipping).
        loss_chunk: positions per lm_head call in the loss, which never holds [B, S, V] (default 512).
        mixed_precision: float32 parameters and optimizer state, bfloat16 compute (None: the model's
            `DistributedConfig.fsdp_mixed_precision`).
        offload: "optimizer", "parameters" or "all" (True) keep that part of the state in host memory between
            steps (moved to the devices for each step's compute); None: the config's (`fsdp_cpu_offload`: "all").
        check_overflow: skip a step whose expert dispatch dropped pairs (default True).
        pipeline_microbatches: with pp_size > 1, the microbatches per micro-batch (default: the model's).
        trainable: what to train, a glob, list of globs or predicate over HF parameter names (the adapter's
            factors included); default: the model's LoRA adapter when it has one, else every parameter. The state
            holds only those and their optimizer state; the rest stays frozen (`moe_jax.training.trainable`).
        router_z_loss_coef: adds ST-MoE's router z-loss times it (default 0, off).
        router_bias_update_rate: moves DeepSeek-V3's router bias toward balance after each step
            (`moe_jax.training.balance`; default 0, off).
        mtp_loss_coef: adds DeepSeek-V3's multi-token-prediction loss times it (`moe_jax.training.mtp_loss`).
        routing_replay: each batch's "routing" [B, L, S, K] (what the sampler's forward returned with
            return_routing=True; -1 where a token routes itself) forces the experts; the router weighs them.
        objective: the per-token loss instead of cross entropy (`training.objectives`, e.g.
            `moe_jax.rl.ClippedPolicyObjective`); its `batch_keys` join each batch ("ce_loss" is its mean loss)."""
    config = model.distributed_config
    mixed_precision = config.fsdp_mixed_precision if mixed_precision is None else mixed_precision
    offload = config.fsdp_cpu_offload if offload is None else offload
    if mixed_precision and model.dtype != jnp.float32:
        raise ValueError(f"mixed precision keeps float32 master parameters, but the model holds {model.dtype}; "
                         "build it with dtype=float32.")
    selected = resolve_trainable(model, trainable)
    check_no_quantized_codes_trained(model, selected)
    options = TrainStepOptions(grad_accum=grad_accum, grad_clip=grad_clip, loss_chunk=loss_chunk,
                               compute_dtype=jnp.bfloat16 if mixed_precision else None,
                               check_overflow=check_overflow, offload=offload,
                               pipeline_microbatches=pipeline_microbatches,
                               router_z_loss_coef=router_z_loss_coef, router_bias_update_rate=router_bias_update_rate,
                               mtp_loss_coef=mtp_loss_coef, routing_replay=routing_replay, objective=objective)
    return TrainStep(model, optimizer, options, selected)
