"""Planning a serving layout: one decode step of every slot against a full KV cache, no pipeline stages."""

from pathlib import Path

from moe_jax.planning import plan_layouts
from moe_jax.planning.explain import command_text

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3_moe"


def test_serving_rows_hold_parameters_and_the_kv_cache():
    plan = plan_layouts(CHECKPOINT, devices=8, mode="serve", max_slots=16, max_model_len=128, max_compiles=1)
    assert all(estimate.layout.pp == 1 for estimate in plan.estimates)
    best = plan.estimates[0]
    assert best.compiled and best.fits
    memory = best.memory
    assert memory.gradients == 0 and memory.optimizer == 0
    # the cache: 3 layers x keys and values x 16 slots x 128 tokens x 2 KV heads x 8 wide x 4 bytes, split over
    # the layout's data-parallel groups and (when tp divides the 2 KV heads) tp
    layout = best.layout
    heads_split = layout.tp if 2 % layout.tp == 0 else 1
    assert memory.activations >= 3 * 2 * 16 * 128 * 2 * 8 * 4 // (layout.data_parallel * heads_split)
    assert command_text(layout, "CKPT", plan.request).startswith(f"moe-jax serve --model CKPT {layout.flags()}")
