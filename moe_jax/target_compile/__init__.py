"""Compile a model's programs for the cluster it will run on, from any machine: XLA:GPU for abstract H100 /
H200 / B200 / A100 devices (`moe_jax.distributed.target_devices`), or XLA:CPU for this machine's devices::

    report = compile_for_target("path/to/checkpoint_or_config.json", hardware="h100", devices=8,
                                distributed_config=DistributedConfig(fsdp_size=8, ep_size=8),
                                request=PlanRequest(mode="train", batch_size=16, seq_len=4096, mixed_precision=True))
    report.fits, report.largest.memory.total, report.largest.reading.collectives, report.as_json()

Each program is the library's own (`programs`): the train step, the server's continuous-batching step and
decode, or generate's prefill and decode. The report
reads XLA's memory analysis and the optimized HLO (`hlo_report`). Nothing runs and nothing is allocated: the
figures are the compiler's, "compiled, not run". `save_executable=DIR` writes each compiled program with
`jax.experimental.serialize_executable` for the machine it targets (`load_executable`).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from ..checkpoint_files import read_config
from ..distributed.config import DistributedConfig
from ..distributed.gpu_targets import GPU_TARGETS
from ..distributed.targets import target_devices
from ..planning.hardware import load_hardware
from ..planning.compiled_step import CompiledMemory, compile_lowered
from ..planning.layouts import quiet_model_building
from ..planning.memory_size import parse_memory_size
from ..planning.request import PlanRequest
from .hlo_report import read_program
from .programs import PROGRAMS
from .report import CompileReport, ProgramReport

DEFAULT_MARGIN = 0.1


class CompileFailed(RuntimeError):
    """XLA refused a program: the compiler's own error, with the program and the target named."""


HARDWARE_CHOICES = (*GPU_TARGETS, "cpu")
_OFFLOAD_NOTES = {
    "gpu": "abstract GPUs have no memory spaces for JAX to name, so the offloaded state's pinned host placement was "
           "written into the lowered step as JAX writes it on a GPU (target_compile.host_placement); XLA:GPU "
           "scheduled its transfers and counts host memory apart",
    "cpu": "XLA:CPU counts pinned host memory with the device's (both are this machine's memory): the total "
           "includes the offloaded state; compile for a GPU to see the device bytes offload saves",
}
EXECUTABLE_SUFFIX = ".xla_executable"


def compile_devices(hardware: str, count: int) -> list:
    """`count` devices to compile for: abstract GPUs of `hardware`, or this machine's CPU devices for "cpu"."""
    if hardware == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < count:
            raise ValueError(f"--devices {count} on cpu: JAX has {len(devices)} CPU devices; set XLA_FLAGS="
                             f"--xla_force_host_platform_device_count={count} before JAX starts (moe-jax compile "
                             "does it for you).")
        return devices[:count]
    if hardware not in GPU_TARGETS:
        raise ValueError(f"unknown --hardware {hardware!r}: use one of {', '.join(HARDWARE_CHOICES)}.")
    return target_devices(hardware, count)


def compiler_name(hardware: str) -> str:
    import jaxlib

    if hardware == "cpu":
        return f"XLA:CPU (jaxlib {jaxlib.__version__})"
    target = GPU_TARGETS[hardware]
    major, minor = target.compute_capability
    return (f"XLA:GPU (jaxlib {jaxlib.__version__}, JAX CUDA plugin) for {target.device_kind}, compute capability "
            f"{major}.{minor}")


def _device_memory(hardware: str, devices: int, device_memory) -> int:
    if device_memory is not None:
        return parse_memory_size(device_memory)
    if hardware == "cpu":
        from ..planning.cpu_calibration import host_memory_bytes

        return host_memory_bytes() // devices
    return int(load_hardware(hardware).memory_bytes)


def build_target_model(config, distributed_config: DistributedConfig, devices: Sequence, request: PlanRequest,
                       **model_options):
    """The model of `config` (a checkpoint directory, config.json or dict: only the config is read) on
    `devices`, as the train command builds it (scanned layers from 16 on; `scan_layers=False` as generate and
    serve run), its parameters abstract."""
    from ..causal_lm.auto import AutoModelForCausalLM

    values = read_config(config) if not isinstance(config, dict) else config
    with quiet_model_building():
        model = AutoModelForCausalLM.from_config(values, distributed_config, devices=list(devices),
                                                 **{"scan_layers": "auto", **request.model_options(), **model_options})
    model.params = model.abstract_params()
    return model


def _tile_fill(model, program: str) -> float:
    """The share of the tile loops' schedules expected live: 1 / the capacity the program's dispatch buffers are
    sized for (a run's starting rung in training, the largest when serving); 1 without them."""
    if model.layout.ep_size == 1:
        return 1.0
    schedule = model.capacity_schedule
    return 1.0 / (schedule.start().capacity if program == "train_step" else schedule.largest)


def describe(request: PlanRequest, programs: str) -> str:
    if programs == "train":
        return request.describe()
    what = ("the server's continuous batching" if programs == "serve" else "generate's prefill and decode")
    return f"{programs}: {what}, {request.max_slots} rows of up to {request.max_model_len} tokens"


def compile_model(model, request: PlanRequest, *, hardware: str, device_memory: int | str | None = None,
                  margin: float = DEFAULT_MARGIN, save_executable: str | Path | None = None,
                  progress: Callable[[str], None] | None = None, trainable=None,
                  programs: str | None = None) -> CompileReport:
    """Compile `model`'s programs (placed on `compile_devices(hardware, ...)`) and read them. programs: "train"
    (the train step), "serve" (the continuous-batching step and decode `moe-jax serve` runs) or "generate"
    (`generate`'s prefill and decode); default: `request.mode`."""
    programs = programs or request.mode
    if programs not in PROGRAMS:
        raise ValueError(f"programs={programs!r}: compile one of {', '.join(PROGRAMS)}.")
    if not 0 <= margin < 1:
        raise ValueError(f"memory margin {margin} must be in [0, 1): the share of device memory kept free.")
    devices = model.mesh.devices.size
    memory = _device_memory(hardware, devices, device_memory)
    reports, executables, compiler_notes = [], {}, []
    for name, build in PROGRAMS[programs].items():
        if progress is not None:
            progress(f"compiling {name} for {devices} x {hardware}")
        start = time.perf_counter()
        lowered = build(model, request, trainable=trainable) if name == "train_step" else build(model, request)
        try:
            compiled, note = compile_lowered(lowered)
        except jax.errors.JaxRuntimeError as error:
            raise CompileFailed(f"{compiler_name(hardware)} could not compile {name} on {devices} devices: "
                                f"{str(error).splitlines()[0]}") from error
        seconds = time.perf_counter() - start
        if note is not None:
            compiler_notes.append(f"{name}: {note}")
        reports.append(ProgramReport(name, CompiledMemory.of(compiled), seconds,
                                     read_program(compiled.as_text(), device_count=devices,
                                                  tile_fill=_tile_fill(model, name))))
        executables[name] = compiled
    config = model.distributed_config
    layout = (f"tp{config.tp_size} ep{config.ep_size} fsdp{config.fsdp_size}"
              + (f" dp_replicate{config.dp_replicate_size}" if config.dp_replicate_size > 1 else "")
              + (f" pp{config.pp_size}" if config.pp_size > 1 else "")
              + (f" {config.ep_implementation}" if config.ep_size > 1 else ""))
    notes = list(compiler_notes)
    if hardware != "cpu":
        notes.append("attention and fp16 dots are traced as on the host's default backend (CPU): on a GPU, jax "
                     "may pick cuDNN's fused attention instead; the expert matmuls follow the target")
        notes.append("XLA:GPU without a device sorts with its fallback algorithm (no CUB scratch sizes) and "
                     "autotunes no GEMM: the experts' sort and GEMM tilings may differ from a compile on the GPU")
    if request.offload is not None:
        notes.append(_OFFLOAD_NOTES["cpu" if hardware == "cpu" else "gpu"])
    report = CompileReport(hardware, devices, compiler_name(hardware), layout, describe(request, programs), memory,
                           int(memory * (1 - margin)), reports, notes, executables)
    if save_executable is not None:
        save_executables(executables, Path(save_executable), report)
    return report


def compile_for_target(config, *, hardware: str = "h100", devices: int = 8,
                       distributed_config: DistributedConfig | None = None, request: PlanRequest | None = None,
                       device_memory: int | str | None = None, margin: float = DEFAULT_MARGIN,
                       save_executable: str | Path | None = None, progress: Callable[[str], None] | None = None,
                       programs: str | None = None, **model_options) -> CompileReport:
    """Build `config`'s model on `devices` devices of `hardware` (h100, h200, b200, a100: abstract GPUs; cpu:
    this machine's) with `distributed_config` (default: fsdp over all of them) and compile `request`'s
    programs (default: a train step of 8 x 2048 tokens; `programs`: as `compile_model`). model_options: the
    model's keyword arguments (pipeline_microbatches, num_redundant_experts, experts_backend, scan_layers, ...)."""
    request = request or PlanRequest()
    distributed_config = distributed_config or DistributedConfig(fsdp_size=devices)
    placed = compile_devices(hardware, devices)
    model = build_target_model(config, distributed_config, placed, request, **model_options)
    return compile_model(model, request, hardware=hardware, device_memory=device_memory, margin=margin,
                         save_executable=save_executable, progress=progress, programs=programs)


def save_executables(executables: dict, directory: Path, report: CompileReport) -> list[Path]:
    """Each compiled program as `NAME.xla_executable` (`serialize_executable`'s bytes and its argument and
    result trees, pickled) beside `compile_report.json`; written to a temporary name, then renamed."""
    import json

    from jax.experimental.serialize_executable import serialize

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, compiled in executables.items():
        payload, in_tree, out_tree = serialize(compiled)
        path = directory / f"{name}{EXECUTABLE_SUFFIX}"
        partial = path.with_suffix(path.suffix + ".partial")
        partial.write_bytes(pickle.dumps({"payload": payload, "in_tree": in_tree, "out_tree": out_tree,
                                          "hardware": report.hardware, "devices": report.devices,
                                          "compiler": report.compiler}))
        partial.replace(path)
        written.append(path)
    (directory / "compile_report.json").write_text(json.dumps(report.as_json(), indent=1) + "\n", encoding="utf-8")
    return written


def load_executable(path: str | Path, devices: Sequence | None = None):
    """A program `save_executables` wrote, loaded onto `devices` (default: JAX's first ones) of the machine it
    was compiled for: call it with the program's arguments (for a train step: the state and batch)."""
    from jax.experimental.serialize_executable import deserialize_and_load

    saved = pickle.loads(Path(path).read_bytes())
    devices = list(devices) if devices is not None else jax.devices()[:saved["devices"]]
    return deserialize_and_load(saved["payload"], saved["in_tree"], saved["out_tree"], execution_devices=devices)


__all__ = ["CompileFailed", "CompileReport", "build_target_model", "compile_devices", "compile_for_target", "compile_model",
           "load_executable", "save_executables"]
