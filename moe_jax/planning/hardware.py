"""What one accelerator can do, as data: the rates the planner's step-time model divides by.

    profile = load_hardware("h100")                 # a named profile, `cpu` (measured here), or a JSON file
    profile.peak_flops("bfloat16"), profile.hbm_bytes_per_second, profile.link("intra").bytes_per_second

Named profiles hold the vendor's datasheet numbers (dense, no sparsity), each with its source in a comment.
Link latencies are not datasheet numbers: they are the usual small-message latency of the fabric's collective
library, and say so. A JSON file gives the same fields (`HardwareProfile` below) for any other device:

    {"name": "my-gpu", "peak_flops": {"bfloat16": 5e14, "float32": 6e13}, "hbm_bytes_per_second": 2e12,
     "memory_bytes": 8e10, "devices_per_node": 8,
     "intra_node": {"bytes_per_second": 3e11, "latency_seconds": 5e-6},
     "inter_node": {"bytes_per_second": 2.5e10, "latency_seconds": 1e-5}}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Link:
    """One direction of one device's share of a fabric: bytes/s it can send, and a message's latency."""

    bytes_per_second: float
    latency_seconds: float


@dataclass(frozen=True)
class HardwareProfile:
    """peak_flops: dense matmul FLOP/s per compute dtype ("bfloat16", "float32": what XLA runs a float32 dot on
    by default); kernel_overhead_seconds: the fixed cost of one kernel launch (0: not modelled, see the
    profile); devices_per_node: devices one intra-node fabric links."""

    name: str
    peak_flops: dict[str, float]
    hbm_bytes_per_second: float
    memory_bytes: float
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    kernel_overhead_seconds: float = 0.0
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def flops_per_second(self, dtype: str) -> float:
        return self.peak_flops.get(dtype) or self.peak_flops["float32"]

    def link(self, crosses_nodes: bool) -> Link:
        return self.inter_node if crosses_nodes else self.intra_node

    def to_dict(self) -> dict:
        return asdict(self)


GB = 1e9
TB = 1e12

# NVLink / NVSwitch all-reduce latency for small messages (NCCL), and InfiniBand / RoCE between nodes: typical
# figures of the collective library, not datasheet numbers.
NVLINK_LATENCY = 5e-6
NETWORK_LATENCY = 1e-5

NAMED_PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100",
        # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: BF16 1,979 TFLOPS with sparsity (989 dense);
        # TF32 989 TFLOPS with sparsity (494.5 dense): XLA runs float32 dots on TF32 at default precision.
        peak_flops={"bfloat16": 989 * TB, "float32": 494.5 * TB},
        hbm_bytes_per_second=3.35 * TB,        # H100 SXM5 datasheet: GPU memory bandwidth 3.35 TB/s
        memory_bytes=80 * GB,                  # H100 SXM5 datasheet: GPU memory 80 GB
        devices_per_node=8,                    # HGX H100: 8 GPUs on NVSwitch
        # H100 SXM5 datasheet: NVLink 900 GB/s (both directions together): 450 GB/s each way
        intra_node=Link(450 * GB, NVLINK_LATENCY),
        # DGX H100 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU: 50 GB/s each way
        inter_node=Link(50 * GB, NETWORK_LATENCY),
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5); NVIDIA DGX H100 datasheet",
    ),
    "h200": HardwareProfile(
        name="h200",
        # NVIDIA H200 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS and TF32 989 TFLOPS with sparsity
        peak_flops={"bfloat16": 989 * TB, "float32": 494.5 * TB},
        hbm_bytes_per_second=4.8 * TB,         # H200 SXM datasheet: GPU memory bandwidth 4.8 TB/s
        memory_bytes=141 * GB,                 # H200 SXM datasheet: GPU memory 141 GB HBM3e
        devices_per_node=8,                    # HGX H200: 8 GPUs on NVSwitch
        intra_node=Link(450 * GB, NVLINK_LATENCY),   # H200 SXM datasheet: NVLink 900 GB/s (both directions)
        inter_node=Link(50 * GB, NETWORK_LATENCY),   # HGX H200 reference: one 400 Gb/s ConnectX-7 per GPU
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM)",
    ),
    "b200": HardwareProfile(
        name="b200",
        # NVIDIA HGX B200 datasheet (8 GPUs): FP16/BF16 36 PFLOPS and TF32 18 PFLOPS with sparsity, i.e. per
        # GPU 2.25 PFLOPS BF16 and 1.125 PFLOPS TF32 dense
        peak_flops={"bfloat16": 2250 * TB, "float32": 1125 * TB},
        hbm_bytes_per_second=8 * TB,           # HGX B200 datasheet: 64 TB/s HBM3e bandwidth over 8 GPUs
        memory_bytes=180 * GB,                 # DGX B200 datasheet: 1,440 GB total GPU memory over 8 GPUs
        devices_per_node=8,
        # HGX B200 datasheet: fifth-generation NVLink, 1.8 TB/s per GPU (both directions): 900 GB/s each way
        intra_node=Link(900 * GB, NVLINK_LATENCY),
        inter_node=Link(50 * GB, NETWORK_LATENCY),   # DGX B200 datasheet: 8x 400 Gb/s ConnectX-7, one per GPU
        source="NVIDIA HGX B200 and DGX B200 datasheets",
    ),
    "a100": HardwareProfile(
        name="a100",
        # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 312 TFLOPS, TF32 156 TFLOPS (dense)
        peak_flops={"bfloat16": 312 * TB, "float32": 156 * TB},
        hbm_bytes_per_second=2.039 * TB,       # A100 80GB SXM datasheet: 2,039 GB/s
        memory_bytes=80 * GB,                  # A100 80GB SXM datasheet: 80 GB HBM2e
        devices_per_node=8,
        intra_node=Link(300 * GB, NVLINK_LATENCY),   # A100 SXM datasheet: NVLink 600 GB/s (both directions)
        inter_node=Link(25 * GB, NETWORK_LATENCY),   # DGX A100 datasheet: 8x 200 Gb/s ConnectX-6, one per GPU
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); NVIDIA DGX A100 datasheet",
    ),
    "tpu-v5p": HardwareProfile(
        name="tpu-v5p",
        # Google Cloud TPU v5p documentation (system architecture): 459 TFLOPS bf16 per chip; XLA:TPU runs a
        # float32 dot as one bfloat16 pass at default precision
        peak_flops={"bfloat16": 459 * TB, "float32": 459 * TB},
        hbm_bytes_per_second=2765 * GB,        # TPU v5p documentation: HBM bandwidth 2,765 GBps per chip
        memory_bytes=95 * 2**30,               # TPU v5p documentation: HBM2e capacity 95 GiB per chip
        # ICI links every chip of a slice (a v5p pod: 8,960 chips): one "node" for the planner
        devices_per_node=8960,
        # TPU v5p documentation: ICI 4,800 Gbps per chip (all links, both directions): 300 GB/s each way
        intra_node=Link(300 * GB, NVLINK_LATENCY),
        inter_node=Link(25 * GB, NETWORK_LATENCY),   # data-center network between slices: assumed 200 Gb/s
        source="Google Cloud TPU v5p documentation (system architecture)",
        notes=("between slices (--nodes > 1) the data-center network rate is an assumption, not a documented "
               "figure",),
    ),
}
HARDWARE_CHOICES = (*NAMED_PROFILES, "cpu")


def _link(values: dict) -> Link:
    return Link(float(values["bytes_per_second"]), float(values["latency_seconds"]))


def profile_from_dict(values: dict, source: str) -> HardwareProfile:
    required = {"peak_flops", "hbm_bytes_per_second", "memory_bytes", "intra_node", "inter_node"}
    if missing := sorted(required - values.keys()):
        raise ValueError(f"{source} lacks {', '.join(missing)}: a hardware file needs {sorted(required)} "
                         "(see moe_jax/planning/hardware.py for an example).")
    return HardwareProfile(
        name=str(values.get("name", Path(source).stem)),
        peak_flops={str(dtype): float(rate) for dtype, rate in values["peak_flops"].items()},
        hbm_bytes_per_second=float(values["hbm_bytes_per_second"]),
        memory_bytes=float(values["memory_bytes"]),
        devices_per_node=int(values.get("devices_per_node", 8)),
        intra_node=_link(values["intra_node"]),
        inter_node=_link(values["inter_node"]),
        kernel_overhead_seconds=float(values.get("kernel_overhead_seconds", 0.0)),
        source=str(values.get("source", source)),
        notes=tuple(values.get("notes", ())),
    )


def load_hardware(name: str, *, devices: int | None = None) -> HardwareProfile:
    """A named profile (`HARDWARE_CHOICES`), `cpu` (measured now on this machine's `devices` virtual devices),
    or the path of a JSON file with `HardwareProfile`'s fields."""
    if name in NAMED_PROFILES:
        return NAMED_PROFILES[name]
    if name == "cpu":
        from .cpu_calibration import measure_cpu_profile

        return measure_cpu_profile(devices or 1)
    path = Path(name)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"--hardware {name}: no such file; give a JSON hardware profile or one of "
                             f"{', '.join(HARDWARE_CHOICES)}.")
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"--hardware {name} is not valid JSON ({error}).") from error
        return profile_from_dict(values, str(path))
    raise ValueError(f"unknown hardware {name!r}: use one of {', '.join(HARDWARE_CHOICES)}, or the path of a JSON "
                     "file with the profile's fields (peak_flops, hbm_bytes_per_second, memory_bytes, intra_node, "
                     "inter_node).")
