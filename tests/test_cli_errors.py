"""Bad input on the command line: one `error: ...` line on stderr, exit code 2, nothing written.

The same mistake made through the Python API raises the same message (the CLI prints the exception)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from moe_jax import DistributedConfig
from moe_jax.cli import main
from moe_jax.reporting.picture import layout_picture
from tests.models.hf_reference import TINY_QWEN3_MOE


def error_line(capsys) -> str:
    """The single stderr line of a failed command, without its `error: ` prefix."""
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0].removeprefix("error: ")


def api_error(call) -> str:
    with pytest.raises((ValueError, OSError)) as caught:
        call()
    return str(caught.value)


@pytest.mark.parametrize("count", ["0", "-3"])
def test_layout_refuses_a_number_of_experts_below_one(count, capsys):
    assert main(["layout", "--fsdp", "8", "--ep", "8", "--num-experts", count]) == 2
    message = error_line(capsys)
    assert message.startswith(f"num_experts={count}: a MoE layer needs at least one expert")
    assert message == api_error(lambda: layout_picture(DistributedConfig(fsdp_size=8, ep_size=8), int(count)))


def test_plan_refuses_an_unregistered_ep_implementation(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_QWEN3_MOE, "model_type": "qwen3_moe"}))
    assert main(["plan", "--model", str(tmp_path), "--fsdp", "8", "--ep", "8", "--ep-implementation", "nonsense"]) == 2
    message = error_line(capsys)
    assert "'auto', 'all_to_all', 'all_reduce', 'deepgemm_megamoe'" in message
    assert message == api_error(lambda: DistributedConfig(fsdp_size=8, ep_size=8, ep_implementation="nonsense"))


def test_demo_refuses_an_output_dir_an_earlier_run_filled(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["demo", "--output-dir", str(tmp_path)]) == 2
    assert f"--output-dir {tmp_path} exists and is not empty (an earlier demo run?)" in error_line(capsys)
    assert [path.name for path in tmp_path.iterdir()] == ["config.json"]


def test_a_malformed_config_json_is_named(tmp_path, capsys):
    """(was: `error: Expecting property name enclosed in double quotes: line 2 column 1 (char 28)`)"""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe",\n')
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert error_line(capsys).startswith(f"{tmp_path / 'config.json'} is not valid JSON: Expecting property name")


def test_demo_with_too_few_devices_says_what_it_needs(tmp_path, capsys, monkeypatch):
    real_devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: real_devices(backend)[:2])
    assert main(["demo", "--output-dir", str(tmp_path)]) == 2
    message = error_line(capsys)
    assert message.startswith("The demo needs 8 devices but JAX started with 2 CPU device(s)")
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in message
    assert list(tmp_path.iterdir()) == []


def test_convert_dtype_error_is_the_python_api_error(tmp_path, capsys):
    from moe_jax import AutoModelForCausalLM

    assert main(["convert", "--from", "hf", "--to", "orbax", str(tmp_path), str(tmp_path / "out"),
                 "--dtype", "int8"]) == 2
    message = error_line(capsys)
    assert message == "dtype 'int8' is not a supported parameter dtype; use one of 'float32', 'bfloat16', 'float16'."
    assert message == api_error(lambda: AutoModelForCausalLM.from_pretrained(tmp_path, dtype="int8"))
    assert not (tmp_path / "out").exists()


def test_installed_console_script_reports_bad_input_without_a_traceback(tmp_path):
    """The `moe-jax` executable pip installed next to this Python, in a fresh process whose XLA_FLAGS ask
    for 2 CPU devices (the demo needs 8)."""
    executable = shutil.which("moe-jax", path=str(Path(sys.executable).parent))
    assert executable, f"no moe-jax next to {sys.executable}; install the project (pip install -e .)"
    environment = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([executable, "demo", "--output-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=300, env=environment)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: The demo needs 8 devices but JAX started with 2 CPU device(s)")
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command,flags,expected", [
    ("generate", ["--num-speculative-tokens", "0"], "--num-speculative-tokens 0 must be an int in [1, 16]"),
    ("serve", ["--num-speculative-tokens", "17"], "--num-speculative-tokens 17 must be an int in [1, 16]"),
    ("generate", ["--ngram-min", "5"], "--ngram-min 5 and --ngram-max 4: prompt lookup needs 1 <= ngram_min"),
])
def test_speculative_flags_out_of_range_are_refused_before_loading(command, flags, expected, capsys):
    checkpoint = Path(__file__).parent / "fixtures" / "models" / "qwen3_moe"
    prompt = ["--prompt-ids", "1,2"] if command == "generate" else []
    assert main([command, "--model", str(checkpoint), *prompt, "--speculative", "ngram", *flags]) == 2
    assert error_line(capsys).startswith(expected)
