"""Devices -> `jax.sharding.Mesh`, and the named device groups every sharding is written in.

The reference lays ranks out row-major over `(pp, dp_replicate, fsdp, tp)` and carves a second, expert view
`(pp, dp_replicate, efsdp, ep)` out of the same ranks. One JAX mesh holds both views once `fsdp` is factored
into `efsdp x ep_fsdp` with `ep_fsdp = ep_size // tp_size`:

    mesh axes (slowest -> fastest):  pp, dp_replicate, efsdp, ep_fsdp, tp

    logical group     mesh axes                          reference group
    batch             (dp_replicate, efsdp, ep_fsdp)     index = device // tp_size
    fsdp              (efsdp, ep_fsdp)                   stride tp_size inside a block
    tp                (tp,)                              tp_size consecutive devices
    ep                (ep_fsdp, tp)                      ep_size consecutive devices
    efsdp             (efsdp,)                           stride ep_size inside a block
    dp_replicate      (dp_replicate,)                    stride fsdp_size * tp_size

    8 devices, tp=2, fsdp=4, ep=4  ->  mesh (pp=1, dp_replicate=1, efsdp=2, ep_fsdp=2, tp=2)
    device    0     1     2     3  |  4     5     6     7
    batch     0     0     1     1  |  2     2     3     3
    experts   E0E1  E2E3  E4E5  E6E7 | E0E1  E2E3  E4E5  E6E7     efsdp groups {r, r+4}

Context parallelism (`cp_size`, an extension) splits each sequence over `cp_size` devices between the fsdp and
tp axes. Expert groups may span cp ranks (their tokens are more tokens of one batch): `cp` is factored into
`cp x ep_cp`, `ep_cp` the part inside an expert group, so an ep group stays consecutive ranks:

    mesh axes (slowest -> fastest):  pp, dp_replicate, efsdp, ep_fsdp, cp, ep_cp, tp
    batch (B)  (dp_replicate, efsdp, ep_fsdp)   length (S)  (cp, ep_cp)   tokens (B*S)  both, in mesh order
    ep         (ep_fsdp, ep_cp, tp)             parameters are replicated over cp (FSDP-shard them over fsdp)

Without expert parallelism (`ep_size == 1`) the expert view is not used for sharding; its groups follow the
reference's formulas anyway (`ep` groups are single devices, the `efsdp` group is the whole block).

This module is the only place that knows the axis names: every PartitionSpec and collective in the library is
written with the tuples of `DeviceLayout`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .config import DistributedConfig
from .runtime import job_devices

PP = "pp"
DP_REPLICATE = "dp_replicate"
EFSDP = "efsdp"
EP_FSDP = "ep_fsdp"
CP = "cp"
EP_CP = "ep_cp"
TP = "tp"
MESH_AXES = (PP, DP_REPLICATE, EFSDP, EP_FSDP, CP, EP_CP, TP)
# The axes inside one pipeline stage: collectives of a layer (its experts' dispatch, their statistics) never
# cross `pp`, where another stage runs other layers.
STAGE_MESH_AXES = (DP_REPLICATE, EFSDP, EP_FSDP, CP, EP_CP, TP)

LOGICAL_GROUPS = ("batch", "fsdp", "tp", "ep", "efsdp", "dp_replicate", "pp", "cp")


@dataclass(frozen=True)
class DeviceLayout:
    """The mesh shape a `DistributedConfig` implies and its logical device groups as mesh-axis tuples.

    Pure integer arithmetic: building one needs no devices, so layouts can be checked and drawn anywhere.
    """

    pp_size: int
    dp_replicate_size: int
    fsdp_size: int
    tp_size: int
    ep_size: int
    cp_size: int = 1
    sequence_parallel: bool = False   # the residual stream split over tp along the sequence (Megatron's SP)

    @classmethod
    def from_config(cls, config: DistributedConfig) -> DeviceLayout:
        return cls(
            pp_size=config.pp_size,
            dp_replicate_size=config.dp_replicate_size,
            fsdp_size=config.fsdp_size,
            tp_size=config.tp_size,
            ep_size=config.ep_size,
            cp_size=getattr(config, "cp_size", 1),
            sequence_parallel=bool(config.enable_sequence_parallel),
        )

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    @property
    def ep_cp_size(self) -> int:
        """The part of cp inside one EP group (`DistributedConfig` checks that the groups nest)."""
        if not self.expert_parallel:
            return 1
        return math.gcd(self.ep_size // self.tp_size, self.cp_size)

    @property
    def ep_fsdp_size(self) -> int:
        """How many fsdp ranks one EP group spans (its TP groups, past the cp ranks it holds)."""
        return self.ep_size // self.tp_size // self.ep_cp_size if self.expert_parallel else 1

    @property
    def efsdp_axis_size(self) -> int:
        """Size of the `efsdp` mesh axis (with EP off it carries the whole fsdp dimension)."""
        return self.fsdp_size // self.ep_fsdp_size

    @property
    def efsdp_size(self) -> int:
        """The reference's `efsdp_size = fsdp_size * tp_size // ep_size` (times `cp_size`: cp ranks hold the
        same experts)."""
        return self.fsdp_size * self.cp_size * self.tp_size // self.ep_size

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {
            PP: self.pp_size,
            DP_REPLICATE: self.dp_replicate_size,
            EFSDP: self.efsdp_axis_size,
            EP_FSDP: self.ep_fsdp_size,
            CP: self.cp_size // self.ep_cp_size,
            EP_CP: self.ep_cp_size,
            TP: self.tp_size,
        }

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.axis_sizes[name] for name in MESH_AXES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    # Logical groups, as tuples of mesh axes usable in PartitionSpec entries and collectives. Axes of size 1
    # are left out: they split nothing, and shard_map's type checks then see only real device groups.
    def _present(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(axis for axis in axes if self.axis_sizes[axis] > 1)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return self._present((DP_REPLICATE, EFSDP, EP_FSDP))

    @property
    def cp_axes(self) -> tuple[str, ...]:
        """The axes that split each sequence (`length`)."""
        return self._present((CP, EP_CP))

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """The axes that split the residual stream's sequence: cp's, and tp's under sequence parallelism."""
        return self.cp_axes + (self.tp_axes if self.sequence_parallel else ())

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes of flattened [B*S] rows: the batch's, then the sequence's (mesh order = row order)."""
        return self._present((DP_REPLICATE, EFSDP, EP_FSDP, CP, EP_CP))

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        return self._present((EFSDP, EP_FSDP))

    @property
    def tp_axes(self) -> tuple[str, ...]:
        return self._present((TP,))

    @property
    def ep_axes(self) -> tuple[str, ...]:
        return self._present((EP_FSDP, EP_CP, TP)) if self.expert_parallel else ()

    @property
    def efsdp_axes(self) -> tuple[str, ...]:
        return self._present((EFSDP,) if self.expert_parallel else (EFSDP, EP_FSDP, TP))

    @property
    def dp_replicate_axes(self) -> tuple[str, ...]:
        return self._present((DP_REPLICATE,))

    @property
    def pp_axes(self) -> tuple[str, ...]:
        return self._present((PP,))

    def axes(self, group: str) -> tuple[str, ...]:
        """Mesh axes of a logical group named in `LOGICAL_GROUPS`."""
        if group not in LOGICAL_GROUPS:
            raise KeyError(f"Unknown device group {group!r}; use one of {', '.join(LOGICAL_GROUPS)}.")
        return getattr(self, f"{group}_axes")

    def group_size(self, group: str) -> int:
        return math.prod(self.axis_sizes[name] for name in self.axes(group))

    def device_groups(self, group: str) -> list[list[int]]:
        """Device indices of every group of `group`, each sorted, in order of their first device.

        Devices are numbered as ranks are in the reference: position in the row-major mesh.
        """
        group_axes = self.axes(group)
        ranks = np.arange(self.num_devices).reshape(self.mesh_shape)
        other_axes = [i for i, name in enumerate(MESH_AXES) if name not in group_axes]
        member_axes = [MESH_AXES.index(name) for name in group_axes]
        grouped = ranks.transpose(other_axes + member_axes).reshape(-1, self.group_size(group))
        return sorted(sorted(int(r) for r in row) for row in grouped)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a device index."""
        return dict(zip(MESH_AXES, (int(c) for c in np.unravel_index(rank, self.mesh_shape))))

    def batch_index(self, rank: int) -> int:
        """Which data batch a device holds inside its pipeline stage: `rank // (cp_size * tp_size)` within the
        stage (cp ranks hold parts of the same rows)."""
        stage_size = self.num_devices // self.pp_size
        return (rank % stage_size) // (self.cp_size * self.tp_size)

    def ep_rank(self, rank: int) -> int:
        """Position of a device in its EP group (the reference's `e = i % ep_size`)."""
        return rank % self.ep_size

    def experts_of(self, rank: int, num_experts: int) -> range:
        """Global ids of the experts a device owns (whole, before efsdp sharding)."""
        check_experts_divisible(num_experts, self.ep_size)
        local = num_experts // self.ep_size
        start = self.ep_rank(rank) * local
        return range(start, start + local)


def spec_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for mesh `axes`: None, one axis name, or a tuple of them."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def check_experts_divisible(num_experts: int, ep_size: int) -> None:
    if num_experts % ep_size:
        raise ValueError(f"Cannot evenly shard {num_experts} experts across {ep_size} expert-parallel ranks.")


def _virtual_devices_hint(needed: int, devices: list) -> str:
    """On CPU, with fewer devices than the layout needs: how to get more (as the `moe-jax` commands say)."""
    if len(devices) >= needed or not devices or devices[0].platform != "cpu":
        return ""
    flag = f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
    return (f" On CPU, JAX makes {needed} virtual devices when {flag} is set before it starts (in the "
            "shell, or os.environ before `import jax`).")


def build_mesh(config: DistributedConfig, devices: Sequence | None = None):
    """The `jax.sharding.Mesh` of `config` over `devices` (default: `model_devices`, the first
    `pp * dp_replicate * fsdp * tp` of the job in rank order, as `jax.devices()[:n]` would pick; a multi-process
    job: all of its devices).

    Devices given explicitly must be as many as the layout needs (the reference's world-size error), except that
    a config that needs one device (no parallelism) uses the first device when more are given.
    """
    import jax

    layout = DeviceLayout.from_config(config)
    devices = model_devices(config, devices)
    if layout.num_devices == 1:
        devices = devices[:1]
    if len(devices) != layout.num_devices:
        raise RuntimeError(
            f"The parallel mesh requires {layout.num_devices} devices, but world_size is {len(devices)}. "
            f"Choose sizes with pp_size * dp_replicate_size * fsdp_size * "
            f"{'cp_size * ' if layout.cp_size > 1 else ''}tp_size == {len(devices)}."
            + _virtual_devices_hint(layout.num_devices, devices)
        )
    device_grid = np.asarray(devices, dtype=object).reshape(layout.mesh_shape)
    return jax.sharding.Mesh(device_grid, MESH_AXES)


def model_devices(config: DistributedConfig, devices: Sequence | None = None) -> list:
    """The devices a model's mesh is built over: `devices` as given, or by default the first
    `pp * dp_replicate * fsdp * tp` of the job (`runtime.job_devices`), as `jax.devices()[:n]` would pick. A
    multi-process job uses all of its devices (every process must hold a part of the mesh): there, as with
    too few devices, `build_mesh` raises the reference's world-size error. `build_mesh`'s default."""
    import jax

    if devices is not None:
        return list(devices)
    every = job_devices()
    needed = DeviceLayout.from_config(config).num_devices
    if jax.process_count() == 1 and len(every) > needed:
        return every[:needed]
    return every
