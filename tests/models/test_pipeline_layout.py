"""Which layers each pipeline stage runs and how their parameters are grouped (pure, no devices)."""

import pytest

from moe_jax.models.pipeline_layout import PipelineLayout, check_pipeline_options, pipeline_chunks


def test_gpipe_is_the_reference_split():
    """transformers' `layer_range_for_rank`: an even split, the last stage takes the remainder."""
    assert pipeline_chunks(32, 3, 1, "gpipe") == [(0, 10), (10, 20), (20, 32)]
    assert pipeline_chunks(4, 2, 1, "gpipe") == [(0, 2), (2, 4)]


def test_circular_chunks_visit_every_stage_each_repeat():
    layout = PipelineLayout.plan(8, 2, 2, "circular", ["same"] * 8)
    assert layout.stage_layers(0) == [0, 1, 4, 5]
    assert layout.stage_layers(1) == [2, 3, 6, 7]
    (group,) = layout.groups
    # Rows stage-major, then repeat, then slot: stage 0's rows first, so splitting over pp gives each its own.
    assert layout.members(group, 0) == (0, 1, 4, 5, 2, 3, 6, 7)


def test_layers_of_another_structure_get_their_own_kind_with_zero_rows():
    """DeepSeek-like: dense layer 0, sparse after; 4 layers on 2 stages."""
    layout = PipelineLayout.plan(4, 2, 1, "gpipe", ["dense", "sparse", "sparse", "sparse"])
    first, second = layout.groups
    assert (first.start, first.stop, second.start, second.stop) == (0, 1, 1, 2)
    assert [kind.present for kind in first.kinds] == [(True, False), (False, True)]
    assert layout.members(first, 0) == (0, None) and layout.members(first, 1) == (None, 2)
    assert layout.members(second, 0) == (1, 3)
    assert [first.key(0), first.key(1), second.key(0)] == ["pp0k0", "pp0k1", "pp1"]


def test_an_uneven_split_pads_the_shorter_stages():
    layout = PipelineLayout.plan(5, 2, 1, "gpipe", ["same"] * 5)
    assert layout.chunks == ((0, 2), (2, 5))
    head, tail = layout.groups
    assert layout.members(head, 0) == (0, 1, 2, 3)
    assert tail.kinds[0].present == (False, True) and layout.members(tail, 0) == (None, 4)


def test_alternating_kinds_scan_when_every_stage_alternates_alike():
    """gpt-oss-like sliding / full layers: with 2 layers a stage each slot holds one kind on every stage."""
    layout = PipelineLayout.plan(4, 2, 1, "gpipe", ["sliding", "full"] * 2)
    assert [(group.start, group.stop, len(group.kinds)) for group in layout.groups] == [(0, 1, 1), (1, 2, 1)]


@pytest.mark.parametrize("arguments, message", [
    ((6, 2, 2, "circular"), r"needs the layer count to split into 4 equal chunks, but the model has 6 layers; "
                            r"pipeline_repeats \[1, 3\] work with pp_size=2"),
    ((3, 4, 1, "gpipe"), r"pp_size=4 is larger than the model's 3 layers"),
    ((8, 2, 2, "gpipe"), r"pipeline_repeats=2 needs pipeline_schedule='circular'"),
    ((8, 2, 1, "1f1b"), r"pipeline_schedule='1f1b' is not a schedule; use one of \['gpipe', 'circular'\]"),
])
def test_bad_splits_say_what_works(arguments, message):
    with pytest.raises(ValueError, match=message):
        pipeline_chunks(*arguments)


def test_pipeline_options_default_to_one_microbatch_per_stage():
    assert check_pipeline_options(4, None, "gpipe", 1) == 4
    assert check_pipeline_options(1, None, "gpipe", 1) == 1
    with pytest.raises(ValueError, match=r"pipeline_microbatches=1 is below pp_size=2: a circular schedule"):
        check_pipeline_options(2, 1, "circular", 2)
    with pytest.raises(ValueError, match=r"apply with pp_size > 1"):
        check_pipeline_options(1, 4, "gpipe", 1)
    with pytest.raises(ValueError, match=r"pipeline_microbatches=0 must be a positive integer"):
        check_pipeline_options(2, 0, "gpipe", 1)
