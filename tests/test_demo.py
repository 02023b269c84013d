"""The README's main command works end to end, and its checkpoint serves the other commands."""

import subprocess
import sys

import pytest

from moe_jax.cli import main


@pytest.mark.slow
def test_demo_console_command_in_a_fresh_process(tmp_path, capsys):
    """The README's command as a user runs it (virtual devices set up in a fresh process); `generate` on the
    directory it was given (was: the checkpoint went to a subdirectory, and had no tokenizer); then a
    second run into the same directory: one line, exit code 2, nothing touched (was: a traceback, exit 1)."""
    command = [sys.executable, "-m", "moe_jax.cli", "demo", "--output-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "agreement: OK" in result.stdout and "dropped pairs 0" in result.stdout
    assert f"reuse it with --model, e.g. moe-jax generate --model {tmp_path} --prompt Hi" in result.stdout
    written = sorted(path.name for path in tmp_path.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(written)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().out.startswith("Hi")
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and again.stderr.startswith("error: ")
    assert f"--output-dir {tmp_path} exists and is not empty (an earlier demo run?)" in again.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == written
