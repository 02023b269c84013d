"""The planner's answers to bad requests: one clear error naming the bad value and its fix."""

import json
from pathlib import Path

import pytest

from moe_jax.checkpoint_files import read_config
from moe_jax.planning import plan_layouts

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3_moe"


def _plan(config=CHECKPOINT, **overrides):
    return plan_layouts(config, **{"devices": 8, "batch_size": 16, "seq_len": 32, "max_compiles": 0, **overrides})


def test_devices_no_layout_can_use_name_the_count_and_the_fix():
    with pytest.raises(ValueError) as error:
        _plan(devices=7)
    message = str(error.value)
    assert "--devices 7" in message and "--batch-size 16" in message and "power of two" in message
    assert "larger than the model's 3 layers" in message or "Cannot split" in message


def test_an_unknown_hardware_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown hardware 'h1000': use one of h100, h200, b200, a100, tpu-v5p, cpu"):
        _plan(hardware="h1000")


def test_a_missing_hardware_file_and_one_without_its_rates(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        _plan(hardware=str(tmp_path / "missing.json"))
    (tmp_path / "partial.json").write_text(json.dumps({"name": "x", "peak_flops": {"bfloat16": 1e15}}))
    with pytest.raises(ValueError, match="lacks hbm_bytes_per_second, inter_node, intra_node, memory_bytes"):
        _plan(hardware=str(tmp_path / "partial.json"))


def test_a_hardware_file_plans_like_a_named_profile(tmp_path):
    profile = {"name": "my-gpu", "peak_flops": {"bfloat16": 5e14, "float32": 6e13}, "hbm_bytes_per_second": 2e12,
               "memory_bytes": 8e10, "devices_per_node": 4,
               "intra_node": {"bytes_per_second": 3e11, "latency_seconds": 5e-6},
               "inter_node": {"bytes_per_second": 2.5e10, "latency_seconds": 1e-5}}
    (tmp_path / "gpu.json").write_text(json.dumps(profile))
    plan = _plan(hardware=str(tmp_path / "gpu.json"))
    assert plan.hardware.name == "my-gpu" and plan.device_memory == 8e10


def test_gb_and_gib_are_both_accepted_and_differ():
    assert _plan(device_memory="80GB").device_memory == 80 * 10**9
    assert _plan(device_memory="80GiB").device_memory == 80 * 2**30
    with pytest.raises(ValueError, match="'80 gigs' is not a number with a unit"):
        _plan(device_memory="80 gigs")


def test_a_model_that_is_not_an_moe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    with pytest.raises(ValueError, match="model_type='llama' is not supported"):
        _plan(config=tmp_path)
    dense = {**read_config(CHECKPOINT), "mlp_only_layers": [0, 1, 2]}
    with pytest.raises(ValueError, match="no layer with routed experts"):
        _plan(config=dense)


def test_bad_settings_name_themselves():
    with pytest.raises(ValueError, match="optimizer 'lion' is not one of"):
        _plan(optimizer="lion")
    with pytest.raises(ValueError, match="mixed precision keeps float32 master parameters"):
        _plan(dtype="bfloat16", mixed_precision=True)
    with pytest.raises(ValueError, match="--nodes 3 must divide --devices 8"):
        _plan(nodes=3)


@pytest.mark.heavy   # the suite's JSON rows: tests/test_cli.py's plan --auto
def test_the_json_rows_carry_the_public_fields():
    document = _plan(max_compiles=2).as_json()
    assert set(document) >= {"layouts", "min_devices_to_fit"}
    row = document["layouts"][0]
    assert set(row) >= {"rank", "distributed_config", "pipeline", "memory_bytes", "fits", "step_seconds",
                        "step_parts", "why"}
    assert set(row["distributed_config"]) == {"tp_size", "ep_size", "fsdp_size", "dp_replicate_size", "pp_size",
                                              "cp_size", "ep_implementation"}   # cp_strategy too with cp > 1
    assert set(row["memory_bytes"]) == {"parameters", "gradients", "optimizer", "activations", "temporaries",
                                        "total"}
    assert row["rank"] == 1 and row["fits"] and isinstance(row["step_seconds"], float)
    assert document["min_devices_to_fit"] is None
    pipelined = next(r for r in document["layouts"] if r["distributed_config"]["pp_size"] > 1)
    assert set(pipelined["pipeline"]) == {"microbatches", "schedule", "repeats"}
    json.dumps(document)
