"""A row's memory is what XLA assigns the real train step: within 10% of `memory_analysis()` of
`make_train_step(...).lower(state, batch).compile()` built here the way a user builds it."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from moe_jax.causal_lm.auto import AutoModelForCausalLM
from moe_jax.checkpoint_files import read_config
from moe_jax.planning.layouts import Layout
from moe_jax.planning.search import plan_layouts
from moe_jax.training.optimizers import build_optimizer
from moe_jax.training.state import abstract_train_state
from moe_jax.training.step import make_train_step
from tests.heavy import representative

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3_moe"
BATCH, SEQ = 16, 32
LAYOUTS = {
    "tp with ep": Layout(2, 4, 4, 1, 1, "all_to_all"),
    "HSDP with ep": Layout(1, 4, 4, 2, 1, "all_to_all"),
    "fsdp only": Layout(1, 1, 8, 1, 1),
    "all_reduce ep": Layout(2, 2, 4, 1, 1, "all_reduce"),
}


def compiled_total(layout: Layout) -> int:
    """Bytes one device holds at the real step's peak: arguments + outputs - aliased + temporaries."""
    model = AutoModelForCausalLM.from_config(read_config(CHECKPOINT), layout.distributed_config(),
                                             devices=jax.devices()[:8], **layout.model_options())
    step = make_train_step(model, build_optimizer("adamw", learning_rate=1e-3), grad_clip=1.0)
    capacity = None if layout.ep == 1 else model.capacity_schedule.start().capacity
    state = abstract_train_state(model, step.optimizer, capacity)
    batch = {"input_ids": jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=model.batch_sharding())}
    analysis = step.lower(state, batch).compile().memory_analysis()
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes)


# The suite checks tp with ep; --heavy (scripts/run_heavy_tests.sh) the rest, and the pipeline's
# (test_compiled_pipeline.py).
@pytest.mark.parametrize("kind", representative(LAYOUTS, suite=("tp with ep",)))
def test_a_rows_memory_is_the_compiled_steps(kind):
    plan = plan_layouts(CHECKPOINT, devices=8, batch_size=BATCH, seq_len=SEQ, hardware="h100",
                        include=lambda layout: layout == LAYOUTS[kind])
    row = next(estimate for estimate in plan.estimates if estimate.layout == LAYOUTS[kind])
    assert row.compiled
    memory = row.memory
    assert memory.total == sum(memory.as_dict()[part] for part in
                               ("parameters", "gradients", "optimizer", "activations", "temporaries"))
    expected = compiled_total(row.layout)
    assert abs(memory.total - expected) <= 0.1 * expected
    assert memory.activations > 0 and memory.temporaries >= 0
