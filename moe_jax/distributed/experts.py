"""Runs one experts module under the resolved plans, inside `shard_map`.

Three ways, decided by the plans (never by model code):

    "ep"     the experts module has an `ep_dispatch_experts` rule (ep_size > 1): weights split by whole
             experts over the ep group (gathered over efsdp by XLA before the call), tokens brought to
             them by the `ep_implementation`.
    "tp"     a `moe_tp_experts` rule (tp_size > 1, EP off): every device runs its slice of the
             intermediate dim of every expert on the shared batch; outputs are summed over tp.
    "local"  neither: each device runs all experts on its own batch (FSDP shards gathered by XLA).

    experts_fn(tokens [N, H], expert_ids [N, K], weights [N, K], **local_params) -> [N, H]

is the experts module's math (e.g. `moe_jax.ops.experts.swiglu_experts`); ids are local and the sentinel
`num_local_experts` contributes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .expert_parallel import DispatchStatistics, ExpertGroups, build_ep_implementation, vary_over
from .mesh import MESH_AXES, DeviceLayout

EP_DISPATCH = "ep"
TENSOR_PARALLEL = "tp"
LOCAL = "local"


def experts_mode(module_name: str, tp_plan: dict[str, str], ep_plan: dict[str, str]) -> str:
    """Which way an experts module runs, from its expanded plan rules."""
    if ep_plan.get(module_name) == "ep_dispatch_experts":
        return EP_DISPATCH
    if tp_plan.get(module_name) == "moe_tp_experts":
        return TENSOR_PARALLEL
    return LOCAL


def _spec_entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


class ShardedExperts:
    """One experts module bound to a mesh: `__call__(hidden, top_k_index, top_k_weights, params)`.

    `params` are the module's global arrays (`{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}`);
    `param_layout` says which dim of each is the expert dim (0) and which is the intermediate dim split
    by tp in "tp" mode, e.g. `{"gate_up_proj": "packed", "down_proj": 2}`.
    """

    def __init__(
        self,
        *,
        mesh: jax.sharding.Mesh,
        layout: DeviceLayout,
        mode: str,
        num_experts: int,
        experts_fn: Callable,
        ep_implementation: str = "auto",
        intermediate_dims: dict[str, int | str] | None = None,
        **ep_options,
    ):
        self.mesh = mesh
        self.layout = layout
        self.mode = mode
        self.num_experts = num_experts
        self.experts_fn = experts_fn
        self.intermediate_dims = intermediate_dims or {"gate_up_proj": "packed", "down_proj": 2}
        self._bound_params: dict | None = None
        self.implementation = None
        if mode == EP_DISPATCH:
            groups = ExpertGroups(
                ep_axes=layout.ep_axes,
                tp_axes=layout.tp_axes,
                ep_size=layout.ep_size,
                tp_size=layout.tp_size,
                all_axes=MESH_AXES,
            )
            if num_experts % layout.ep_size:
                raise ValueError(
                    f"Cannot evenly shard {num_experts} experts across {layout.ep_size} expert-parallel ranks."
                )
            self.implementation = build_ep_implementation(
                ep_implementation, self._experts_forward, num_experts // layout.ep_size, groups, **ep_options
            )

    @contextlib.contextmanager
    def _bind(self, local_params: dict):
        self._bound_params = local_params
        try:
            yield
        finally:
            self._bound_params = None

    def _experts_forward(self, tokens, expert_ids, weights):
        """The experts' forward on this device's weights (the reference's `experts_forward`)."""
        return self.experts_fn(tokens, expert_ids, weights, **self._bound_params)

    # Sharding of the inputs of the shard_map body.
    def _batch_spec(self) -> P:
        return P(_spec_entry(self.layout.batch_axes), None)

    def _param_spec_and_view(self, name: str, array: jax.Array):
        """(array view, PartitionSpec) the body receives for one expert parameter."""
        if self.mode == EP_DISPATCH:
            return array, P(_spec_entry(self.layout.ep_axes), *([None] * (array.ndim - 1)))
        if self.mode == TENSOR_PARALLEL:
            dim = self.intermediate_dims.get(name)
            if dim == "packed":
                # [E, 2I, H] -> [E, 2, I, H]: tp splits I, so each device holds matching gate and up rows.
                experts, fused, hidden = array.shape
                view = array.reshape(experts, 2, fused // 2, hidden)
                return view, P(None, None, _spec_entry(self.layout.tp_axes), None)
            if dim is not None:
                entries = [None] * array.ndim
                entries[dim] = _spec_entry(self.layout.tp_axes)
                return array, P(*entries)
        return array, P(*([None] * array.ndim))

    def __call__(self, hidden_states, top_k_index, top_k_weights, params: dict, *, inference: bool = False):
        """hidden_states: [N, H]; top_k_index: [N, K] global ids; top_k_weights: [N, K]
        -> (output [N, H] in hidden dtype, DispatchStatistics summed over all devices)."""
        names = list(params)
        views, specs = zip(*(self._param_spec_and_view(name, params[name]) for name in names))
        batch = self._batch_spec()

        def body(hidden, index, weights, *local_arrays):
            local_params = dict(zip(names, local_arrays))
            if self.mode == TENSOR_PARALLEL and self.intermediate_dims.get("gate_up_proj") == "packed":
                view = local_params["gate_up_proj"]
                local_params["gate_up_proj"] = view.reshape(view.shape[0], -1, view.shape[-1])
            with self._bind(local_params):
                output, statistics = self._run_local(hidden, index, weights, inference)
            # Counts are per device (TP ranks count disjoint slices), so the sum over every device is the total.
            statistics = DispatchStatistics(
                dropped=jax.lax.psum(vary_over(statistics.dropped, MESH_AXES), MESH_AXES),
                padded=jax.lax.psum(vary_over(statistics.padded, MESH_AXES), MESH_AXES),
                capacity=jax.lax.pmax(vary_over(statistics.capacity, MESH_AXES), MESH_AXES),
            )
            return output.astype(hidden.dtype), statistics

        run = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(batch, batch, batch, *specs),
            out_specs=(batch, P()),
        )
        return run(hidden_states, top_k_index, top_k_weights, *views)

    def _run_local(self, hidden, index, weights, inference):
        if self.mode == EP_DISPATCH:
            implementation = self.implementation
            if getattr(implementation, "uses_inference_flag", False):
                result = implementation(hidden, index, weights, inference=inference)
            else:
                result = implementation(hidden, index, weights)
            if isinstance(result, tuple):
                return result
            return result, DispatchStatistics.zeros()
        output = self._experts_forward(hidden, index.astype(jnp.int32), weights)
        if self.mode == TENSOR_PARALLEL:
            output = jax.lax.psum(output, self.layout.tp_axes)
        return output, DispatchStatistics.zeros()
