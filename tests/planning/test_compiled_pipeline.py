"""A pipeline layout's memory is what XLA assigns its real train step (the other layouts:
tests/planning/test_compiled_step.py, whose reference compile this reuses)."""

import pytest

from moe_jax.planning.layouts import Layout, PipelineChoice
from moe_jax.planning.search import plan_layouts
from tests.planning.test_compiled_step import BATCH, CHECKPOINT, SEQ, compiled_total

PIPELINE_WITH_EP = Layout(1, 2, 4, 1, 2, "all_to_all", PipelineChoice(4))


# heavy: the suite's compiled-memory check is tp with ep (test_compiled_step.py); this one runs with --heavy.
@pytest.mark.heavy
def test_a_pipeline_rows_memory_is_the_compiled_steps():
    plan = plan_layouts(CHECKPOINT, devices=8, batch_size=BATCH, seq_len=SEQ, hardware="h100",
                        include=lambda layout: layout == PIPELINE_WITH_EP)
    (row,) = plan.estimates
    expected = compiled_total(PIPELINE_WITH_EP)
    assert row.compiled and abs(row.memory.total - expected) <= 0.1 * expected
    assert row.step_parts["pipeline bubble"] > 0 and row.bubble_fraction == 1 / 5
