"""NVIDIA GPUs as XLA:GPU compilation targets, as data: what the compiler needs to know of a device to compile
for it without one (`moe_jax.distributed.targets.target_devices`).

    target = GPU_TARGETS["h100"]
    target.config_text()          # an XLA GpuTargetConfig in protobuf text form

Each figure is the vendor's datasheet or CUDA programming guide number, named in a comment beside it. XLA:GPU
reads the compute capability (which instructions and kernels it may emit: Hopper's TMA and wgmma from 9.0),
the SM count, shared memory and registers (tiling of its fusions and Triton GEMMs), the clock and memory
bandwidth (its cost model, which drives fusion and the latency-hiding scheduler) and the memory size (the
scheduler's memory limit). Nothing here is measured: the programs are compiled, not run.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024



@dataclass(frozen=True)
class GpuTarget:
    """One GPU model. sm_count: streaming multiprocessors; fp32_lanes_per_sm: FP32 cores per SM;
    shared_memory_per_sm / shared_memory_per_block_optin: bytes (the opt-in limit is what one block may ask
    for); clock_ghz: boost clock; memory_bandwidth: bytes/s; memory_bytes: device memory; l2_bytes: L2 cache."""

    name: str
    device_kind: str
    compute_capability: tuple[int, int]
    sm_count: int
    fp32_lanes_per_sm: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    registers_per_sm: int
    threads_per_sm: int
    clock_ghz: float
    memory_bandwidth: float
    memory_bytes: int
    l2_bytes: int
    source: str

    def config_text(self) -> str:
        """The `stream_executor.GpuTargetConfigProto` XLA:GPU compiles for, in protobuf text form."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {48 * KIB}
  shared_memory_per_core: {self.shared_memory_per_sm}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  threads_per_core_limit: {self.threads_per_sm}
  core_count: {self.sm_count}
  fpus_per_core: {self.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: {self.registers_per_sm}
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{self.device_kind}"
"""


# Common to the four: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": 1,024
# threads per block, 48 KiB of static shared memory per block, 64 K 32-bit registers per block, warps of 32.
GPU_TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget(
        name="h100",
        device_kind="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),          # Hopper (CUDA Programming Guide, compute capabilities)
        sm_count=132,                       # H100 SXM5: 132 SMs (NVIDIA H100 Tensor Core GPU Architecture)
        fp32_lanes_per_sm=128,              # H100 architecture whitepaper: 128 FP32 cores per SM
        shared_memory_per_sm=228 * KIB,     # Hopper tuning guide: 228 KB shared memory per SM
        shared_memory_per_block_optin=227 * KIB,   # Hopper tuning guide: up to 227 KB per thread block
        registers_per_sm=65536,             # CUDA Programming Guide, cc 9.0: 64 K registers per SM
        threads_per_sm=2048,                # CUDA Programming Guide, cc 9.0: 2,048 resident threads per SM
        clock_ghz=1.98,                     # H100 SXM5: max boost clock 1,980 MHz
        memory_bandwidth=3.35e12,           # H100 SXM5 datasheet: 3.35 TB/s
        memory_bytes=80 * 10**9,            # H100 SXM5 datasheet: 80 GB HBM3
        l2_bytes=50 * 1024 * KIB,           # H100 architecture whitepaper: 50 MB L2 cache
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5) and architecture whitepaper; Hopper tuning guide",
    ),
    "h200": GpuTarget(
        name="h200",
        device_kind="NVIDIA H200",
        compute_capability=(9, 0),          # the Hopper GH100 die of the H100
        sm_count=132,                       # H200 SXM: the H100 SXM5's 132 SMs
        fp32_lanes_per_sm=128,
        shared_memory_per_sm=228 * KIB,
        shared_memory_per_block_optin=227 * KIB,
        registers_per_sm=65536,
        threads_per_sm=2048,
        clock_ghz=1.98,
        memory_bandwidth=4.8e12,            # H200 SXM datasheet: 4.8 TB/s
        memory_bytes=141 * 10**9,           # H200 SXM datasheet: 141 GB HBM3e
        l2_bytes=50 * 1024 * KIB,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM); the H100's architecture for the SM figures",
    ),
    "b200": GpuTarget(
        name="b200",
        device_kind="NVIDIA B200",
        compute_capability=(10, 0),         # Blackwell datacenter (CUDA Programming Guide, compute capabilities)
        sm_count=148,                       # B200: 148 SMs over its two dies (Blackwell tuning guide)
        fp32_lanes_per_sm=128,
        shared_memory_per_sm=228 * KIB,     # Blackwell tuning guide: 228 KB shared memory per SM
        shared_memory_per_block_optin=227 * KIB,
        registers_per_sm=65536,             # CUDA Programming Guide, cc 10.0: 64 K registers per SM
        threads_per_sm=2048,
        clock_ghz=1.965,                    # B200: boost clock 1,965 MHz
        memory_bandwidth=8e12,              # HGX B200 datasheet: 64 TB/s over 8 GPUs
        memory_bytes=180 * 10**9,           # DGX B200 datasheet: 1,440 GB over 8 GPUs
        l2_bytes=126 * 1024 * KIB,          # Blackwell architecture: 126 MB L2 over the two dies
        source="NVIDIA HGX B200 / DGX B200 datasheets; Blackwell tuning guide",
    ),
    "a100": GpuTarget(
        name="a100",
        device_kind="NVIDIA A100-SXM4-80GB",
        compute_capability=(8, 0),          # Ampere GA100
        sm_count=108,                       # A100: 108 SMs (NVIDIA A100 Tensor Core GPU Architecture)
        fp32_lanes_per_sm=64,               # A100 architecture whitepaper: 64 FP32 cores per SM
        shared_memory_per_sm=164 * KIB,     # Ampere tuning guide: 164 KB shared memory per SM
        shared_memory_per_block_optin=163 * KIB,   # Ampere tuning guide: up to 163 KB per thread block
        registers_per_sm=65536,
        threads_per_sm=2048,                # CUDA Programming Guide, cc 8.0: 2,048 resident threads per SM
        clock_ghz=1.41,                     # A100 SXM: boost clock 1,410 MHz
        memory_bandwidth=2.039e12,          # A100 80GB SXM datasheet: 2,039 GB/s
        memory_bytes=80 * 10**9,            # A100 80GB SXM datasheet: 80 GB HBM2e
        l2_bytes=40 * 1024 * KIB,           # A100 architecture whitepaper: 40 MB L2 cache
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM) and architecture whitepaper; Ampere tuning guide",
    ),
}


def gpu_target(hardware: str) -> GpuTarget:
    """The named target, or a ValueError that lists them."""
    try:
        return GPU_TARGETS[hardware]
    except KeyError:
        raise ValueError(f"unknown GPU target {hardware!r}: use one of {', '.join(GPU_TARGETS)} (the GPUs whose "
                         "XLA target description moe_jax/distributed/gpu_targets.py holds).") from None
