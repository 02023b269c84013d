"""Automatic prefix caching: in the scheduler (driven by the fake step of test_scheduler) what a request reuses,
what it prefills, what it registers, and how pages are shared, evicted and counted; on a model, the same greedy
tokens with and without it."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.inference import ServingEngine
from moe_jax.inference.requests import ContinuousBatchingConfig, Request, RequestSettings, RequestStatus
from moe_jax.inference.scheduler import Scheduler
from moe_jax.kv_cache import page_digests, root_digest
from tests.heavy import representative

from .test_continuous import load, run_staggered
from .test_scheduler import VOCAB, FakeStep, run_all, scheduler

SYSTEM = list(range(1, 13))          # a shared prefix of 3 pages of 4


def prefill_starts(step: FakeStep, request_index_row: int = 0) -> list[int]:
    return [int(inputs["lengths"][request_index_row]) for kind, inputs in step.calls
            if kind in ("prefill", "mixed") and inputs["mask"][request_index_row].sum() > 1]


def test_each_adapter_and_each_weights_version_has_its_own_digests_and_the_last_token_is_never_cached():
    """A page's keys and values depend on the adapter that computed them and on the weights: one adapter's (or the
    base's, or older weights') pages never serve another's request (many-adapter serving shares one page book)."""
    from moe_jax.inference.prefix_cache import PrefixCache
    from moe_jax.kv_cache import PageBook

    prefix = PrefixCache(PageBook(groups=1, pages_per_group=8, page_size=4), page_size=4, enabled=True, namespace="m")

    def digests(adapter: int) -> list[bytes]:
        return prefix.reusable(Request(f"r{adapter}", SYSTEM + [1], RequestSettings(max_new_tokens=1, adapter=adapter)))

    base, sql, chat = digests(0), digests(1), digests(2)
    assert len(base) == 3 and len({base[0], sql[0], chat[0]}) == 3 and digests(1) == sql
    prefix.new_weights()
    assert digests(1)[0] != sql[0]
    # a prompt that fills its last page exactly offers one page fewer: its last token is prefilled to sample from
    assert len(prefix.reusable(Request("full", SYSTEM, RequestSettings(max_new_tokens=1)))) == 2


def test_a_later_request_reuses_the_cached_prefix_pages_and_prefills_only_the_rest():
    step = FakeStep()
    engine = scheduler(step, max_slots=2, page_size=4, max_model_len=32, prefill_chunk=8, mixed_steps=False)
    first = Request("first", SYSTEM + [20, 21], RequestSettings(max_new_tokens=2))
    engine.add(first)
    run_all(engine)
    step.calls.clear()
    second = Request("second", SYSTEM + [30, 31, 32], RequestSettings(max_new_tokens=4))
    engine.add(second)
    engine.step()
    assert second.pages[:3] == first_pages(engine, SYSTEM) and second.output.cached_tokens == 12
    assert prefill_starts(step) == [12]                                # only [30, 31, 32] is computed
    run_all(engine)
    assert second.output.generated_tokens == [33, 34, 35, 36]
    assert (engine.prefix_cache.prompt_tokens, engine.prefix_cache.cached_prompt_tokens) == (29, 12)
    assert engine.prefix_cache.hit_rate == pytest.approx(12 / 29)
    assert engine.book.free_pages() == engine.book.total_pages


def first_pages(engine: Scheduler, prefix: list[int]) -> list[int]:
    return engine.book.match(0, page_digests(prefix, engine.config.page_size, root_digest(engine.prefix_cache.namespace)))


def test_a_wholly_cached_prompt_still_prefills_its_last_token():
    step = FakeStep()
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=32, mixed_steps=False)
    for name in ("a", "b"):
        engine.add(Request(name, SYSTEM, RequestSettings(max_new_tokens=1)))
    run_all(engine)
    prefills = [inputs for kind, inputs in step.calls if kind == "prefill"]
    assert [(int(p["lengths"][0]), int(p["mask"][0].sum())) for p in prefills] == [(0, 12), (8, 4)]


def test_generated_pages_are_cached_for_the_next_turn_of_a_conversation():
    step = FakeStep()
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=32, mixed_steps=False)
    turn = Request("turn1", [1, 2, 3, 4, 5, 6], RequestSettings(max_new_tokens=6))
    engine.add(turn)
    run_all(engine)
    assert turn.output.generated_tokens == [7, 8, 9, 10, 11, 12]
    # The next turn resends the conversation: the prompt and the answer (stored up to its last-but-one token).
    resent = Request("turn2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 41], RequestSettings(max_new_tokens=1))
    engine.add(resent)
    run_all(engine)
    assert resent.output.cached_tokens == 8                            # pages [1..4], [5..8]; [9..12] was not full
    assert resent.output.generated_tokens == [42]


def test_a_salt_keeps_requests_apart():
    step = FakeStep()
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=32)
    engine.add(Request("a", SYSTEM + [1], RequestSettings(max_new_tokens=1), cache_salt="tenant-a"))
    engine.add(Request("b", SYSTEM + [1], RequestSettings(max_new_tokens=1), cache_salt="tenant-b"))
    engine.add(Request("c", SYSTEM + [1], RequestSettings(max_new_tokens=1), cache_salt="tenant-a"))
    run_all(engine)
    assert engine.prefix_cache.cached_prompt_tokens == 12                           # c reused a's pages; b reused none


def test_under_page_pressure_idle_prefixes_are_evicted_and_tokens_are_unchanged():
    step = FakeStep()
    # 8 pages of 4: the first request takes 5 (14 prompt + 6 new tokens) and leaves 4 cached; the second takes 6
    # (14 + 10), so 2 of them are evicted (the last first), and the third, the first's prompt again, reuses 2 (and
    # evicts 2 of the second's 5 cached pages for its own).
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=24, num_pages=8)
    prompts = [[base + i for i in range(14)] for base in (1, 21, 1)]
    new_tokens = (6, 10, 6)
    requests = [Request(f"r{i}", prompt, RequestSettings(max_new_tokens=n))
                for i, (prompt, n) in enumerate(zip(prompts, new_tokens))]
    for request in requests:
        engine.add(request)
    run_all(engine)
    for prompt, request, n in zip(prompts, requests, new_tokens):
        assert request.output.generated_tokens == [(prompt[-1] + k) % VOCAB for k in range(1, n + 1)]
    assert [request.output.cached_tokens for request in requests] == [0, 0, 8] and engine.book.evictions == 4
    assert engine.book.free_pages() == engine.book.total_pages


def test_prefix_caching_off_reuses_nothing():
    step = FakeStep()
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=32, prefix_caching=False)
    for name in ("a", "b"):
        engine.add(Request(name, SYSTEM + [1], RequestSettings(max_new_tokens=1)))
    run_all(engine)
    assert engine.prefix_cache.cached_prompt_tokens == 0 and engine.book.cached_pages() == 0


def test_two_groups_place_a_request_where_its_prefix_is_cached():
    step = FakeStep()
    engine = scheduler(step, groups=2, max_slots=4, page_size=4, max_model_len=32)
    engine.add(Request("short filler", [5, 6], RequestSettings(max_new_tokens=20)))
    engine.add(Request("a", SYSTEM + [1], RequestSettings(max_new_tokens=1)))
    engine.step()
    cached_group = next(g for g in range(2) if engine.book.cached_pages(g))
    engine.add(Request("long filler", [7, 8], RequestSettings(max_new_tokens=28)))   # more pages than the short
    engine.step()
    assert engine.book.free_pages(cached_group) < engine.book.free_pages(1 - cached_group)
    follower = Request("b", SYSTEM + [2], RequestSettings(max_new_tokens=1))
    engine.add(follower)
    engine.step()
    assert follower.group == cached_group and follower.output.cached_tokens == 12
    run_all(engine)
    assert follower.output.status == RequestStatus.FINISHED


def test_a_page_size_no_prompt_can_fill_is_refused_when_caching_is_asked_for_and_off_by_default():
    with pytest.raises(ValueError, match=r"page_size=16 with max_model_len=16.*at most 14, or prefix_caching=False"):
        Scheduler(ContinuousBatchingConfig(max_slots=1, page_size=16, max_model_len=16, prefix_caching=True),
                  groups=1, vocab_size=VOCAB, run=FakeStep())
    default = Scheduler(ContinuousBatchingConfig(max_slots=1, page_size=16, max_model_len=16), groups=1,
                        vocab_size=VOCAB, run=FakeStep())
    assert not default.book.caching and not default.prefix_cache.enabled
    assert ContinuousBatchingConfig().caches_prefixes


# ---- on a model: the tokens with prefix caching are the tokens without -----------------------------------------

def conversation_prompts(vocab: int) -> list[list[int]]:
    """Prompts sharing a system prompt of 10 tokens (2 full pages of 4 and half a page), one of them twice."""
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(1, vocab, 10)]
    questions = [[int(t) for t in rng.integers(1, vocab, n)] for n in (3, 6, 1, 3)]
    questions[3] = questions[0]
    return [system + question for question in questions]


def staggered_tokens(model, config: ContinuousBatchingConfig, prompts, new_tokens: int = 12):
    """Each prompt joins 3 steps after the one before (so it finds the earlier prompts' pages cached)."""
    engine = ServingEngine(model, config)
    requests = run_staggered(engine, prompts, RequestSettings(max_new_tokens=new_tokens), stagger=3)
    assert engine.book.free_pages() == engine.book.total_pages
    return [r.output.generated_tokens for r in requests], engine


@pytest.mark.parametrize("layout", representative(
    [None, dict(tp_size=2, fsdp_size=4, ep_size=4), dict(tp_size=2, ep_size=2, dp_replicate_size=2, fsdp_size=2)],
    suite=("one_device",), ids=["one_device", "tp2_fsdp4_ep4", "tp2_ep2_dp2_fsdp2"]))
def test_greedy_tokens_are_the_same_with_and_without_prefix_caching_under_page_pressure(layout):
    """Staggered arrivals, pages of 4, and just the pages two slots need at a time per group: later requests reuse
    cached pages, and idle cached pages are evicted for new ones."""
    model = load("qwen3_moe", layout)
    groups = model.data_parallel_size
    prompts = conversation_prompts(model.config.vocab_size) * groups
    settings = dict(max_slots=2 * groups, page_size=4, max_model_len=32, prefill_chunk=5)
    cached, engine = staggered_tokens(model, ContinuousBatchingConfig(**settings), prompts)
    plain, _ = staggered_tokens(model, ContinuousBatchingConfig(**settings, prefix_caching=False), prompts)
    assert cached == plain
    assert engine.prefix_cache.cached_prompt_tokens >= 8 * len(prompts) // 2 and engine.book.evictions > 0
