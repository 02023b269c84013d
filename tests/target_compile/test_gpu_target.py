"""Programs compiled by XLA:GPU for abstract H100s, on a machine without a GPU (needs JAX's CUDA plugin:
`pip install -e ".[gpu-compile]"`; skipped without it). One family, two layouts, the train step and serving;
scripts/checks/check_gpu_compile.py runs every family on every layout."""

import importlib
import json
from pathlib import Path

import jax
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli.demo import DEMO_CONFIG
from moe_jax.distributed import targets
from moe_jax.distributed.targets import target_devices
from moe_jax.planning.request import PlanRequest
from moe_jax.target_compile import compile_for_target

pytestmark = pytest.mark.skipif(not targets.cuda_plugin_available(),
                                reason="JAX's CUDA plugin is not installed (pip install -e \".[gpu-compile]\")")

grouped_matmul = importlib.import_module("moe_jax.ops.grouped_matmul")   # the module (the package exports the function)
FSDP8_EP8 = DistributedConfig(fsdp_size=8, ep_size=8, ep_implementation="all_to_all")
TP2_FSDP4_EP4 = DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4)


def test_the_experts_backend_follows_the_devices_not_the_host(monkeypatch):
    monkeypatch.setitem(grouped_matmul._DEFAULT_BACKEND_BY_PLATFORM, "gpu", lambda: "ragged_dot")
    on_gpu = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), FSDP8_EP8, devices=target_devices("h100", 8))
    on_cpu = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), FSDP8_EP8, devices=jax.devices("cpu")[:8])
    assert jax.default_backend() == "cpu"
    assert (on_gpu.platform, on_gpu.experts_backend_name) == ("gpu", "ragged_dot")
    assert (on_cpu.platform, on_cpu.experts_backend_name) == ("cpu", "tiled")


def test_from_pretrained_on_target_devices_reads_only_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEMO_CONFIG))   # no weights: none are read
    model = AutoModelForCausalLM.from_pretrained(tmp_path, FSDP8_EP8, devices=target_devices("h100", 8))
    assert model.params is None and model.mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
    abstract = model.abstract_params()
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in abstract.values())


def test_the_mixed_precision_train_step_compiles_for_h100_with_grouped_experts():
    report = compile_for_target(dict(DEMO_CONFIG), hardware="h100", devices=8, distributed_config=FSDP8_EP8,
                                request=PlanRequest(batch_size=16, seq_len=64, mixed_precision=True))
    (program,) = report.programs
    reading = program.reading
    assert report.compiler.startswith("XLA:GPU") and "compute capability 9.0" in report.compiler and report.fits
    assert reading.experts_backends == ["tiled"] and reading.experts_kernel.startswith("tiled loop")
    # bf16 compute on a GPU: the whole causal sequence in cuDNN's fused kernel, forward and backward, traced for
    # the target's devices though the host is a CPU (`ops.platform`).
    assert any(kernel.startswith("cuDNN flash attention") and "Backward" in kernel for kernel in reading.attention_kernels)
    assert "outside any loop" not in reading.experts_kernel      # never a dense all-experts dot
    assert reading.host_transfers == []
    all_to_all = [c for c in reading.collectives if c.kind == "all-to-all"]
    assert all_to_all and all_to_all[0].group_size == 8
    assert any(overlap.kind == "all-to-all" and overlap.overlapped > 0 for overlap in reading.overlap)


def test_the_servers_continuous_batching_compiles_for_h100_on_tp_with_ep():
    """The paged step XLA:GPU once failed to emit (a mask reduction fused out of concatenated inputs)."""
    report = compile_for_target(dict(DEMO_CONFIG), hardware="h100", devices=8, distributed_config=TP2_FSDP4_EP4,
                                request=PlanRequest(mode="serve", max_slots=16, max_model_len=256), scan_layers=False)
    assert [program.name for program in report.programs] == ["batching_step", "batching_decode"]
    for program in report.programs:
        assert program.reading.experts_backends == ["tiled"] and program.reading.host_transfers == []


def test_prefill_and_decode_compile_for_h100_on_tp_with_ep():
    report = compile_for_target(dict(DEMO_CONFIG), hardware="h100", devices=8, distributed_config=TP2_FSDP4_EP4,
                                request=PlanRequest(mode="serve", max_slots=8, max_model_len=128), scan_layers=False,
                                programs="generate")
    assert [program.name for program in report.programs] == ["prefill", "decode"]
    for program in report.programs:
        assert program.reading.experts_backends == ["tiled"] and program.reading.host_transfers == []
        assert "outside any loop" not in program.reading.experts_kernel


def test_a_gemm_xla_gpu_cannot_tile_without_a_device_compiles_with_cublas_and_says_so():
    """DeepSeek-V3's fixture: the [80, 16] gradient of MLA's kv_b_proj, which XLA:GPU's Triton GEMM cannot tile
    without a device, compiles with cuBLAS GEMMs, and the report's notes name the change."""
    values = json.loads((Path(__file__).parents[1] / "fixtures" / "models" / "deepseek_v3" / "config.json").read_text())
    report = compile_for_target(values, hardware="h100", devices=8, distributed_config=FSDP8_EP8,
                                request=PlanRequest(batch_size=8, seq_len=32, mixed_precision=True))
    assert report.fits and any("compiled with cuBLAS GEMMs instead" in note for note in report.notes)
    assert report.programs[0].reading.experts_kernel.startswith("tiled loop")


def test_the_report_catches_ragged_dots_dense_fallback():
    """XLA:GPU lowers ragged_dot to dense dots over every local expert: the reading says so."""
    report = compile_for_target(dict(DEMO_CONFIG), hardware="h100", devices=8, distributed_config=FSDP8_EP8,
                                request=PlanRequest(mode="serve", max_slots=8, max_model_len=64),
                                experts_backend="ragged_dot", scan_layers=False, programs="generate")
    decode = report.programs[1].reading
    assert decode.experts_backends == ["ragged_dot"]
    assert "dense over every local expert" in decode.experts_kernel


VARIANTS = {   # the train step's other settings, each compiled for 8 x H100 (--heavy: a run of the full set)
    "lora": (FSDP8_EP8, PlanRequest(batch_size=16, seq_len=64, mixed_precision=True), {}, "lora"),
    "frozen_experts": (FSDP8_EP8, PlanRequest(batch_size=16, seq_len=64, mixed_precision=True), {},
                       "model.layers.*.mlp.*"),
    "redundant_experts": (FSDP8_EP8, PlanRequest(batch_size=16, seq_len=64), {"num_redundant_experts": 8}, None),
    "circular_pipeline": (DistributedConfig(pp_size=2, fsdp_size=4, ep_size=4),
                          PlanRequest(batch_size=16, seq_len=64, mixed_precision=True),
                          {"pipeline_microbatches": 4, "pipeline_schedule": "circular", "pipeline_repeats": 2}, None),
    "bf16_remat_accumulation": (TP2_FSDP4_EP4, PlanRequest(batch_size=16, seq_len=64, dtype="bfloat16",
                                                           remat="full", grad_accum=2), {}, None),
}


@pytest.mark.heavy
def test_kept_mxfp4_experts_compile_for_h100():
    from moe_jax.target_compile import build_target_model, compile_model

    values = json.loads((Path(__file__).parents[1] / "fixtures" / "models" / "gpt_oss" / "config.json").read_text())
    values.update(hidden_size=64, intermediate_size=64)   # MXFP4 blocks of 32 values
    request = PlanRequest(mode="serve", max_slots=8, max_model_len=128)
    model = build_target_model(values, FSDP8_EP8, target_devices("h100", 8), request, scan_layers=False,
                               kept_quantization="mxfp4")
    report = compile_model(model, request, hardware="h100", programs="generate")
    assert all(program.reading.experts_kernel.startswith("tiled loop") for program in report.programs)


@pytest.mark.heavy
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_train_step_variants_compile_for_h100(variant):
    from moe_jax.lora import LoraConfig
    from moe_jax.target_compile import build_target_model, compile_model

    config, request, options, trainable = VARIANTS[variant]
    model = build_target_model(dict(DEMO_CONFIG), config, target_devices("h100", 8), request, **options)
    if trainable == "lora":
        model.add_adapter(LoraConfig(r=4, target_modules=["q_proj"],
                                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
        trainable = None
    report = compile_model(model, request, hardware="h100", trainable=trainable)
    reading = report.programs[0].reading
    assert report.fits and reading.host_transfers == []
    assert reading.experts_kernel.startswith("tiled loop") and "outside any loop" not in reading.experts_kernel


def test_the_planner_compiles_its_layouts_for_the_target():
    from moe_jax.planning.layouts import Layout
    from moe_jax.planning.search import plan_layouts

    chosen = Layout(1, 8, 8, 1, 1, "all_to_all")
    plan = plan_layouts(dict(DEMO_CONFIG), devices=8, batch_size=16, seq_len=32, hardware="h100",
                        include=lambda layout: layout == chosen)
    assert plan.compiler == "XLA:GPU for abstract h100 devices" and plan.as_json()["compiler"] == plan.compiler
    (estimate,) = plan.estimates
    assert estimate.compiled and estimate.fits and estimate.step_seconds > 0
    assert estimate.collective_bytes["all-to-all (within a node)"] > 0


def test_the_grpo_step_with_routing_replay_compiles_for_h100():
    """RL's train step (the clipped policy objective, the sampler's routing replayed) for 8 x H100 on
    fsdp8/ep8: its batch's routing [B, L, S, K] and per-token inputs sharded as the batch."""
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_jax.rl import ClippedPolicyObjective
    from moe_jax.training import abstract_train_state, make_train_step

    model = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), FSDP8_EP8, devices=target_devices("h100", 8))
    step = make_train_step(model, optax.adam(1e-5), objective=ClippedPolicyObjective(), routing_replay=True,
                           mixed_precision=True)
    state = abstract_train_state(model, step.optimizer, model.capacity_schedule.ladder[-1], trainable=step.trainable)
    rows, length = 16, 64
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=model.batch_sharding())
    floats = jax.ShapeDtypeStruct((rows, length), jnp.float32, sharding=model.batch_sharding())
    routing = jax.ShapeDtypeStruct((rows, len(model.sparse_layers()), length, DEMO_CONFIG["num_experts_per_tok"]),
                                   jnp.int32, sharding=NamedSharding(model.mesh, P(model.batch_sharding().spec[0])))
    batch = {"input_ids": tokens, "attention_mask": tokens, "labels": tokens, "old_logprobs": floats,
             "advantages": floats, "routing": routing}
    compiled = step.lower(state, batch).compile()
    assert "all-to-all" in compiled.as_text()


def test_a_context_parallel_train_step_compiles_for_h100_with_memory_linear_in_the_sequence():
    """cp4 x fsdp2 with ep4, scanned layers: doubling the sequence roughly doubles the step's temporaries (XLA once
    hoisted every attention block pair's mask out of the layer scan: quadratic, 976 GiB for 4 layers at 131k)."""
    config = {**DEMO_CONFIG, "num_hidden_layers": 4}
    layout = DistributedConfig(cp_size=4, fsdp_size=2, ep_size=4)
    temporaries = []
    for seq_len in (4096, 8192):
        report = compile_for_target(config, hardware="h100", devices=8, distributed_config=layout, scan_layers=True,
                                    request=PlanRequest(batch_size=2, seq_len=seq_len, mixed_precision=True))
        temporaries.append(report.largest.memory.temp)
    assert temporaries[1] / temporaries[0] < 2.6, temporaries


def test_offloaded_optimizer_state_is_counted_in_host_memory_on_h100():
    def compiled(choice):
        report = compile_for_target(dict(DEMO_CONFIG), hardware="h100", devices=8, distributed_config=FSDP8_EP8,
                                    request=PlanRequest(batch_size=16, seq_len=64, mixed_precision=True,
                                                        offload=choice))
        return report, report.programs[0].memory

    plain, on_device = compiled(None)
    report, memory = compiled("optimizer")   # "all" and "parameters": scripts/checks/gpu_program_report.py
    assert on_device.host_total == 0 and memory.host_argument > 0
    # what left the device's arguments is in host memory, donated and written back in place
    assert memory.host_argument == on_device.argument - memory.argument
    assert memory.host_argument == memory.host_output == memory.host_alias
    transfers = report.programs[0].reading.host_transfers
    assert any("copy-start to host memory" in transfer for transfer in transfers)
    assert not plain.programs[0].reading.host_transfers
    assert "pinned host memory per device" in report.text() and any("host_placement" in note for note in report.notes)
    assert report.as_json()["host_memory_bytes"]["total"] == memory.host_total


@pytest.mark.parametrize("offload", ["optimizer", "all"])
def test_the_placement_written_for_abstract_gpus_is_what_jax_writes_for_a_gpu(offload):
    """JAX writes the offloaded step's moves for a GPU where it lowers for "cuda" from CPU devices, which have
    pinned host memory; abstract GPUs have none, so `host_placement` writes them into the same step."""
    from tests.target_compile.test_host_placement import host_positions, main_signature

    from moe_jax.target_compile.host_placement import offloaded_leaves
    from moe_jax.target_compile.programs import train_program
    from moe_jax.training.optimizers import build_optimizer
    from moe_jax.training.state import abstract_train_state
    from moe_jax.training.step import make_train_step
    from moe_jax.training.step_options import offload_memory_kinds

    request = PlanRequest(batch_size=4, seq_len=16, offload=offload)
    on_gpus = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), DistributedConfig(fsdp_size=2, ep_size=2),
                                               devices=target_devices("h100", 2))
    on_gpus.params = on_gpus.abstract_params()
    written = train_program(on_gpus, request).as_text()
    on_cpus = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), DistributedConfig(fsdp_size=2, ep_size=2),
                                               devices=jax.devices("cpu")[:2])
    on_cpus.params = on_cpus.abstract_params()
    step = make_train_step(on_cpus, build_optimizer("adamw", learning_rate=1e-3), offload=offload)
    state = abstract_train_state(on_cpus, step.optimizer, on_cpus.capacity_schedule.start().capacity,
                                 trainable=step.trainable, memory_kind=step.memory_kind)
    batch = {"input_ids": jax.ShapeDtypeStruct((4, 16), jax.numpy.int32, sharding=on_cpus.batch_sharding())}
    by_jax = step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()

    leaves = offloaded_leaves(state, offload_memory_kinds(offload))
    (jax_arguments, jax_results), (arguments, results) = main_signature(by_jax), main_signature(written)
    assert host_positions(arguments) == host_positions(jax_arguments) == leaves
    assert host_positions(results) == host_positions(jax_results) == leaves
    moved = lambda text, memory: text.count(f'_xla_buffer_placement = "{memory}"')   # noqa: E731
    assert moved(written, "pinned_host") == moved(by_jax, "pinned_host") == len(leaves)
    assert moved(written, "device") == len(leaves)
    # JAX also moves the optimizer's count (device to device) and marks each result kept on the device
    parts = ("opt_state",) if offload == "optimizer" else ("params", "opt_state")
    in_parts = len(jax.tree.leaves([getattr(state, part) for part in parts]))
    assert moved(by_jax, "device") == (len(jax_results) - len(leaves)) + in_parts


def test_an_adapters_offloaded_optimizer_state_compiles_for_h100_beside_its_frozen_base():
    from moe_jax.lora import LoraConfig
    from moe_jax.planning.compiled_step import CompiledMemory
    from moe_jax.target_compile.programs import train_program

    model = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), DistributedConfig(fsdp_size=2, ep_size=2),
                                             devices=target_devices("h100", 2))
    model.params = model.abstract_params()
    model.add_adapter(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))   # the base: the step's third argument
    memory = CompiledMemory.of(train_program(model, PlanRequest(batch_size=4, seq_len=16,
                                                                offload="optimizer")).compile())
    assert 0 < memory.host_argument == memory.host_output == memory.host_alias
