"""The README's main command works end to end."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_console_command_in_a_fresh_process(tmp_path):
    """The README's command as a user runs it (virtual devices set up in a fresh process), then a second run
    into the same directory: one line, exit code 2, nothing touched (was: a traceback, exit 1)."""
    command = [sys.executable, "-m", "moe_jax.cli", "demo", "--output-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "agreement: OK" in result.stdout and "dropped pairs 0" in result.stdout
    assert (tmp_path / "tiny-qwen3-moe" / "config.json").is_file()
    written = sorted(path.name for path in (tmp_path / "tiny-qwen3-moe").iterdir())
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(written)    # `generate --prompt` works on it
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and again.stderr.startswith("error: ")
    assert "tiny-qwen3-moe already exists (an earlier demo run?)" in again.stderr
    assert sorted(path.name for path in (tmp_path / "tiny-qwen3-moe").iterdir()) == written
