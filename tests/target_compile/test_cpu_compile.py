"""`moe-jax compile --hardware cpu` and `compile_for_target` on this machine's devices: the report, the saved
executable loaded back and run, and the bad requests (one `error:` line, exit 2, nothing written). The same code
compiles for GPU targets (tests/target_compile/test_gpu_target.py, where the CUDA plugin is installed)."""

import json

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli import main
from moe_jax.cli.demo import DEMO_CONFIG
from moe_jax.distributed.host_arrays import host_to_global
from moe_jax.planning.request import PlanRequest
from moe_jax.target_compile import compile_for_target, load_executable
from moe_jax.training.optimizers import build_optimizer
from moe_jax.training.step import make_train_step

JSON_KEYS = {"hardware", "devices", "compiler", "memory_bytes", "fits", "compile_seconds", "collectives",
             "experts_kernel", "host_transfers"}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(DEMO_CONFIG))
    return path


def test_the_report_reads_memory_collectives_and_the_expert_kernel():
    report = compile_for_target(dict(DEMO_CONFIG), hardware="cpu", devices=8,
                                distributed_config=DistributedConfig(fsdp_size=8, ep_size=8,
                                                                     ep_implementation="all_to_all"),
                                request=PlanRequest(batch_size=8, seq_len=16))
    (program,) = report.programs
    reading = program.reading
    assert program.name == "train_step" and report.fits and report.compiler.startswith("XLA:CPU")
    assert program.memory.total == (program.memory.argument + program.memory.output - program.memory.alias
                                    + program.memory.temp) > 0
    kinds = {collective.kind: collective for collective in reading.collectives}
    assert kinds["all-to-all"].group_size == 8 and kinds["all-to-all"].count > 0 and kinds["all-to-all"].bytes > 0
    assert reading.experts_backends == ["tiled"] and reading.experts_kernel.startswith("tiled loop")
    assert 0 < reading.experts_flops < reading.flops
    assert reading.host_transfers == []
    assert JSON_KEYS <= set(report.as_json())


# heavy: a second compile to disk and back; the report's reading stays in the suite
@pytest.mark.heavy
def test_a_saved_executable_loads_back_and_runs_the_step(config_file, tmp_path, capsys):
    out = tmp_path / "exe"
    assert main(["compile", "--model", str(config_file), "--hardware", "cpu", "--devices", "8", "--tp", "2",
                 "--ep", "4", "--train", "--batch-size", "8", "--seq-len", "16", "--save-executable", str(out),
                 "--json", str(tmp_path / "report.json")]) == 0
    printed = capsys.readouterr()
    assert "train_step: compiled in" in printed.out and "load_executable" in printed.err
    saved = json.loads((tmp_path / "report.json").read_text())
    assert JSON_KEYS <= set(saved) and saved["devices"] == 8 and saved["layout"].startswith("tp2 ep4 fsdp4")
    program = load_executable(out / "train_step.xla_executable")

    model = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4),
                                             devices=jax.devices()[:8])
    model.params = model.init_params(seed=0)
    step = make_train_step(model, build_optimizer("adamw", learning_rate=1e-3), grad_clip=1.0)
    ids = np.random.default_rng(0).integers(0, DEMO_CONFIG["vocab_size"], (8, 16)).astype(np.int32)
    capacity = model.capacity_schedule.start().capacity
    _, loaded = program(step.init_state(params=model.params, capacity=capacity),
                        {"input_ids": host_to_global(ids, model.batch_sharding())})
    _, direct = step(step.init_state(params=model.params, capacity=capacity), {"input_ids": ids})
    assert float(loaded["loss"]) == float(direct["loss"]) and float(loaded["grad_norm"]) == float(direct["grad_norm"])


def _failed(capsys) -> str:
    lines = capsys.readouterr().err.splitlines()
    assert lines and lines[-1].startswith("error: "), lines
    return lines[-1]


def test_an_unknown_hardware_is_one_error(config_file, capsys):
    assert main(["compile", "--model", str(config_file), "--hardware", "h800", "--devices", "8", "--train"]) == 2
    assert _failed(capsys) == "error: unknown --hardware 'h800': use one of h100, h200, b200, a100, cpu."


def test_a_layout_that_does_not_fill_the_devices_is_one_error(config_file, capsys):
    assert main(["compile", "--model", str(config_file), "--hardware", "cpu", "--devices", "8", "--tp", "2",
                 "--fsdp", "2", "--train"]) == 2
    assert "does not fill --devices 8" in _failed(capsys)


def test_a_program_that_does_not_fit_writes_nothing(config_file, tmp_path, capsys):
    report, out = tmp_path / "report.json", tmp_path / "exe"
    assert main(["compile", "--model", str(config_file), "--hardware", "cpu", "--devices", "8", "--ep", "8",
                 "--train", "--batch-size", "8", "--seq-len", "16", "--device-memory", "1MiB",
                 "--json", str(report), "--save-executable", str(out)]) == 2
    message = _failed(capsys)
    assert "train_step needs" in message and "nothing written" in message
    assert not report.exists() and not out.exists()


def test_offload_outside_training_is_one_error(config_file, capsys):
    assert main(["compile", "--model", str(config_file), "--hardware", "cpu", "--devices", "8", "--ep", "8",
                 "--serve", "--offload-optimizer"]) == 2
    assert _failed(capsys) == ("error: --offload-optimizer / --offload-parameters place a train state: add "
                               "--train.")


def test_offload_on_cpu_compiles_the_offloaded_step_and_says_what_xla_cpu_cannot_tell_apart(config_file, capsys):
    assert main(["compile", "--model", str(config_file), "--hardware", "cpu", "--devices", "8", "--ep", "8",
                 "--train", "--batch-size", "8", "--seq-len", "16", "--offload-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "adamw, optimizer state in host memory" in out
    assert "note: XLA:CPU counts pinned host memory with the device's" in out
