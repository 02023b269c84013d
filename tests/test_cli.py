"""The `moe-jax` subcommands a user runs from a shell."""

import argparse
import json
import re
from pathlib import Path

import pytest

from moe_jax.cli import build_parser, main
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


def test_plan_with_more_tp_than_kv_heads_says_what_happens_to_the_heads(tmp_path, capsys):
    """(was: accepted without a word) The fixture has 2 KV heads of 8 rows: k/v projections of 16 rows."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_QWEN3_MOE, "model_type": "qwen3_moe"}))
    assert main(["plan", "--model", str(tmp_path), "--tp", "4"]) == 0
    assert ("note: tp_size=4 does not divide the 2 KV heads: each TP device holds 4 of the 16 rows of every k/v "
            "projection (a head is 8 rows)") in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path), "--tp", "2"]) == 0
    assert "note: tp_size" not in capsys.readouterr().out


def test_the_help_describes_the_commands_and_every_flag():
    """(was: the top-level description spoke of `COMMANDS`, and demo --seed and generate's sampling flags had
    no help text)"""
    parser = build_parser()
    assert "COMMANDS" not in parser.description and "moe-jax demo" in parser.description
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    undocumented = [f"{name} {action.option_strings[0]}" for name, subparser in subparsers.choices.items()
                    for action in subparser._actions if action.option_strings and not action.help]
    assert undocumented == []


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return subparsers.choices[name]


def _help(name: str, flag: str) -> str:
    return next(action.help for action in _subparser(name)._actions if flag in action.option_strings)


def test_help_promises_only_what_runs():
    """serve lists no pipeline flag (continuous batching does not run stages: every --pp value failed) and does
    not limit itself to one process; train's data flags name every format they read."""
    serve_flags = {flag for action in _subparser("serve")._actions for flag in action.option_strings}
    assert not {flag for flag in serve_flags if flag.startswith("--pp")}
    assert {"--tp", "--fsdp", "--ep", "--dp-replicate", "--ep-implementation"} <= serve_flags
    assert "one process's devices" not in build_parser().format_help()
    for suffix in (".npy", ".parquet", ".jsonl", ".array_record", ".txt"):
        assert suffix in _help("train", "--data"), suffix
        assert suffix in _help("train", "--eval-data"), suffix


def test_a_one_device_layout_is_one_device(capsys):
    assert main(["layout", "--tp", "1"]) == 0
    assert capsys.readouterr().out.startswith("1 device: tp_size=1")


def test_plan_shows_the_pipeline_stages(capsys):
    """Layers, devices and bytes per stage, and the bubble fraction of the schedule."""
    checkpoint = Path(__file__).resolve().parent / "fixtures" / "models" / "qwen3_moe"
    assert main(["plan", "--model", str(checkpoint), "--pp", "2", "--fsdp", "2", "--pp-microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages, gpipe, 4 microbatches per batch (bubble fraction 20%)" in out
    assert re.search(r"^  0 +0 +0,1 +[\d.]+ KiB$", out, re.MULTILINE)
    assert re.search(r"^  1 +1-2 +2,3 +[\d.]+ KiB$", out, re.MULTILINE)


def test_plan_train_with_a_lora_rank_counts_the_adapter_state_beside_the_frozen_base(capsys):
    from tests.models.test_fixture_parity import FIXTURES

    def optimizer_bytes(*flags) -> str:
        assert main(["plan", "--model", str(FIXTURES / "qwen3_moe"), "--fsdp", "8", "--ep", "8", "--train",
                     *flags]) == 0
        out = capsys.readouterr().out
        return out, next(line for line in out.splitlines() if line.strip().startswith("optimizer state"))

    full_out, full = optimizer_bytes()
    lora_out, lora = optimizer_bytes("--lora-rank", "4", "--lora-target-modules", "q_proj,v_proj")
    assert "LoRA r=4 adapter trained" in lora_out and "beside it, frozen in the model: parameter bytes" in lora_out
    assert float(lora.split()[2]) < float(full.split()[2]) and full.split()[3] == lora.split()[3] == "KiB"
    assert main(["plan", "--model", str(FIXTURES / "qwen3_moe"), "--lora-rank", "4"]) == 2


def test_plan_train_counts_the_offloaded_state_in_host_memory_apart(capsys):
    from tests.models.test_fixture_parity import FIXTURES

    def split(*flags) -> tuple[float, float]:
        assert main(["plan", "--model", str(FIXTURES / "qwen3_moe"), "--fsdp", "8", "--ep", "8", "--train",
                     *flags]) == 0
        out = capsys.readouterr().out
        line = next(line for line in out.splitlines() if "between steps" in line)
        device, host = re.findall(r"([\d.]+) (?:KiB|B) ", line)   # KiB, or "0 B"
        return float(device), float(host)

    assert main(["plan", "--model", str(FIXTURES / "qwen3_moe"), "--fsdp", "8", "--ep", "8", "--train"]) == 0
    parts = {row.split()[0]: float(row.split()[-7]) for row in capsys.readouterr().out.splitlines()
             if row.strip().startswith(("expert", "dense", "optimizer", "total"))}
    assert split("--offload-optimizer") == pytest.approx((parts["total"] - parts["optimizer"], parts["optimizer"]),
                                                         abs=0.1)
    assert split("--offload-optimizer", "--offload-parameters") == (0.0, parts["total"])
    assert split("--offload-parameters") == pytest.approx((parts["optimizer"], parts["expert"] + parts["dense"]),
                                                          abs=0.1)
    assert main(["plan", "--model", str(FIXTURES / "qwen3_moe"), "--offload-optimizer"]) == 2


def test_plan_auto_counts_the_offloaded_optimizer_state_in_host_memory_apart(tmp_path, capsys):
    checkpoint = Path(__file__).resolve().parent / "fixtures" / "models" / "qwen3_moe"
    output = tmp_path / "plan.json"
    assert main(["plan", "--auto", "--model", str(checkpoint), "--devices", "8", "--batch-size", "16",
                 "--seq-len", "32", "--train", "--max-compiles", "1", "--offload-optimizer", "--no-cache",
                 "--json", str(output)]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("rank"))
    assert re.search(r"total \w+ +host \w+ +why", header)
    rows = json.loads(output.read_text())["layouts"]
    (row,) = [row for row in rows if row["compiled"]]
    # XLA:CPU: the state's bytes (moved in for the step), and the same for the layouts not compiled
    assert all(other["memory_bytes"]["host"] == other["memory_bytes"]["optimizer"] > 0 for other in rows)
    assert any("XLA:CPU counts the offloaded state in the device's total" in note for note in row["notes"])
    assert main(["plan", "--auto", "--model", str(checkpoint), "--devices", "8", "--serve",
                 "--offload-parameters"]) == 2
    assert "places a train state" in capsys.readouterr().err


def test_plan_auto_ranks_layouts_and_writes_the_json_rows(tmp_path, capsys):
    checkpoint = Path(__file__).resolve().parent / "fixtures" / "models" / "qwen3_moe"
    output = tmp_path / "plan.json"
    assert main(["plan", "--auto", "--model", str(checkpoint), "--devices", "8", "--batch-size", "16",
                 "--seq-len", "32", "--train", "--device-memory", "80GB", "--max-compiles", "2",
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(output)]) == 0
    captured = capsys.readouterr()
    assert "80GB = 80 x 10^9 bytes (74.5 GiB)" in captured.err
    out = captured.out
    assert out.splitlines()[0].startswith("compiled 2 of ")
    assert "layout 2 of 2 (the floor):" in captured.err and "best so far:" in captured.err
    assert "Use rank 1," in out and f"moe-jax train --model {checkpoint} --tp" in out and "DistributedConfig(" in out
    assert "not compiled: the compile budget ran out" in out and "excluded:" in out
    document = json.loads(output.read_text())
    assert document["min_devices_to_fit"] is None and document["layouts"][0]["rank"] == 1
    assert document["layouts"][0]["fits"] and document["device_memory_bytes"] == 80 * 10**9
    assert document["layouts"][-1]["fits"] is None and document["compiled"] == 2
    assert len(list((tmp_path / "cache").glob("*/*.pickle"))) == 2


def test_plan_auto_refuses_a_layout_and_needs_a_device_count(capsys):
    checkpoint = Path(__file__).resolve().parent / "fixtures" / "models" / "qwen3_moe"
    assert main(["plan", "--auto", "--model", str(checkpoint), "--devices", "8", "--tp", "2"]) == 2
    assert "--auto chooses the layout: drop --tp" in capsys.readouterr().err
    assert main(["plan", "--auto", "--model", str(checkpoint)]) == 2
    assert "--auto needs --devices N" in capsys.readouterr().err
    assert main(["plan", "--auto", "--model", str(checkpoint), "--devices", "8", "--hardware", "tpu-v9"]) == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err


def test_plan_help_names_every_hardware_profile_without_importing_the_planner(capsys):
    from moe_jax.planning.hardware import HARDWARE_CHOICES

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in HARDWARE_CHOICES)
