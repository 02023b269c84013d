"""The README's main command works end to end."""

import subprocess
import sys

import pytest

from moe_jax.cli import main
from moe_jax.demo import run_demo


@pytest.mark.slow
def test_demo_loads_sharded_checkpoint_and_agrees_with_one_device(tmp_path, capsys):
    assert run_demo(str(tmp_path)) <= 1e-4
    out = capsys.readouterr().out
    assert "agreement: OK" in out and "dropped pairs 0" in out
    assert (tmp_path / "tiny-qwen3-moe" / "config.json").is_file()

    # A second run into the same directory stops with one line and exit code 2 (was: a traceback, exit 1).
    written = sorted(path.name for path in (tmp_path / "tiny-qwen3-moe").iterdir())
    assert main(["demo", "--output-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "tiny-qwen3-moe already exists (an earlier demo run?)" in error
    assert sorted(path.name for path in (tmp_path / "tiny-qwen3-moe").iterdir()) == written


@pytest.mark.slow
def test_demo_console_command_in_a_fresh_process(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moe_jax.cli", "demo", "--output-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "agreement: OK" in result.stdout
