"""Planning at real sizes from the public configs (tests/fixtures/configs): state bytes against a hand count,
and a model whose weights alone exceed 8 devices."""

from pathlib import Path

import pytest

from moe_jax.checkpoint_files import read_config
from moe_jax.planning import plan_layouts

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def qwen3_moe_parameters(config: dict) -> int:
    """Qwen3-MoE's parameters counted from its config by hand: embeddings and head, and per layer two norms,
    q/k/v/o projections, q/k norms, the router and the experts' gate, up and down projections."""
    hidden, heads, kv_heads, head = (config["hidden_size"], config["num_attention_heads"],
                                     config["num_key_value_heads"], config["head_dim"])
    experts, intermediate = config["num_experts"], config["moe_intermediate_size"]
    layer = (2 * hidden + 2 * heads * head * hidden + 2 * kv_heads * head * hidden + 2 * head
             + experts * hidden + experts * 3 * intermediate * hidden)
    return 2 * config["vocab_size"] * hidden + hidden + config["num_hidden_layers"] * layer


@pytest.fixture(scope="module")
def qwen3_plan():
    return plan_layouts(CONFIGS / "qwen3_30b_a3b.json", devices=8, batch_size=8, seq_len=4096,
                        device_memory="80GiB", max_compiles=0)


@pytest.mark.parametrize("name", ["tp1 ep8 fsdp8 all_to_all", "tp2 ep4 fsdp4 all_to_all", "tp1 ep1 fsdp8",
                                  "tp1 ep4 fsdp4 pp2/M2 all_to_all"])
def test_qwen3_30b_state_is_the_hand_count_over_eight(qwen3_plan, name):
    """float32 parameters and AdamW's two float32 moments, split over all 8 devices (a pipeline layout holds
    the embeddings and head on both stages: within the 5%)."""
    count = qwen3_moe_parameters(read_config(CONFIGS / "qwen3_30b_a3b.json"))
    assert 30.0e9 < count < 31.0e9                      # "30B"
    row = next(estimate for estimate in qwen3_plan.estimates if estimate.layout.name == name)
    assert row.memory.parameters == pytest.approx(count * 4 / 8, rel=0.05)
    assert row.memory.optimizer == pytest.approx(2 * count * 4 / 8, rel=0.05)
    assert row.memory.gradients == pytest.approx(count * 4 / 8, rel=0.05)


# heavy: a second real config (DeepSeek-V3 needs more devices); Qwen3-30B-A3B's plan stays in the suite
@pytest.mark.heavy
def test_deepseek_v3_fits_no_layout_of_eight_devices_and_says_how_many_would():
    """671B bfloat16 weights alone are 1.3 TB, more than 8 x 80 GiB: no row fits, and the smallest count where
    a layout holds the state is found (this process has too few CPU devices to compile there: said so)."""
    plan = plan_layouts(CONFIGS / "deepseek_v3.json", devices=8, batch_size=8, seq_len=4096,
                        device_memory="80GiB", dtype="bfloat16")
    assert plan.best is None and not any(estimate.compiled for estimate in plan.estimates)
    assert all(estimate.memory.parameters * 8 > 8 * 80 * 2**30 for estimate in plan.estimates
               if estimate.layout.tp * estimate.layout.fsdp * estimate.layout.dp_replicate == 8)
    assert plan.min_devices_to_fit is not None and plan.min_devices_to_fit > 8
    assert "not compiled" in plan.min_devices_note
    assert plan.as_json()["min_devices_to_fit"] == plan.min_devices_to_fit
    assert "does not fit: parameters, float32 gradients and optimizer state alone need" in plan.estimates[0].why
