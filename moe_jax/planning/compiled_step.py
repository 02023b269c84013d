"""One layout's real step compiled ahead of time on abstract shapes, and what the compiler says about it.

    step = compile_layout_step(config_values, layout, request, devices=jax.devices("cpu")[:8])
    step.memory.total, step.peak.forward, step.costs.flops, step.scanned_runs

Training compiles `make_train_step(model, optimizer).lower(state, batch)` with the state and batch as
`jax.ShapeDtypeStruct`s (`abstract_train_state`): nothing is allocated, so a 671B model compiles on a laptop.
Serving compiles the generator's decode step: `max_slots` new tokens against a KV cache of `max_model_len`
tokens per slot. Layers run as the train command runs them (`scan_layers="auto"`: identical layers from 16 on
as one scan), so a deep model is one compiled layer per kind whose loop XLA and `hlo_costs` multiply by its
trip count; memory is XLA's buffer assignment of the whole program.

The backend's code generation is not what the plan reads (the program never runs), so it is compiled at
`xla_backend_optimization_level=0` without the fusion emitters: the HLO passes (SPMD partitioning, fusion,
buffer assignment) are the same and the compile several times faster. XLA writes the optimized HLO and its
live ranges to a temporary directory, which `hlo_costs` and `peak_memory` read.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from ..causal_lm.auto import AutoModelForCausalLM
from ..kv_cache import KVCache, bucket_length, cache_shardings, ring_length
from ..training.optimizers import build_optimizer
from ..training.state import abstract_parameters, abstract_train_state
from ..training.step import make_train_step
from .hlo_costs import ProgramCosts, program_costs
from .hlo_program import HloModule, array_shapes, parse_hlo_module
from .layouts import Layout, quiet_model_building
from .peak_memory import PeakHolders, peak_holders
from .request import PlanRequest

PLANNING_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


# XLA:GPU compiling without a device (jaxlib 0.10.2) can fail to tile a small Triton GEMM (DeepSeek-V3's fixture:
# the [80, 16] gradient of MLA's kv_b_proj), where a GPU's autotuner would try other tiles. Such a program is
# compiled again with cuBLAS GEMMs, and says so.
TRITON_TILING_ERROR = "Couldn't find output tile sizes"
CUBLAS_GEMMS = {"xla_gpu_enable_triton_gemm": False}
CUBLAS_NOTE = ("XLA:GPU could not tile a Triton GEMM without a device (\"Couldn't find output tile sizes\"): compiled "
               "with cuBLAS GEMMs instead (xla_gpu_enable_triton_gemm=false); memory and collectives are unchanged "
               "in kind, the GEMM kernels differ from an autotuned GPU compile")


def compile_lowered(lowered, options: dict | None = None) -> tuple[object, str | None]:
    """(the compiled program, a note when it needed cuBLAS GEMMs instead of Triton's: see TRITON_TILING_ERROR)."""
    try:
        return lowered.compile(compiler_options=options or None), None
    except jax.errors.JaxRuntimeError as error:
        if TRITON_TILING_ERROR not in str(error):
            raise
    return lowered.compile(compiler_options={**(options or {}), **CUBLAS_GEMMS}), CUBLAS_NOTE


def planning_compiler_options(platform: str) -> dict:
    """XLA:CPU's planning options on CPU devices; none for a GPU target (`compiler="target"`: its own defaults)."""
    return PLANNING_COMPILER_OPTIONS if platform == "cpu" else {}


@dataclass(frozen=True)
class CompiledMemory:
    """XLA's `memory_analysis()` of one device's program; `total` = arguments + outputs - aliased + temporaries
    (what the device holds at the step's peak). host_*: the same in pinned host memory (offloaded state), which
    XLA:GPU counts apart; XLA:CPU counts it with the rest (host_* 0), both being this machine's memory."""

    argument: int
    output: int
    alias: int
    temp: int
    host_argument: int = 0
    host_output: int = 0
    host_alias: int = 0
    host_temp: int = 0

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @property
    def host_total(self) -> int:
        return self.host_argument + self.host_output - self.host_alias + self.host_temp

    @classmethod
    def of(cls, compiled) -> CompiledMemory:
        analysis = compiled.memory_analysis()
        return cls(analysis.argument_size_in_bytes, analysis.output_size_in_bytes, analysis.alias_size_in_bytes,
                   analysis.temp_size_in_bytes, analysis.host_argument_size_in_bytes,
                   analysis.host_output_size_in_bytes, analysis.host_alias_size_in_bytes,
                   analysis.host_temp_size_in_bytes)


@dataclass(frozen=True)
class CompiledStep:
    memory: CompiledMemory
    peak: PeakHolders
    costs: ProgramCosts
    batch_bytes: int           # the step's non-state inputs per device (batch, or tokens and KV cache)
    cache_bytes: int           # serving: the KV cache per device (0 in training)
    scanned_runs: int          # layer runs compiled as one scanned layer each
    layers: int
    compile_seconds: float
    capacity: float | None     # the dispatch capacity compiled (None without dispatch buffers)


def build_model(config_values: dict, layout: Layout, request: PlanRequest, devices):
    with quiet_model_building():
        return AutoModelForCausalLM.from_config(config_values, layout.distributed_config(),
                                                devices=list(devices)[:layout.devices], scan_layers="auto",
                                                **request.model_options(), **layout.model_options())


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s."""
    return sum(jnp.dtype(leaf.dtype).itemsize * math.prod(leaf.sharding.shard_shape(tuple(leaf.shape)))
               for leaf in jax.tree.leaves(tree))


def _train_program(model, layout: Layout, request: PlanRequest):
    """(lowered train step, its batch's per-device bytes, 0 cache bytes, capacity)."""
    from ..target_compile.host_placement import lower_train_step

    step = make_train_step(model, build_optimizer(request.optimizer, learning_rate=1e-3), grad_clip=1.0,
                           grad_accum=request.grad_accum, mixed_precision=request.mixed_precision,
                           offload=request.offload)
    capacity = None if layout.ep == 1 else model.capacity_schedule.start().capacity
    state = abstract_train_state(model, step.optimizer, capacity, memory_kind=step.memory_kind)
    batch = {"input_ids": jax.ShapeDtypeStruct((request.batch_size, request.seq_len), jnp.int32,
                                               sharding=model.batch_sharding())}
    return lower_train_step(step, state, batch), _per_device_bytes(batch), 0, capacity


def _serve_program(model, layout: Layout, request: PlanRequest):
    """(lowered decode step of `max_slots` rows against a full KV cache, its inputs' bytes, cache bytes, capacity)."""
    rows, length = request.max_slots, bucket_length(request.max_model_len)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    length = min(length, max_positions) if max_positions else length
    cache = abstract_cache(model, rows, length)
    params = abstract_parameters(model)
    ids = jax.ShapeDtypeStruct((rows, 1), jnp.int32, sharding=model.batch_sharding())
    capacity = None if layout.ep == 1 else model.capacity_schedule.largest   # serving never drops a pair

    def decode(params, ids, cache):
        output = model.step_math(params, ids, cache=cache, capacity=capacity, inference=True)
        return output.logits[:, -1].argmax(-1), output.cache

    lowered = jax.jit(decode, donate_argnums=(2,)).lower(params, ids, cache)
    cache_bytes = _per_device_bytes(cache)
    return lowered, _per_device_bytes(ids) + cache_bytes, cache_bytes, capacity


def abstract_cache(model, rows: int, length: int) -> KVCache:
    """The KV cache `init_cache(model, rows, length)` makes, as shapes in its shardings (nothing allocated)."""
    shapes = jax.eval_shape(lambda: unplaced_cache(model, rows, length))
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        shapes, cache_shardings(model, rows, length))


def unplaced_cache(model, rows: int, length: int) -> KVCache:
    """The cache `init_cache` makes, unplaced (for its shapes under `jax.eval_shape`)."""
    entries = model.layer_stack.cache_entries()
    slots = {key: ring_length(model, layer, length) or length for key, layer, _ in entries}
    key_heads, value_heads = model.cache_heads()
    zeros = lambda key, count, heads: jnp.zeros((count, rows, slots[key], *heads), model.dtype)  # noqa: E731
    return KVCache(keys={key: zeros(key, count, key_heads) for key, _, count in entries},
                   values={key: zeros(key, count, value_heads) for key, _, count in entries},
                   key_mask=jnp.zeros((rows, length), jnp.int32), length=jnp.zeros((), jnp.int32),
                   window_masks={key: jnp.zeros((rows, slots[key]), jnp.int32) for key, layer, _ in entries
                                 if ring_length(model, layer, length) is not None})


# mode -> the program a layout is planned by
PROGRAMS = {"train": _train_program, "serve": _serve_program}


def widening_converts(module: HloModule) -> frozenset[str]:
    """Names of XLA:CPU's float32 copies of bfloat16 values (converts the backend added: no JAX op name)."""
    names = set()
    for computation in module.computations.values():
        for instruction in computation.instructions:
            if instruction.opcode != "convert" or "op_name" in instruction.attributes or not instruction.operands:
                continue
            source = computation.by_name.get(instruction.operands[0])
            if source is not None and array_shapes(source.shape)[:1] and array_shapes(source.shape)[0].dtype in (
                    "bf16", "f16") and array_shapes(instruction.shape)[0].dtype == "f32":
                names.add(instruction.name)
    return frozenset(names)


def _read_dump(directory: Path, suffix: str) -> str:
    found = sorted(directory.glob(f"*{suffix}"))
    if not found:
        cache = jax.config.jax_compilation_cache_dir
        raise RuntimeError(f"XLA wrote no {suffix} for the planned step"
                           + (f" (the program may have come from the compilation cache {cache})" if cache else ""))
    return found[-1].read_text(encoding="utf-8")


def compile_layout_step(config_values: dict, layout: Layout, request: PlanRequest, devices, *,
                        for_cpu: bool = True) -> CompiledStep:
    """Compile `request`'s step on `layout` over the first `layout.devices` of `devices` (CPU devices, or abstract
    GPUs of a target: `moe_jax.distributed.target_devices`).
    for_cpu: the plan is for CPU devices; else XLA:CPU's own costs are left out of `costs`
    (`hlo_costs.program_costs`' cpu_artifacts)."""
    start = time.perf_counter()
    model = build_model(config_values, layout, request, devices)
    lowered, batch_bytes, cache_bytes, capacity = PROGRAMS[request.mode](model, layout, request)
    caching = jax.config.jax_enable_compilation_cache
    with tempfile.TemporaryDirectory(prefix="moe_jax_plan_") as directory:
        jax.config.update("jax_enable_compilation_cache", False)   # a cached program writes no dump to read
        try:
            options = planning_compiler_options(model.mesh.devices.flat[0].platform)
            compiled, _ = compile_lowered(lowered, {**options, "xla_dump_to": directory,
                                                    "xla_dump_hlo_as_text": True})
        finally:
            jax.config.update("jax_enable_compilation_cache", caching)
        module = parse_hlo_module(_read_dump(Path(directory), "after_optimizations.txt"))
        live_ranges = _read_dump(Path(directory), "after_optimizations-live-range.txt")
    memory = CompiledMemory.of(compiled)
    peak = peak_holders(live_ranges, widening_converts(module)) or PeakHolders(0, 0, memory.temp)
    capacity_fill = 1.0 if capacity is None else 1.0 / capacity
    costs = program_costs(module, device_count=layout.devices, pipeline_iterations=layout.pipeline_iterations,
                          tile_fill=capacity_fill, cpu_artifacts=for_cpu)
    stack = model.layer_stack
    scanned = sum(1 for run in stack.runs if run.scanned) if stack.pipeline is None else len(stack.pipeline.groups)
    return CompiledStep(memory, peak, costs, batch_bytes, cache_bytes, scanned, model.config.num_hidden_layers,
                        time.perf_counter() - start, capacity)
