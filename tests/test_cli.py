"""The `moe-jax` subcommands a user runs from a shell."""

import json

from moe_jax.cli import main
from tests.models.hf_reference import TINY_QWEN3_MOE


def test_plan_command_prints_plans_specs_and_layout(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_QWEN3_MOE, "model_type": "qwen3_moe"}))
    assert main(["plan", "--model", str(tmp_path), "--tp", "2", "--fsdp", "4", "--ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.*.mlp.experts: ep_dispatch_experts" in out
    line = next(row for row in out.splitlines() if row.startswith("model.layers.*.mlp.experts.gate_up_proj"))
    assert "P(('ep_fsdp', 'tp', 'efsdp'), None, None)" in line and "[1, 32, 32]" in line and "layers 1-2" in line
    assert "efsdp_size=2" in out


def test_plan_command_reports_bad_layouts_and_models(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_QWEN3_MOE, "model_type": "qwen3_moe"}))
    assert main(["plan", "--model", str(tmp_path), "--fsdp", "8", "--ep", "16"]) == 2
    assert "`ep_size` must divide `fsdp_size * tp_size`." in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["plan", "--model", str(tmp_path), "--tp", "2"]) == 2
    assert "model_type='llama' is not supported" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "nowhere"), "--tp", "2"]) == 2
    error = capsys.readouterr().err
    # The config reader resolves no hub repo ids, so the message must not offer them.
    assert "nowhere does not exist" in error and "download its config first" in error
    (tmp_path / "empty").mkdir()
    assert main(["plan", "--model", str(tmp_path / "empty")]) == 2
    assert "No config.json at" in capsys.readouterr().err


def test_plan_command_reads_a_config_json_path(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_QWEN3_MOE, "model_type": "qwen3_moe"}))
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--fsdp", "8", "--ep", "8"]) == 0
    assert "model.layers.*.mlp.experts: ep_dispatch_experts" in capsys.readouterr().out
