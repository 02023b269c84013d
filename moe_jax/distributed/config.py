"""`DistributedConfig`: the one object that says how a model is laid out over devices.

Fields, defaults, derived sizes, validation order and error texts are those of Hugging Face Transformers'
`transformers.distributed.DistributedConfig`, so a configuration written for the PyTorch reference means the
same thing here. The one translation: where the reference counts torch.distributed *processes*, we count JAX
*devices* (a device is a rank).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Literal

from .runtime import is_main_process

# Fields beyond the reference's (after its own, in this order), with their defaults.
EXTENSION_DEFAULTS = {"cp_size": 1, "cp_strategy": "all_gather"}
# How attention sees the other cp ranks' keys (`moe_jax.nn.context_attention` runs them).
CP_STRATEGIES = ("all_gather", "ring")


def check_context_parallel(config) -> None:
    """A `DistributedConfig`'s context-parallel fields (ValueError naming the bad value and the fix)."""
    if config.cp_strategy not in CP_STRATEGIES:
        raise ValueError(f"`cp_strategy` must be one of {', '.join(map(repr, CP_STRATEGIES))}, got "
                         f"{config.cp_strategy!r}.")
    if config.cp_size == 1 or config.ep_size == 1:
        return
    cp, tp, fsdp, ep = config.cp_size, config.tp_size, config.fsdp_size, config.ep_size
    groups = ep // tp   # an expert group's cp x fsdp ranks
    if not (cp % groups == 0 or (groups % cp == 0 and fsdp % (groups // cp) == 0)):
        raise ValueError(
            f"`ep_size` ({ep}) must divide `fsdp_size * cp_size * tp_size` ({fsdp * cp * tp}) with expert groups "
            f"that nest in cp: `ep_size / tp_size` ({groups}) must divide `cp_size` ({cp}), or be a multiple of it "
            "whose quotient divides `fsdp_size`.")


def _world_size_for_tp() -> int:
    """The number of ranks a missing `tp_size` is derived from.

    The reference reads `WORLD_SIZE`; launchers that set it keep working. Without it, a JAX program
    sees its ranks as devices, so we count them.
    """
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    import jax

    return jax.device_count()


def _check_ep_implementation(name: str) -> None:
    """An unknown name fails here, where the user wrote it, rather than at the first forward."""
    # Imported here: expert_parallel pulls in JAX and the ops, which import this module.
    from .expert_parallel import check_registered

    check_registered(name)


@dataclass
class DistributedConfig:
    """How a model is sharded: tensor (`tp`), expert (`ep`), fully-sharded data (`fsdp`) parallelism, HSDP
    replicas (`dp_replicate`) and pipeline stages (`pp`).

    The devices are `pp_size * dp_replicate_size * fsdp_size * tp_size`; `ep_size` adds none, it regroups
    the same devices for the experts (see `moe_jax.distributed.mesh`):

        8 devices, tp_size=2, fsdp_size=4, ep_size=4 (efsdp_size=2)
        device     0     1     2     3     4     5     6     7
        batch      [ B0 ]      [ B1 ]      [ B2 ]      [ B3 ]
        experts    E0E1  E2E3  E4E5  E6E7  E0E1  E2E3  E4E5  E6E7

    Args:
        tp_size: devices per tensor-parallel group. `None` with a `tp_plan` set: derived as
            `WORLD_SIZE // (dp_replicate_size * fsdp_size * pp_size)` (`WORLD_SIZE` from the environment,
            else the number of JAX devices); `None` without a `tp_plan`: 1.
        tp_plan: `"auto"`/`None` use the model's plan; a dict overrides rules of it key by key; `{}` applies
            no tensor-parallel rule.
        enable_sequence_parallel: sequence parallelism over tp (Megatron's): the residual stream, norms and
            router inputs are split over tp along the sequence, tp's all-reduces become reduce-scatter +
            all-gather. Same results; less activation memory. No effect with `tp_size == 1`.
        enable_expert_parallel: deprecated. Without `ep_size`, same as `ep_size=tp_size, tp_plan={}`.
        fsdp_size: devices that FSDP-shard parameters and see distinct batches. Default 1.
        dp_replicate_size: HSDP replicas of the FSDP-sharded model. Default 1.
        fsdp_plan: overrides of the model's FSDP plan, applied when `dp_replicate_size * fsdp_size > 1`.
        fsdp_cpu_offload: keep the train state (parameters and optimizer state) in pinned host memory between
            steps (`make_train_step(offload=)` places the two apart).
        fsdp_mixed_precision: bf16 parameters with fp32 gradient reduction (reference's FSDP2 policy).
        pp_size: pipeline stages. Default 1.
        ep_size: devices owning distinct expert shards; a multiple of `tp_size` that divides
            `fsdp_size * tp_size`. Default 1.
        ep_plan: overrides of the model's expert-parallel plan, applied when `ep_size > 1`.
        cp_size: context parallelism (an extension beyond the reference's fields): devices that split each
            sequence of a batch between them (`moe_jax.distributed.context`). Default 1.
        cp_strategy: how attention sees the other ranks' keys under `cp_size > 1`: "all_gather" (gather keys
            and values: few KV heads, GQA / MLA) or "ring" (pass them around with `ppermute`, online softmax).
        ep_implementation: how tokens reach the experts: "auto", "all_to_all", "all_reduce",
            "deepgemm_megamoe" or a name registered in `EPImplementationInterface` (register it before
            building the config). Checked here, after the reference's checks; the reference defers the
            check to the first forward.
    """

    tp_size: int | None = None
    tp_plan: dict[str, str] | Literal["auto"] | None = None
    enable_sequence_parallel: bool = False
    enable_expert_parallel: bool = False
    fsdp_size: int | None = None
    dp_replicate_size: int | None = None
    fsdp_plan: dict[str, str] | None = None
    fsdp_cpu_offload: bool = False
    fsdp_mixed_precision: bool = False
    pp_size: int | None = None
    ep_size: int | None = None
    ep_plan: dict[str, str] | None = None
    ep_implementation: str = "auto"
    cp_size: int | None = None
    cp_strategy: str = "all_gather"

    @property
    def efsdp_size(self) -> int:
        """Devices that own the same experts and FSDP-shard them: `fsdp_size * tp_size // ep_size` (times
        `cp_size`, whose ranks hold the same experts).

            pp x fsdp x tp == pp x efsdp x ep

        ep == tp gives efsdp == fsdp; ep == fsdp * tp gives efsdp == 1 (every expert whole on one device).
        """
        return self.fsdp_size * self.cp_size * self.tp_size // self.ep_size

    @property
    def dp_size(self) -> int:
        """Devices groups that see distinct batches: `dp_replicate_size * fsdp_size`."""
        return self.dp_replicate_size * self.fsdp_size

    def __post_init__(self):
        self._resolve_parallelism()
        self._validate_mesh_config()

    def _resolve_parallelism(self) -> None:
        for value in (self.tp_size, self.fsdp_size, self.dp_replicate_size, self.pp_size, self.ep_size,
                      self.cp_size):
            if value is not None and value < 1:
                raise ValueError(f"Parallelism sizes must be >= 1, got {value}.")

        if self.fsdp_size is None:
            self.fsdp_size = 1
        if self.dp_replicate_size is None:
            self.dp_replicate_size = 1
        if self.pp_size is None:
            self.pp_size = 1
        if self.cp_size is None:
            self.cp_size = 1
        if self.tp_size is None and self.tp_plan is not None:
            world_size = _world_size_for_tp()
            other_parallel_size = self.dp_replicate_size * self.fsdp_size * self.pp_size * self.cp_size
            if world_size % other_parallel_size != 0:
                sizes = "dp_replicate_size * fsdp_size * pp_size" + (" * cp_size" if self.cp_size > 1 else "")
                raise ValueError(
                    f"WORLD_SIZE ({world_size}) must be divisible by {sizes} ({other_parallel_size}) to derive tp_size."
                )
            self.tp_size = world_size // other_parallel_size
        elif self.tp_size is None:
            self.tp_size = 1

        if self.enable_expert_parallel and self.ep_size is None:
            self.ep_size = self.tp_size
            if self.tp_plan is None:
                self.tp_plan = {}
            if is_main_process():  # once per job, as the reference warns on rank 0
                warnings.warn(
                    f"`enable_expert_parallel` without `ep_size` is deprecated and will be removed in v5.21. Use "
                    f"ep_size={self.ep_size}, tp_plan={{}} instead, or drop tp_plan to also shard the dense modules.",
                    FutureWarning,
                    stacklevel=4,
                )

        if self.ep_size is None:
            self.ep_size = 1
        # Kept for callers that read it; every decision uses ep_size.
        self.enable_expert_parallel = self.ep_size > 1

    def _validate_mesh_config(self) -> None:
        if self.ep_plan is not None and not isinstance(self.ep_plan, dict):
            raise ValueError("`ep_plan` must be a dictionary or None.")
        if self.fsdp_plan is not None and not isinstance(self.fsdp_plan, dict):
            raise ValueError("`fsdp_plan` must be a dictionary or None.")

        if self.ep_size > 1:
            if self.ep_size % self.tp_size:
                raise ValueError("`ep_size` must be a multiple of `tp_size`.")
            if self.cp_size == 1 and (self.fsdp_size * self.tp_size) % self.ep_size:
                raise ValueError("`ep_size` must divide `fsdp_size * tp_size`.")
        check_context_parallel(self)

        # The reference refuses FSDP / HSDP with pp here ("Combining FSDP with pipeline parallelism is not
        # supported yet"); moe_jax runs them together (moe_jax.models.pipeline), a documented divergence.
        _check_ep_implementation(self.ep_implementation)

    def validate_resolved_ep_plan(self, ep_plan: dict[str, str]) -> None:
        """Checks that need the merged EP plan (called by plan resolution).

        The reference also requires torch>=2.7 here; JAX has no such floor.
        """
        # The reference refuses token dispatch with pp here ("Combining token dispatch with pipeline parallelism is
        # not supported/tested yet"); moe_jax dispatches inside each stage, a documented divergence.
        return

    @property
    def num_devices(self) -> int:
        """Devices this layout needs: `pp_size * dp_replicate_size * fsdp_size * cp_size * tp_size` (ep adds
        none)."""
        return self.pp_size * self.dp_replicate_size * self.fsdp_size * self.cp_size * self.tp_size

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> DistributedConfig:
        """Build from a dict; `kwargs` win over its keys, unknown keys are dropped (as the reference does)."""
        merged = {**config_dict, **kwargs}
        valid_keys = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in merged.items() if key in valid_keys})

    def to_dict(self) -> dict:
        """The fields as a dict; the extensions beyond the reference's fields only where they are set, so a
        config without them writes the reference's JSON."""
        values = asdict(self)
        return {name: value for name, value in values.items()
                if name not in EXTENSION_DEFAULTS or value != EXTENSION_DEFAULTS[name]}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        with open(json_file_path, "w", encoding="utf-8") as handle:
            handle.write(self.to_json_string())

    def __repr__(self) -> str:
        return f"{self.__class__.__name__} {self.to_json_string()}"
