"""Which layout to use: the planner behind `moe-jax plan --auto`.

    from moe_jax.planning import search_layouts
    estimates = search_layouts("path/to/config.json", devices=8, batch_size=16, seq_len=4096, hardware="h100",
                               device_memory="80GiB")
    best = estimates[0]           # best.layout.distributed_config(), best.memory.total, best.step_seconds, best.why

Every legal layout of the devices (`layouts`) is planned from the compiler: its step compiled ahead of time on
abstract shapes over virtual CPU devices (`compiled_step`), its memory from XLA's buffer assignment and the
layout's shardings (`state_bytes`, `peak_memory`), its time from the compiled program's FLOPs, bytes and
collectives (`hlo_costs`) on a hardware profile (`hardware`, `cpu_calibration`) with an alpha-beta model of
the links (`step_time`). `search` ranks them and `explain` says why.
"""

from .estimate import LayoutEstimate, MemoryBreakdown
from .hardware import HARDWARE_CHOICES, HardwareProfile, load_hardware
from .layouts import Layout, PipelineChoice
from .memory_size import parse_memory_size
from .search import LayoutPlan, plan_layouts, search_layouts

__all__ = ["HARDWARE_CHOICES", "HardwareProfile", "Layout", "LayoutEstimate", "LayoutPlan", "MemoryBreakdown",
           "PipelineChoice", "load_hardware", "parse_memory_size", "plan_layouts", "search_layouts"]
