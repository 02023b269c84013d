"""Runs one experts module under the resolved plans, inside `shard_map`.

Three ways, decided by the plans (never by model code):

    "ep"     the experts module has an `ep_dispatch_experts` rule (ep_size > 1): weights split by whole
             experts over the ep group (gathered over efsdp by XLA before the call), tokens brought to
             them by the `ep_implementation`.
    "tp"     a `moe_tp_experts` rule (tp_size > 1, EP off): every device runs its slice of the
             intermediate dim of every expert on the shared batch; outputs are summed over tp.
    "local"  neither: each device runs all experts on its own batch (FSDP shards gathered by XLA).

    experts_forward(tokens [N, H], expert_ids [N, K], weights [N, K], **local_params) -> [N, H]

is the experts module's math, one function per activation kind (`moe_jax.ops.experts.swiglu_experts`, ...);
ids are local and the sentinel `num_local_experts` contributes nothing. Three names run experts: that
function, this sharded experts module, and the EP implementation it hands each call's bound function and
capacity to (`moe_jax.distributed.expert_parallel`).

Redundant slots ("ep" mode, `num_redundant_experts` R > 0): the ep ranks hold E + R *physical* slots, (E + R) /
ep_size each; which logical expert each slot holds is one layer of an `ExpertPlacement`
(`moe_jax.distributed.eplb`), an input of the call (`params["placement"]`), so a new placement is new data, not a
new program. Parameters stay per logical expert [E, ...]: the call gathers the physical weights
`take(logical, physical_to_logical, axis=0)` (their gradient sums back into each logical expert through the
gather) and sends each (token, k) pair to one replica of its expert (`spread_replicas`: an expert's pairs take its
replicas in turn within each token shard, so every replica gets an even share). LoRA factors of the experts are
gathered per physical slot the same way.

Several adapters on the experts (`AdapterRows` of a [K, E, ...] factor, `moe_jax.lora.AdapterSet`): the factors
are folded (`ExpertAdapterRows`) and split by whole experts as their weights are, and each token's adapter index
reaches the rows its experts see: in "local" and "tp" mode the device's own tokens', in "ep" mode carried with
the tokens by the EP implementation (its `adapter_index` keyword).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..ops.accumulation import is_master
from ..ops.lora import AdapterRows, ExpertAdapterRows, LoraFactors
from ..ops.routing import expert_load
from ..ops.varying import vary_like
from .capacity import CapacitySchedule, DispatchStatistics
from .eplb import ExpertPlacement, check_num_redundant_experts, spread_replicas
from .expert_parallel import (
    EPImplementation,
    ExpertGroups,
    ExpertsForward,
    build_ep_implementation,
    call_keywords,
)
from .mesh import STAGE_MESH_AXES, DeviceLayout, check_experts_divisible, spec_entry

EP_DISPATCH = "ep"
TENSOR_PARALLEL = "tp"
LOCAL = "local"


def _in_compute_dtype(weight: jax.Array, hidden: jax.Array) -> jax.Array:
    """An expert weight as the body computes with it. A wider master copy (mixed precision) is marked varying
    over the batch axes *before* the cast, so the gradient sum over devices sharing it (the transpose of that
    mark) runs in the master's dtype, float32, not in the compute dtype."""
    if not is_master(weight, hidden):
        return weight
    return vary_like(weight, hidden).astype(hidden.dtype)


def _joined(local: jax.Array, packed_dim: int | None) -> jax.Array:
    """A factor's local block back in its own rank: a packed view [.., 2, n, ..] (at `packed_dim`) -> [.., 2n, ..]."""
    if packed_dim is None:
        return local
    shape = local.shape
    return local.reshape(*shape[:packed_dim], shape[packed_dim] * shape[packed_dim + 1], *shape[packed_dim + 2:])


def _physical_factors(factors: LoraFactors | AdapterRows, slots: jax.Array) -> LoraFactors | AdapterRows:
    """An expert weight's LoRA factors per physical slot: each slot takes its logical expert's (slots [E + R]);
    an adapter set's carry the experts axis behind the adapters' ([K, E, ...])."""
    axis = 1 if isinstance(factors, AdapterRows) else 0
    a, b = jnp.take(factors.a, slots, axis=axis), jnp.take(factors.b, slots, axis=axis)
    return AdapterRows(a, b, factors.index, factors.scales) if axis else LoraFactors(a, b, factors.scaling)


def _bound_experts(experts_forward: Callable[..., jax.Array], params: dict) -> Callable[..., jax.Array]:
    """The experts function bound to this device's weights. Its `adapter_index` [rows] (several adapters on the
    experts) is each row's adapter: it becomes the index of the factors' `ExpertAdapterRows`."""
    per_row = any(isinstance(factors, ExpertAdapterRows) for factors in params.get("lora", {}).values())

    def bound(tokens, expert_ids, weights, *, adapter_index=None):
        if not per_row:
            return experts_forward(tokens, expert_ids, weights, **params)
        if adapter_index is None:
            raise ValueError("several LoRA adapters on the experts: the experts were called without each row's "
                             "`adapter_index` (an EP implementation must pass the one it was given, with its rows).")
        lora = {name: ExpertAdapterRows(factors.a, factors.b, adapter_index, factors.scales)
                if isinstance(factors, ExpertAdapterRows) else factors for name, factors in params["lora"].items()}
        return experts_forward(tokens, expert_ids, weights, **{**params, "lora": lora})
    return bound


def experts_mode(module_name: str, tp_plan: dict[str, str], ep_plan: dict[str, str]) -> str:
    """Which way an experts module runs, from its expanded plan rules."""
    if ep_plan.get(module_name) == "ep_dispatch_experts":
        return EP_DISPATCH
    if tp_plan.get(module_name) == "moe_tp_experts":
        return TENSOR_PARALLEL
    return LOCAL


class ShardedExperts:
    """One experts module bound to a mesh: `__call__(hidden, top_k_index, top_k_weights, params, ...)`.

    `params` are the module's global arrays (`{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}`);
    `intermediate_dims` says which dim of each is the intermediate dim split by tp in "tp" mode, e.g.
    `{"gate_up_proj": "packed", "down_proj": 2}` ("packed_last": gate and up halves on the last dim, Llama 4's
    `[E, H, 2I]`). `schedule`: the model's `CapacitySchedule` (default: the one for this ep size), whose
    ladder the EP implementation's `required_capacity` names. `ep_options` go to the EP implementation
    (`capacity_factor`, or a user implementation's own options). In "ep" mode the implementation is built
    here, once (unknown names and bad options fail at construction), and kept as `implementation`: each
    call passes it this device's experts bound to their weights and the call's capacity as arguments, so a
    new trace (another capacity, `jax.grad`, an outer `jit`) builds nothing. A reference-style
    implementation (no `experts_forward` keyword) is built again for each call traced, with that call's
    experts (`_reference_style_call`). `num_redundant_experts` R > 0 ("ep" mode only): the implementation runs
    (E + R) / ep_size local slots and each call takes one layer's placement (module docstring).
    """

    def __init__(
        self,
        *,
        mesh: jax.sharding.Mesh,
        layout: DeviceLayout,
        mode: str,
        num_experts: int,
        experts_forward: Callable[..., jax.Array],
        ep_implementation: str = "auto",
        intermediate_dims: dict[str, int | str] | None = None,
        schedule: CapacitySchedule | None = None,
        num_redundant_experts: int = 0,
        **ep_options,
    ):
        if num_redundant_experts and mode != EP_DISPATCH:
            raise ValueError(f"num_redundant_experts={num_redundant_experts} adds expert slots to the ranks of "
                             "expert parallelism, but this experts module does not dispatch tokens over ep (it "
                             "needs ep_size > 1 and an `ep_dispatch_experts` plan rule).")
        self.num_redundant_experts = num_redundant_experts
        self.mesh = mesh
        self.layout = layout
        self.mode = mode
        self.num_experts = num_experts
        self.experts_forward = experts_forward
        self.ep_implementation = ep_implementation
        self.intermediate_dims = intermediate_dims or {"gate_up_proj": "packed", "down_proj": 2}
        self.groups = ExpertGroups(
            ep_axes=layout.ep_axes, tp_axes=layout.tp_axes, ep_size=layout.ep_size, tp_size=layout.tp_size,
            all_axes=STAGE_MESH_AXES,
        )
        self.schedule = schedule if schedule is not None else CapacitySchedule.for_ep(layout.ep_size)
        self.ep_options = ep_options
        self.implementation: EPImplementation | None = None
        if mode == EP_DISPATCH:
            if num_redundant_experts:
                check_num_redundant_experts(num_experts, num_redundant_experts, layout.ep_size)
            else:
                check_experts_divisible(num_experts, layout.ep_size)
            self.implementation = build_ep_implementation(
                ep_implementation, None, self.local_slots, self.groups, schedule=self.schedule, **ep_options,
            )
            self.call_keywords = call_keywords(type(self.implementation))

    @property
    def local_slots(self) -> int:
        """The expert slots each ep rank holds: (E + R) / ep_size."""
        return (self.num_experts + self.num_redundant_experts) // self.layout.ep_size

    def _physical(self, params: dict, top_k_index, placement: ExpertPlacement | None, token_mask):
        """With redundant slots: (params gathered per physical slot, LoRA factors too; each pair's physical slot
        [N, K]; the real pairs each ep rank computes [ep] int32). Without: the inputs unchanged and None."""
        if not self.num_redundant_experts:
            return params, top_k_index, None
        if placement is None:
            raise ValueError(f"this experts module has {self.num_redundant_experts} redundant slot(s): its params "
                             "need one layer's expert placement under 'placement' (`moe_jax.models.core."
                             "nested_weights` attaches it).")
        slots = jnp.asarray(placement.physical_to_logical)
        gathered = {name: jnp.take(array, slots, axis=0) for name, array in params.items() if name != "lora"}
        if params.get("lora"):
            gathered["lora"] = {name: _physical_factors(factors, slots) for name, factors in params["lora"].items()}
        blocks = math.prod(self.layout.axis_sizes[axis] for axis in self.layout.token_axes)   # the token shards
        physical = spread_replicas(placement, top_k_index, blocks=blocks, real=token_mask)
        real = jnp.ones(top_k_index.shape[:1], jnp.int32) if token_mask is None else token_mask
        rank_load = expert_load(physical // self.local_slots, real, self.layout.ep_size).astype(jnp.int32)
        return gathered, physical, rank_load

    # Sharding of the inputs of the shard_map body.
    def _batch_spec(self) -> P:
        return P(spec_entry(self.layout.token_axes), None)   # [B*S] rows: the batch's axes, then cp's

    def _param_spec_and_view(self, name: str, array: jax.Array):
        """(array view, PartitionSpec) the body receives for one expert parameter."""
        if self.mode == EP_DISPATCH:
            return array, P(spec_entry(self.layout.ep_axes), *([None] * (array.ndim - 1)))
        if self.mode == TENSOR_PARALLEL:
            dim = self.intermediate_dims.get(name)
            if dim == "packed":
                # [E, 2I, H] -> [E, 2, I, H]: tp splits I, so each device holds matching gate and up rows.
                experts, fused, hidden = array.shape
                view = array.reshape(experts, 2, fused // 2, hidden)
                return view, P(None, None, spec_entry(self.layout.tp_axes), None)
            if dim == "packed_last":
                # [E, H, 2I] -> [E, H, 2, I] (Llama 4's [in, out] layout): the same split on the last dim.
                experts, hidden, fused = array.shape
                view = array.reshape(experts, hidden, 2, fused // 2)
                return view, P(None, None, None, spec_entry(self.layout.tp_axes))
            if dim is not None:
                entries = [None] * array.ndim
                entries[dim] = spec_entry(self.layout.tp_axes)
                return array, P(*entries)
        return array, P(*([None] * array.ndim))

    def _factor_spec_and_view(self, name: str, factor: str, array: jax.Array):
        """(array view, PartitionSpec, the view's packed dim or None) the body receives for one LoRA factor ("a"
        [E, r, I] or "b" [E, O, r]) of expert parameter `name`: sharded with its experts over ep; in "tp" mode the
        factor dim that matches the weight's split dim is split the same way (PEFT's I is the weight's last dim,
        O its middle one); else whole."""
        if self.mode == EP_DISPATCH:
            return array, P(spec_entry(self.layout.ep_axes), *([None] * (array.ndim - 1))), None
        whole = P(*([None] * array.ndim))
        if self.mode != TENSOR_PARALLEL:
            return array, whole, None
        tp = spec_entry(self.layout.tp_axes)
        split = {"packed": ("b", 1, True), 1: ("b", 1, False),
                 "packed_last": ("a", 2, True), 2: ("a", 2, False)}.get(self.intermediate_dims.get(name))
        if split is None or split[0] != factor:
            return array, whole, None
        _, dim, packed = split
        if not packed:
            entries = [None] * array.ndim
            entries[dim] = tp
            return array, P(*entries), None
        # [.., 2n, ..] -> [.., 2, n, ..] split on n: the gate and up halves of each device's slice, as the weight's.
        shape = array.shape
        view = array.reshape(*shape[:dim], 2, shape[dim] // 2, *shape[dim + 1:])
        entries = [None] * view.ndim
        entries[dim + 1] = tp
        return view, P(*entries), dim

    def __call__(self, hidden_states, top_k_index, top_k_weights, params: dict, *, inference: bool = False,
                 capacity: float | None = None, token_mask=None):
        """hidden_states: [N, H]; top_k_index: [N, K] global ids; top_k_weights: [N, K]
        -> (output [N, H] in hidden dtype, DispatchStatistics summed over all devices).

        params may hold `"lora"`: {weight name: `LoraFactors`}, a LoRA adapter on the experts' weights, whose
        factors travel with their experts and reach the experts function as its `lora` argument; and, with
        redundant slots, `"placement"`: one layer's `ExpertPlacement` (top_k_index stays logical).
        capacity: the dispatch capacity in force (`moe_jax.distributed.capacity`); None = the largest.
        token_mask: [N] 1 for real tokens: with redundant slots the statistics' `ep_rank_load` counts those."""
        if capacity is None:
            capacity = self.schedule.largest
        elif capacity <= 0:
            raise ValueError(f"capacity={capacity} must be > 0.")
        placement = params.get("placement")
        params = {name: value for name, value in params.items() if name != "placement"}
        params, top_k_index, rank_load = self._physical(params, top_k_index, placement, token_mask)
        lora = {}
        for name, factors in (params.get("lora") or {}).items():
            if isinstance(factors, AdapterRows):   # several adapters (no index: every token the base's)
                if factors.index is None:
                    continue
                factors = ExpertAdapterRows.folded(factors, hidden_states.shape[0])
            lora[name] = factors
        # several adapters: each token's adapter index travels with the tokens (one array, the same for each weight)
        rows = next((factors.index for factors in lora.values() if isinstance(factors, ExpertAdapterRows)), None)
        names = [name for name in params if name != "lora"]
        views, specs = zip(*(self._param_spec_and_view(name, params[name]) for name in names))
        adapted = list(lora)
        factor_views, factor_specs, packed_dims = [], [], []
        for name in adapted:
            for factor in ("a", "b"):
                view, spec, packed_dim = self._factor_spec_and_view(name, factor, getattr(lora[name], factor))
                factor_views.append(view)
                factor_specs.append(spec)
                packed_dims.append(packed_dim)
        batch = self._batch_spec()

        def body(hidden, index, weights, *local_arrays):
            local_rows = None
            if rows is not None:
                local_arrays, local_rows = local_arrays[:-1], local_arrays[-1]
            local_arrays, local_factors = local_arrays[:len(names)], local_arrays[len(names):]
            local_params = {name: _in_compute_dtype(array, hidden) for name, array in zip(names, local_arrays)}
            if adapted:
                joined = [_in_compute_dtype(_joined(array, packed_dim), hidden)
                          for array, packed_dim in zip(local_factors, packed_dims)]
                local_params["lora"] = {   # an adapter set's index: each row's, set by `_bound_experts`
                    name: ExpertAdapterRows(joined[2 * i], joined[2 * i + 1], None, lora[name].scales)
                    if isinstance(lora[name], ExpertAdapterRows) else
                    LoraFactors(joined[2 * i], joined[2 * i + 1], lora[name].scaling) for i, name in enumerate(adapted)}
            packing = self.intermediate_dims.get("gate_up_proj")
            if self.mode == TENSOR_PARALLEL and packing == "packed":
                view = local_params["gate_up_proj"]
                local_params["gate_up_proj"] = view.reshape(view.shape[0], -1, view.shape[-1])
            elif self.mode == TENSOR_PARALLEL and packing == "packed_last":
                view = local_params["gate_up_proj"]
                local_params["gate_up_proj"] = view.reshape(*view.shape[:2], -1)
            experts_forward = _bound_experts(self.experts_forward, local_params)
            output, statistics = self._run_on_device(experts_forward, hidden, index, weights, inference, capacity,
                                                     local_rows)
            # Counts are per device (TP ranks count disjoint slices), so the sum over the stage's devices is the
            # total (a pipeline stage's; the pipeline adds its stages' up where they are valid).
            return output.astype(hidden.dtype), statistics.over_devices(STAGE_MESH_AXES)

        run = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(batch, batch, batch, *specs, *factor_specs, *(() if rows is None else (P(batch[0]),))),
            out_specs=(batch, P()),
            # Under a pipeline's vmap over stages (`spmd_axis_name="pp"`) JAX's mesh-variance types lose track of
            # `pp` inside batched conds (jax 0.10: "requires varying manual axes to match"); the pipeline's
            # parity tests (values and gradients against pp=1) check this body without them.
            check_vma=self.layout.pp_size == 1,
        )
        output, statistics = run(hidden_states, top_k_index, top_k_weights, *views, *factor_views,
                                 *(() if rows is None else (rows,)))
        return output, statistics if rank_load is None else statistics.with_ep_rank_load(rank_load)

    @property
    def carries_adapters(self) -> bool:
        """Whether each token's adapter index reaches the rows its experts see (several adapters on the experts):
        always without dispatch; in "ep" mode where the EP implementation takes `adapter_index`."""
        return self.mode != EP_DISPATCH or "adapter_index" in self.call_keywords

    def _run_on_device(self, experts_forward, hidden, index, weights, inference, capacity, adapter_index):
        """adapter_index: [N] each token's adapter where several adapters adapt the experts, else None."""
        if self.mode == EP_DISPATCH:
            if adapter_index is not None and not self.carries_adapters:
                raise ValueError(f"several LoRA adapters on the experts: EP implementation "
                                 f"{type(self.implementation).__name__} takes no `adapter_index`, so each token's "
                                 "adapter cannot follow it to its experts (all_to_all and all_reduce carry it).")
            implementation = self.implementation
            arguments = {"experts_forward": experts_forward, "capacity": capacity, "inference": inference,
                         "adapter_index": adapter_index}
            if "experts_forward" not in self.call_keywords:
                implementation = self._reference_style_call(experts_forward, capacity)
            # adapter_index only where a batch mixes adapters: an implementation taking **kwargs sees no new keyword
            keywords = self.call_keywords - ({"adapter_index"} if adapter_index is None else set())
            result = implementation(hidden, index, weights, **{name: arguments[name] for name in keywords})
            output, statistics = result if isinstance(result, tuple) else (result, DispatchStatistics.zeros())
            # Implementations can be user classes (EPImplementationInterface): check the contract when traced.
            contract = (f"EP implementation {type(implementation).__name__} must return this device's tokens' "
                        f"output [N, H] = {hidden.shape} in {hidden.dtype}")
            chex.assert_shape(output, hidden.shape, custom_message=contract)
            chex.assert_type(output, hidden.dtype, custom_message=contract)
            return output, statistics
        output = experts_forward(hidden, index.astype(jnp.int32), weights, adapter_index=adapter_index)
        if self.mode == TENSOR_PARALLEL:
            output = jax.lax.psum(output, self.layout.tp_axes)
        return output, DispatchStatistics.zeros()

    def _reference_style_call(self, experts_forward: ExpertsForward, capacity: float) -> EPImplementation:
        """A reference-style implementation (`__call__(hidden_states, top_k_index, top_k_weights)` using
        `self.experts_forward`) built for the call being traced: its experts are this call's, and so is its
        `capacity` option when it takes capacity options."""
        return build_ep_implementation(
            self.ep_implementation, experts_forward, self.local_slots, self.groups,
            schedule=self.schedule, **(self.ep_options | {"capacity": capacity}),
        )
