"""What the planner compiles first, what it must compile, and how a row it did not compile reads."""

from pathlib import Path

import pytest

from moe_jax.checkpoint_files import read_config
from moe_jax.planning.compile_cache import CompileCache
from moe_jax.planning.compile_order import LAYOUT_FAMILIES, compile_order
from moe_jax.planning.layouts import Candidate, Layout, PipelineChoice
from moe_jax.planning.reachable import unreachable_implementations
from moe_jax.planning.search import plan_layouts
from moe_jax.reporting.layout_ranking import ranking_report

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3_moe"


def test_the_floor_is_the_best_guesses_and_one_layout_of_every_family():
    layouts = [Layout(1, 1, 8, 1, 1), Layout(2, 1, 4, 1, 1), Layout(1, 2, 8, 1, 1, "all_to_all"),
               Layout(1, 8, 8, 1, 1, "all_to_all"), Layout(1, 1, 4, 1, 2, "auto", PipelineChoice(2)),
               Layout(1, 1, 4, 2, 1)]
    candidates = [Candidate(layout, None) for layout in layouts]
    guesses = {id(c): seconds for c, seconds in zip(candidates, [1.0, 2.0, 3.0, 9.0, 8.0, 4.0])}
    states = {id(c): 0 for c in candidates}
    order, floor = compile_order(candidates, guesses, states, top=2)
    # the two best guesses, then ep 2, ep 8, pp 2 and HSDP each by their best member, in guess order
    assert [c.layout for c in floor] == [layouts[i] for i in (0, 1, 2, 5, 4, 3)]
    assert order == floor
    for family in LAYOUT_FAMILIES.values():
        assert {family(c.layout) for c in floor} == {family(layout) for layout in layouts}
    order, floor = compile_order(candidates, guesses, states, top=6)
    assert [c.layout for c in order] == [layouts[i] for i in (0, 1, 2, 5, 4, 3)]


def test_deepgemm_is_left_out_off_sm100_with_one_line():
    assert set(unreachable_implementations("h100")) == {"deepgemm_megamoe"}
    assert unreachable_implementations("b200") == {}
    plan = plan_layouts(CHECKPOINT, devices=8, batch_size=16, seq_len=32, max_compiles=0)
    assert not any("deepgemm" in item.reason for item in plan.excluded)
    needs, count = plan.unreachable["deepgemm_megamoe"]
    assert count > 0 and "SM100" in needs
    report = ranking_report(plan, model="CKPT")
    assert report.count("deepgemm_megamoe") == 1


def test_rows_not_compiled_are_not_known_to_fit_and_say_so(tmp_path):
    plan = plan_layouts(CHECKPOINT, devices=8, batch_size=16, seq_len=32, max_compiles=1,
                        cache=CompileCache(tmp_path))
    report = ranking_report(plan, model="CKPT", top=100)
    assert report.splitlines()[0].startswith(f"compiled 1 of {len(plan.estimates)} legal layouts; the budget stopped")
    assert plan.best is not None and plan.best.compiled
    uncompiled = [row for row in plan.as_json()["layouts"] if not row["compiled"]]
    assert uncompiled and all(row["fits"] is None for row in uncompiled)
    lines = [line for line in report.splitlines() if "not compiled: the compile budget ran out" in line]
    assert len(lines) == len(uncompiled) and all("(estimate)" in line and "~" in line for line in lines)
    assert not any(" 0.00 " in line for line in lines)


@pytest.mark.heavy
def test_a_second_plan_reads_the_compiled_steps_from_the_cache(tmp_path):
    options = dict(devices=8, batch_size=16, seq_len=32, max_compiles=1, cache=CompileCache(tmp_path))
    first = plan_layouts(CHECKPOINT, **options)
    assert len(list(tmp_path.glob("*/*.pickle"))) == 1 and not any(e.cached for e in first.estimates)
    second = plan_layouts(CHECKPOINT, **options)
    again = next(e for e in second.estimates if e.compiled)
    assert again.cached and "compiled step read from the compile cache" in again.notes
    assert again.memory == first.best.memory and again.step_seconds == first.best.step_seconds
    other = plan_layouts({**read_config(CHECKPOINT), "moe_intermediate_size": 32}, **options)
    assert not any(e.cached for e in other.estimates)       # another config is another key


# heavy: two plans; the cache read is the suite's in the test above
@pytest.mark.heavy
def test_cached_layouts_are_read_whatever_the_budget(tmp_path):
    """A plan that compiled two layouts leaves them for the next, which reads both though its budget compiles
    nothing new (the floor of one guess, time budget 0)."""
    cache = CompileCache(tmp_path)
    plan_layouts(CHECKPOINT, devices=8, batch_size=16, seq_len=32, max_compiles=2, cache=cache)
    second = plan_layouts(CHECKPOINT, devices=8, batch_size=16, seq_len=32, time_budget=0.0, compile_floor=True,
                          floor_guesses=1, cache=cache)
    assert sum(e.compiled for e in second.estimates) >= 2
    assert all(e.cached for e in second.estimates if e.compiled and e.layout not in second.floor)
