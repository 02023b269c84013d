"""Redundant expert slots and the expert placement of a built model. A mixin of `MoeForCausalLM`.

    model = AutoModelForCausalLM.from_pretrained(path, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 num_redundant_experts=8)    # 8 + 8 slots per sparse layer
    load = model.forward(ids).expert_load                                  # [sparse layers, E]
    model.set_expert_placement(balanced_placement(load, num_redundant_experts=8, ep_size=8))
    model(ids)                                   # the same logits; the ep ranks' work more even (ep_rank_load)
    model.apply(model.params, ids, expert_placement=placement)            # the pure step: an input array

Each sparse layer runs E + R physical expert slots over the ep ranks ((E + R) / ep_size each); the
`ExpertPlacement` (`moe_jax.distributed.eplb`) says which logical expert each slot holds. It is an input of the
step, never a static argument, so a new placement runs the same compiled programs. Parameters, checkpoints and
optimizer state stay per logical expert.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.eplb import ExpertPlacement, check_num_redundant_experts, identity_placement
from ..distributed.experts import TENSOR_PARALLEL, ShardedExperts, experts_mode
from ..distributed.host_arrays import host_to_global
from ..models.mtp import mtp_sparse_layers


class ExpertPlacementMixin:
    """num_redundant_experts, expert_placement, set_expert_placement, identity_expert_placement,
    check_expert_placement, and the experts modules each step runs (`_build_sharded_experts`)."""

    num_redundant_experts: int = 0

    def _init_expert_placement(self, num_redundant_experts: int) -> None:
        """Check R against the layout before anything is built (the placement starts as the identity)."""
        redundant = int(num_redundant_experts)
        layout = self.layout
        if redundant:
            if layout.ep_size == 1:
                raise ValueError(
                    f"num_redundant_experts={redundant} adds expert slots to the ranks of expert parallelism, which "
                    "this layout does not have (ep_size=1: every device already holds every expert it runs); set "
                    "ep_size > 1 in the DistributedConfig, or leave num_redundant_experts at 0.")
            if layout.pp_size > 1:
                raise ValueError(
                    f"num_redundant_experts={redundant} is not supported with pipeline stages (pp_size="
                    f"{layout.pp_size}) yet: redundant expert slots run with pp_size=1 (tensor, expert, FSDP and "
                    "data parallelism).")
            check_num_redundant_experts(self.config.num_experts, redundant, layout.ep_size)
        elif redundant < 0:
            check_num_redundant_experts(self.config.num_experts, redundant, layout.ep_size)
        self.num_redundant_experts = redundant
        self._expert_placement: ExpertPlacement | None = None

    def _build_sharded_experts(self) -> dict:
        """One experts module (`distributed.experts.ShardedExperts`) per sparse layer, and per MoE block of the
        multi-token-prediction layers (which run without redundant slots: their experts in the plain layout), its
        mode read from the resolved plans."""
        mtp = mtp_sparse_layers(self.family, self.config, getattr(self, "mtp_layers", 0))
        experts = {
            layer: ShardedExperts(
                mesh=self.mesh, layout=self.layout,
                mode=experts_mode(f"model.layers.{layer}.{self.family.feed_forward_module}.experts",
                                  self.resolved_plans.tp, self.resolved_plans.ep),
                num_experts=self.config.num_experts, experts_forward=self.experts_forward,
                ep_implementation=self.distributed_config.ep_implementation,
                intermediate_dims=self.family.experts_intermediate_dims, schedule=self.capacity_schedule,
                num_redundant_experts=0 if layer in mtp else self.num_redundant_experts,
            )
            for layer in (*self.sparse_layers(), *mtp)
        }
        quantized = self.kept_quantization or (self.weight_quantization and self.weight_quantization.scheme)
        if quantized and any(module.mode == TENSOR_PARALLEL for module in experts.values()):
            # The codes' blocks would be split inside a device's expert rows while their scales are not.
            fix = "load with dequantize=True" if self.kept_quantization else "load without quantize="
            raise ValueError(f"quantised ({quantized}) experts run whole on their devices: with "
                             f"tp_size={self.distributed_config.tp_size} and ep_size=1 tensor parallelism would split "
                             f"them; set ep_size (e.g. ep_size=tp_size) or {fix}.")
        return experts

    @property
    def num_sparse_layers(self) -> int:
        return len(self.sparse_layers())

    def identity_expert_placement(self) -> ExpertPlacement:
        """Slot s of every sparse layer holds expert s % E (`eplb.identity_placement`), on this model's devices."""
        return self._placed(identity_placement(self.num_sparse_layers, self.config.num_experts,
                                               num_redundant_experts=self.num_redundant_experts,
                                               ep_size=self.layout.ep_size))

    @property
    def expert_placement(self) -> ExpertPlacement | None:
        """The placement `forward`, `__call__`, `generate` and continuous batching run (the identity until
        `set_expert_placement`); None for a model without redundant slots."""
        if not self.num_redundant_experts:
            return None
        if self._expert_placement is None:
            self._expert_placement = self.identity_expert_placement()
        return self._expert_placement

    def set_expert_placement(self, placement: ExpertPlacement) -> ExpertPlacement:
        """Run `placement` (e.g. `eplb.balanced_placement(expert_load, num_redundant_experts=R, ep_size=...)`)
        from the next call on. Checked whole first (shapes and that every slot names an expert of each layer,
        which reads device arrays once), then kept replicated on the model's devices; returns what is kept. No
        program is compiled again: the placement is an input of each step."""
        self._require_redundant_slots("set_expert_placement")
        placement = self.check_expert_placement(placement, contents=True)
        self._expert_placement = self._placed(placement)
        return self._expert_placement

    def check_expert_placement(self, placement: ExpertPlacement, *, contents: bool | None = None) -> ExpertPlacement:
        """`placement` if it fits this model (sparse layers, experts, redundant slots, ep ranks), else one
        ValueError naming what differs. contents: also check that each slot names an expert and each expert has
        a slot (`ExpertPlacement.check`); None: only for host (numpy) arrays, so a step's checks never read a
        device value (a placement on devices is checked whole when it is set)."""
        self._require_redundant_slots("an expert placement")
        if not isinstance(placement, ExpertPlacement):
            raise ValueError(f"expected an ExpertPlacement (moe_jax.distributed.eplb), got {type(placement).__name__}.")
        sizes = (self.num_sparse_layers, self.config.num_experts, self.num_redundant_experts, self.layout.ep_size)
        leaves = jax.tree.leaves(placement)
        on_host = not any(isinstance(leaf, jax.Array) for leaf in leaves)
        if contents or (contents is None and on_host):
            return placement.check(*sizes)
        layers, experts, redundant, _ = sizes
        expected = {"physical_to_logical": (layers, experts + redundant),
                    "logical_to_physical": (layers, experts, redundant + 1), "replica_count": (layers, experts)}
        for name, shape in expected.items():
            array = getattr(placement, name)
            if tuple(array.shape) != shape or not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"ExpertPlacement.{name} is {array.dtype}{list(array.shape)}, expected integers of "
                                 f"shape {shape} for {layers} sparse layer(s) of {experts} experts with {redundant} "
                                 "redundant slot(s).")
        return placement

    def _placement_argument(self, placement: ExpertPlacement | None) -> ExpertPlacement | None:
        """What a step takes for `placement`: None without redundant slots; the identity for None; else
        `placement`, checked (`check_expert_placement`). Host arrays are put on the devices, replicated like the
        model's own placements, so that every placement runs one program."""
        if placement is None:
            return None if not self.num_redundant_experts else self._identity_on_devices()
        placement = self.check_expert_placement(placement)
        if any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(placement)):
            return placement
        return self._placed(placement)

    def _identity_on_devices(self) -> ExpertPlacement:
        if getattr(self, "_identity_placement", None) is None:
            self._identity_placement = self.identity_expert_placement()
        return self._identity_placement

    def _placed(self, placement: ExpertPlacement) -> ExpertPlacement:
        placement = jax.tree.map(lambda array: np.asarray(array, np.int32) if not isinstance(array, jax.Array)
                                 else array.astype(np.int32), placement)
        if self.mesh is None:
            return placement
        replicated = NamedSharding(self.mesh, P())   # the same value on every process of a multi-process job
        if self.compiles_only:    # abstract target devices hold nothing: the placement's shapes, for compiling
            return jax.tree.map(lambda array: jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=replicated),
                                placement)
        return jax.tree.map(lambda array: host_to_global(array, replicated), placement)

    def _require_redundant_slots(self, what: str) -> None:
        if not self.num_redundant_experts:
            raise ValueError(f"{what} needs redundant expert slots, and this model has none: build it with "
                             "num_redundant_experts=R (e.g. from_pretrained(path, distributed_config, "
                             "num_redundant_experts=8)); without them slot e is expert e.")
