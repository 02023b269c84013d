"""bench_serve.py's workload generators (scripts/bench/serve_workloads.py): shapes and what repeats share."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import serve_workloads as sw  # noqa: E402

VOCAB = 4096


def lengths(convs):
    return [[(len(turn["user"]), turn["max_tokens"]) for turn in conv] for conv in convs]


@pytest.mark.parametrize("workload", sw.WORKLOADS)
def test_every_pass_has_the_same_lengths_and_fresh_ids(workload):
    prompt, output = sw.DEFAULT_LENGTHS[workload]
    first, second = (sw.conversations(workload, 8, prompt, output, VOCAB, 0, p, system_tokens=64) for p in (0, 1))
    assert lengths(first) == lengths(second)
    assert sw.requests_count(first) == 8
    for conv in first:
        for turn in conv:
            assert output[0] <= turn["max_tokens"] <= output[1]
            assert all(sw.FIRST_ID <= t < VOCAB for t in turn["user"])
    # No request of one pass begins like one of another (the prefix cache would serve it), but for the system prompt.
    skip = 64 if workload == "shared-prefix" else 0
    assert {tuple(c[0]["user"][skip:skip + 16]) for c in first}.isdisjoint(
        tuple(c[0]["user"][skip:skip + 16]) for c in second)


def test_shared_prefix_shares_the_system_prompt_with_every_pass_and_the_warm_up():
    passes = [sw.conversations("shared-prefix", 4, (8, 8), (16, 16), VOCAB, 0, p, system_tokens=100)
              for p in (-1, 0, 3)]
    systems = {tuple(conv[0]["user"][:100]) for convs in passes for conv in convs}
    assert len(systems) == 1
    assert all(len(conv[0]["user"]) == 108 for convs in passes for conv in convs)


def test_multi_turn_conversations_and_their_longest_context():
    convs = sw.conversations("multi-turn", 12, (10, 10), (5, 5), VOCAB, 0, 0, turns=3)
    assert [len(conv) for conv in convs] == [3] * 4
    assert sw.longest(convs) == 3 * (10 + 5)


def test_transcripts_and_the_word_level_text():
    assert sw.parse_ids("t12 t45  t3") == [12, 45, 3]
    convs = sw.conversations("multi-turn", 4, (4, 4), (2, 2), VOCAB, 0, 0, turns=2)
    results = [{"prompt": [i] * 3} for i in range(4)]
    assert sw.transcripts(convs, results) == [
        [{"prompt": [0] * 3, "max_tokens": 2}, {"prompt": [1] * 3, "max_tokens": 2}],
        [{"prompt": [2] * 3, "max_tokens": 2}, {"prompt": [3] * 3, "max_tokens": 2}]]


def test_prompt_lookup_hits_on_the_answers_given():
    # After (1, 2, 3): 4 proposed, right; after (2, 3, 4): 5, right; after (3, 4, 5): 1, wrong; then no match.
    hits = sw.lookup_hits([{"prompt": [1, 2, 3, 4, 5, 1, 2, 3], "answer": [4, 5, 9, 2, 3, 4]}])
    assert hits == {"tokens": 6, "proposed": 0.5, "right": pytest.approx(2 / 3)}
