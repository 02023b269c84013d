"""Continuous batching (`ServingEngine`, `ContinuousBatchingManager`, `model.generate_batch`) against
Transformers' `generate` (the committed fixtures) and our own `generate`: requests that arrive at different
times, with different lengths, on one device and on TP/EP layouts; the fixed programs; pages and slots coming
back; per-request sampling; errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.inference import (
    ContinuousBatchingConfig,
    GenerationConfig,
    Request,
    RequestSettings,
    RequestStatus,
    Sampling,
    ServingEngine,
    warp,
    warp_per_row,
)
from moe_jax.inference.manager import request_settings
from tests.heavy import representative
from tests.models.test_apply import count_compilations

from .hf_generation import FIXTURES, MODELS, NEW_TOKENS

SMALL = ContinuousBatchingConfig(max_slots=2, page_size=4, max_model_len=64, prefill_chunk=3)


def load(model_type: str, layout: dict | None = None):
    return AutoModelForCausalLM.from_pretrained(
        MODELS / model_type, None if layout is None else DistributedConfig(**layout),
        devices=jax.devices()[:1] if layout is None else None, progress=False)


def fixture_prompts(model_type: str) -> tuple[list[list[int]], np.ndarray, dict]:
    """The fixture's three prompts without their left padding (7, 4 and 2 tokens) and HF's greedy new tokens."""
    expected = dict(np.load(FIXTURES / f"{model_type}.npz"))
    ids, mask = expected["input_ids"], expected["attention_mask"]
    prompts = [[int(t) for t, m in zip(ids[row], mask[row]) if m] for row in range(ids.shape[0])]
    return prompts, expected["greedy"][:, ids.shape[1]:], expected


def run_staggered(engine: ServingEngine, prompts, settings: RequestSettings, stagger: int = 3) -> list[Request]:
    """Request i joins after i * stagger engine steps (so later prompts prefill while earlier ones decode)."""
    requests = [Request(f"r{i}", prompt, settings) for i, prompt in enumerate(prompts)]
    step = 0
    while step == 0 or engine.has_work() or requests[-1].output.status == RequestStatus.PENDING:
        for i, request in enumerate(requests):
            if i * stagger == step:
                engine.add(request)
        engine.step()
        step += 1
    return requests


# One family per attention kind (RoPE + per-head norms, sinks + sliding windows, latent pages, chunks + NoPE);
# every family on one device and five layouts: scripts/checks/check_serving_layouts.py (39 cases).
ATTENTION_KIND_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3", "llama4_text")


# The suite runs gpt-oss (sinks and sliding windows of 4-5 crossing pages of 4); DeepSeek's latent pages are in
# the 8-device test below.
@pytest.mark.parametrize("model_type", representative(ATTENTION_KIND_FAMILIES, suite=()))
def test_greedy_tokens_equal_transformers_when_requests_arrive_at_different_times(model_type):
    """2 slots for 3 requests (the third waits for a free slot), prompts prefilled in chunks of 3 across steps,
    pages of 4 tokens (sliding windows of 4-5 and Llama 4's chunks of 4 cross page boundaries)."""
    prompts, greedy, _ = fixture_prompts(model_type)
    engine = ServingEngine(load(model_type), SMALL)
    requests = run_staggered(engine, prompts, RequestSettings(max_new_tokens=NEW_TOKENS))
    for request, expected in zip(requests, greedy):
        assert request.output.generated_tokens == list(expected), request.request_id
        assert request.output.finish_reason == "length"
    assert engine.book.free_pages() == engine.book.total_pages
    # Steps that prefill also decode (one program of 1 prompt row + 2 slots); steps that only decode, in 2 rows
    # while both slots decode and in 1 row once one request is left.
    assert {(name, shape) for name, shape, _ in engine.compiled_shapes} == {
        ("decode", (2, 1)), ("decode", (1, 1)), ("mixed", (3, 3))}
    assert {width for _, _, width in engine.compiled_shapes} <= set(engine.page_widths)
    assert engine.steps["prefill"] == 0 and engine.steps["mixed"] > 0


def test_a_prompt_fills_several_rows_of_one_step_and_the_next_prompt_the_rest():
    """Prefill rows of 2 tokens, 3 a step: the 7-token prompt takes 3 rows in its first step (its rows see each
    other's tokens, stored before any row attends), and its last token shares a step with the next prompt's
    first two pieces; every request's greedy tokens are still Transformers'."""
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    config = ContinuousBatchingConfig(max_slots=3, page_size=4, max_model_len=64, prefill_chunk=2, prefill_rows=3)
    engine = ServingEngine(load("qwen3_moe"), config)
    requests = [Request(f"r{i}", prompt, RequestSettings(max_new_tokens=NEW_TOKENS)) for i, prompt in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    engine.step()
    assert [r.prefilled for r in requests] == [6, 0, 0]
    engine.step()
    assert [r.prefilled for r in requests] == [7, 4, 0] and requests[0].output.generated_tokens == [greedy[0][0]]
    while engine.has_work():
        engine.step()
    assert [r.output.generated_tokens for r in requests] == [list(row) for row in greedy]
    assert engine.book.free_pages() == engine.book.total_pages
    # The 2-token prompt's step ran the 1-prompt-row program (1 + 3 slots), not 3 rows of padding.
    assert engine.mixed_prompt_rows == [1, 2, 3]
    assert {shape for name, shape, _ in engine.compiled_shapes if name == "mixed"} == {(6, 2), (4, 2)}


# One 8-device layout here (4 data-parallel groups, each its own pool; latent pages; token dispatch); every family on
# a representative layout of each mesh shape, or the whole grid: scripts/checks/check_serving_layouts.py.
@pytest.mark.parametrize("model_type,layout", [("deepseek_v3", dict(tp_size=2, fsdp_size=4, ep_size=4))])
def test_greedy_tokens_equal_transformers_on_8_devices(model_type, layout):
    prompts, greedy, _ = fixture_prompts(model_type)
    model = load(model_type, layout)
    config = ContinuousBatchingConfig(max_slots=model.data_parallel_size, page_size=4, max_model_len=64,
                                      prefill_chunk=3)
    engine = ServingEngine(model, config)
    requests = run_staggered(engine, prompts, RequestSettings(max_new_tokens=NEW_TOKENS), stagger=2)
    assert [r.output.generated_tokens for r in requests] == [list(row) for row in greedy]
    assert engine.book.free_pages() == engine.book.total_pages


def test_decode_steps_pack_the_decoding_requests_into_the_fewest_rows():
    """5 slots; the 3 prompts decode together in a program of 5 rows, and the last one left in a program of 1 row
    (the default rows: 5 and its quarter), with Transformers' greedy tokens all along."""
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    config = ContinuousBatchingConfig(max_slots=5, page_size=4, max_model_len=64, prefill_chunk=8)
    engine = ServingEngine(load("qwen3_moe"), config)
    assert engine.decode_row_counts == [1, 5]
    settings = [RequestSettings(max_new_tokens=n) for n in (NEW_TOKENS, 2, 3)]
    requests = [Request(f"d{i}", prompt, setting) for i, (prompt, setting) in enumerate(zip(prompts, settings))]
    for request in requests:
        engine.add(request)
    while engine.has_work():
        engine.step()
    for request, expected, setting in zip(requests, greedy, settings):
        assert request.output.generated_tokens == list(expected[:setting.max_new_tokens])
    assert {shape for name, shape, _ in engine.compiled_shapes if name == "decode"} == {(5, 1), (1, 1)}


@pytest.mark.parametrize("rows", [(0,), (3, 9), (2.5,)])
def test_decode_rows_outside_the_slots_are_refused_by_value(rows):
    with pytest.raises(ValueError, match=r"decode_rows=.*in \[1, 4\]"):
        ServingEngine(load("qwen3_moe"), ContinuousBatchingConfig(max_slots=4, page_size=4, max_model_len=64,
                                                                  decode_rows=rows))


def test_eos_ends_a_request_and_its_slot_serves_the_next():
    prompts, _, expected = fixture_prompts("olmoe")
    eos = int(expected["eos_token_id"])
    engine = ServingEngine(load("olmoe"), SMALL)
    requests = run_staggered(engine, prompts, RequestSettings(max_new_tokens=NEW_TOKENS, eos_token_id=(eos,)))
    width = expected["input_ids"].shape[1]
    for request, row in zip(requests, expected["with_eos"]):
        new = list(row[width:])
        if eos in new:   # HF pads after the EOS; ours stops with it
            assert request.output.generated_tokens == new[:new.index(eos) + 1]
            assert request.output.finish_reason == "stop"
        else:
            assert request.output.generated_tokens == new


def test_nothing_recompiles_as_requests_come_and_go():
    model = load("qwen3_moe")
    engine = ServingEngine(model, ContinuousBatchingConfig(max_slots=2, page_size=16, max_model_len=64,
                                                           prefill_chunk=3))
    rng = np.random.default_rng(0)
    assert engine.decode_row_counts == [1, 2]
    assert engine.compile_all() == 3 * len(engine.page_widths)     # mixed, decode of 2 rows and of 1
    prompts = [list(rng.integers(3, 100, n)) for n in (1, 9, 4, 17, 2)]
    with count_compilations("_step_math") as count:
        settings = [RequestSettings(max_new_tokens=int(n), do_sample=bool(n % 2), temperature=0.8, top_k=int(n),
                                    seed=int(n)) for n in (3, 7, 1, 5, 2)]
        for i, (prompt, setting) in enumerate(zip(prompts, settings)):
            engine.add(Request(f"x{i}", [int(t) for t in prompt], setting))
        while engine.has_work():
            engine.step()
    assert count[0] == 0


def test_requests_wait_for_pages_and_every_page_comes_back():
    """Pages for one slot at max_model_len and two slots: the second request waits until the first frees
    its pages, then gets the same greedy tokens it gets alone. (Separate prefill and decode programs here,
    `mixed_steps=False`: the other tests run mixed steps.)"""
    prompts, greedy, _ = fixture_prompts("mixtral")
    config = ContinuousBatchingConfig(max_slots=2, page_size=4, max_model_len=32, num_pages=8, prefill_chunk=4,
                                      mixed_steps=False)
    engine = ServingEngine(load("mixtral"), config)
    first, second = (Request(f"p{i}", prompts[i], RequestSettings(max_new_tokens=NEW_TOKENS)) for i in (0, 1))
    engine.add(first)
    engine.add(second)
    engine.step()
    assert first.output.status == RequestStatus.PREFILLING and second.output.status == RequestStatus.PENDING
    assert engine.book.free_pages() == 1      # 7 + 20 tokens take 7 of the 8 pages
    while engine.has_work():
        engine.step()
    assert first.output.generated_tokens == list(greedy[0]) and second.output.generated_tokens == list(greedy[1])
    assert engine.book.free_pages() == engine.book.total_pages
    assert {name for name, _, _ in engine.compiled_shapes} == {"prefill", "decode"} and engine.steps["mixed"] == 0


def test_cancel_frees_the_slot_and_pages_at_once():
    engine = ServingEngine(load("qwen3_moe"), SMALL)
    request = Request("c", [4, 5, 6, 7], RequestSettings(max_new_tokens=40))
    engine.add(request)
    for _ in range(4):
        engine.step()
    assert engine.slots_in_use == 1 and engine.book.free_pages() < engine.book.total_pages
    assert engine.cancel("c") is request
    assert request.output.finish_reason == "cancelled" and request.output.is_finished()
    assert engine.slots_in_use == 0 and engine.book.free_pages() == engine.book.total_pages
    assert not engine.has_work() and engine.cancel("c") is None


# heavy: the suite's draws by value (test_sampled_tokens_are_draws_...) already fix each token to the request's
# own seed and token index, whatever batch it shares
@pytest.mark.heavy
def test_a_request_samples_the_same_tokens_whatever_else_runs():
    """Draws come from the request's own seed and token index, not from the batch it shares."""
    engine = ServingEngine(load("olmoe"), SMALL)
    sampled = RequestSettings(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=0, seed=7)
    alone = run_staggered(engine, [[9, 8, 7, 6]], sampled)[0].output.generated_tokens
    together = run_staggered(engine, [[3, 4, 5], [9, 8, 7, 6]], sampled, stagger=1)[1].output.generated_tokens
    assert alone == together
    other_seed = RequestSettings(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=0, seed=8)
    assert run_staggered(engine, [[9, 8, 7, 6]], other_seed)[0].output.generated_tokens != alone
    prompts, greedy, _ = fixture_prompts("olmoe")
    top_1 = run_staggered(engine, prompts[:1], RequestSettings(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1))
    assert top_1[0].output.generated_tokens == list(greedy[0])


def test_per_row_warpers_equal_transformers_order_warpers():
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
    rows = [Sampling(True, 0.7, 5, 1.0), Sampling(True, 1.3, 0, 0.8), Sampling(True, 1.0, 12, 0.5),
            Sampling(True, 2.0, None, 1.0)]
    per_row = warp_per_row(logits, jnp.asarray([s.temperature for s in rows]),
                           jnp.asarray([s.top_k or 0 for s in rows]), jnp.asarray([s.top_p for s in rows]))
    for row, sampling in enumerate(rows):
        np.testing.assert_allclose(per_row[row], warp(logits[row:row + 1], sampling)[0], rtol=1e-6)


def test_stop_strings_end_a_request():
    decode = lambda ids: " ".join(str(i) for i in ids)  # noqa: E731 - a stand-in tokenizer
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    engine = ServingEngine(load("qwen3_moe"), SMALL, decode=decode)
    stop = f"{greedy[0][2]} {greedy[0][3]}"
    request = run_staggered(engine, prompts[:1], RequestSettings(max_new_tokens=NEW_TOKENS, stop=(stop,)))[0]
    assert request.output.generated_tokens == list(greedy[0][:4]) and request.output.finish_reason == "stop"


def test_bad_requests_and_configs_raise_before_anything_runs():
    model = load("qwen3_moe")
    engine = ServingEngine(model, SMALL)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add(Request("long", list(range(3, 67)), RequestSettings()))
    with pytest.raises(ValueError, match="empty"):
        engine.add(Request("empty", [], RequestSettings()))
    with pytest.raises(ValueError, match=r"must be in \[0, 128\)"):
        engine.add(Request("vocab", [1, 500], RequestSettings()))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add(Request("stop", [1, 2], RequestSettings(stop=("x",))))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        RequestSettings(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        RequestSettings(do_sample=True, top_p=1.5)
    engine.add(Request("same", [1, 2], RequestSettings()))
    with pytest.raises(ValueError, match="already in use"):
        engine.add(Request("same", [3, 4], RequestSettings()))
    assert len(engine.waiting) == 1
    sharded = load("qwen3_moe", dict(tp_size=2, ep_size=2, fsdp_size=4))
    with pytest.raises(ValueError, match="max_slots=2 must be a positive multiple of the layout's 4"):
        ServingEngine(sharded, SMALL)
    with pytest.raises(ValueError, match="num_pages=4"):
        ServingEngine(model, ContinuousBatchingConfig(max_slots=2, page_size=4, max_model_len=64, num_pages=4))


def test_manager_streams_tokens_and_delivers_results():
    model = load("qwen3_moe")
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    with model.init_continuous_batching(max_slots=2, page_size=4, max_model_len=64) as manager:
        streamed = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, streaming=True)
        whole = manager.add_request(prompts[1], max_new_tokens=NEW_TOKENS)
        cancelled = manager.add_request(prompts[2], max_new_tokens=500 - len(prompts[2]) - 450)
        manager.cancel_request(cancelled)
        outputs = list(manager.request_id_iter(streamed))
        assert [len(o.generated_tokens) for o in outputs] == list(range(1, NEW_TOKENS + 1))
        assert outputs[-1].generated_tokens == list(greedy[0]) and outputs[-1].is_finished()
        assert len(outputs[-1].timestamps) == NEW_TOKENS and outputs[-1].time_to_first_token > 0
        result = manager.get_result(whole, timeout=60)
        assert result.generated_tokens == list(greedy[1]) and result.finish_reason == "length"
        assert manager.get_result(cancelled, timeout=60).status == RequestStatus.FINISHED
        with pytest.raises(ValueError, match="max_model_len"):
            manager.add_request(list(range(3, 100)))
        metrics = manager.metrics()
        assert metrics["slots_in_use"] == 0 and metrics["pages_free"] == metrics["pages_total"]
        assert metrics["compiled_programs"] <= 3 * len(manager.engine.page_widths)
    assert not manager.is_running()


def test_generate_batch_gives_each_prompt_transformers_tokens_in_order():
    """(`generate` gives the same tokens: tests/inference/test_generate.py holds it to the same fixture.)"""
    model = load("gpt_oss")
    prompts, greedy, _ = fixture_prompts("gpt_oss")
    outputs = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS)
    assert list(outputs) == ["req_0", "req_1", "req_2"]
    for output, prompt, expected in zip(outputs.values(), prompts, greedy):
        assert output.prompt_ids == prompt and output.generated_tokens == list(expected)
    assert model.generate_batch([]) == {}


def finish(engine: ServingEngine, limit: int = 200) -> None:
    """Step until no request is left; a request that never finishes (waiting for pages that cannot come) fails
    the test instead of hanging it."""
    for _ in range(limit):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError(f"still {len(engine.waiting)} waiting and {engine.slots_in_use} running after {limit} steps")


def reference_draws(model, prompt: list[int], tokens: list[int], settings: RequestSettings) -> list[int]:
    """What a request sampling with `settings` draws after `prompt`, each token from the logits `model.apply` gives
    its position (the request's own tokens before it): token i is categorical(fold_in(key(seed), i), the logits
    warped by Transformers' order of temperature, top-k, top-p)."""
    sequence = np.asarray([prompt + tokens[:-1]], np.int32)
    logits = model.apply(model.params, sequence).logits[0, len(prompt) - 1:]
    warped = warp(logits, Sampling(True, settings.temperature, settings.top_k, settings.top_p))
    base = jax.random.key(settings.seed)
    return [int(jax.random.categorical(jax.random.fold_in(base, i), warped[i])) for i in range(len(tokens))]


def test_sampled_tokens_are_draws_of_the_warped_logits_keyed_by_seed_and_token_index():
    """By value, not by self-consistency: each sampled token equals the draw computed from the model's logits
    with the request's own temperature, top-k, top-p and key. The two requests differ in every setting (and
    their temperature is not their top_p), so a setting read from the wrong place, or a key that does not move
    with the generated-token count, changes the draws."""
    model = load("qwen3_moe")
    engine = ServingEngine(model, SMALL)
    settings = [RequestSettings(max_new_tokens=12, do_sample=True, temperature=0.6, top_k=20, top_p=0.85, seed=11),
                RequestSettings(max_new_tokens=12, do_sample=True, temperature=1.3, top_k=0, top_p=0.7, seed=5)]
    requests = [Request("a", [9, 8, 7, 6, 5], settings[0]), Request("b", [3, 4, 5], settings[1])]
    for request in requests:
        engine.add(request)
    finish(engine)
    for request in requests:
        tokens = request.output.generated_tokens
        assert len(tokens) == 12
        assert tokens == reference_draws(model, request.prompt_ids, tokens, request.settings), request.request_id


def test_a_request_asking_for_more_than_the_context_gets_transformers_tokens_up_to_the_context_end():
    """max_model_len 13 with pages of 5 (3 pages, the last partly used) and requests asking for 50 tokens: each
    generates exactly to the context's end (HF's greedy tokens for that many), finishes with "length", and one
    slot serves both in turn with every page back at the end."""
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    config = ContinuousBatchingConfig(max_slots=1, page_size=5, max_model_len=13, prefill_chunk=4)
    engine = ServingEngine(load("qwen3_moe"), config)
    requests = [Request(f"long{i}", prompts[i], RequestSettings(max_new_tokens=50)) for i in (0, 1)]
    for request in requests:
        engine.add(request)
    finish(engine)
    for request, expected in zip(requests, greedy):
        room = config.max_model_len - len(request.prompt_ids)
        assert request.output.generated_tokens == list(expected[:room]), request.request_id
        assert request.output.finish_reason == "length"
    assert engine.pages_per_slot == 3 and engine.book.free_pages() == engine.book.total_pages == 3


def test_a_request_needing_every_free_page_is_admitted_at_once():
    """One slot and 4 pages; a 4-token prompt with 12 new tokens fills all 4: it is admitted in the first step
    (waiting for more than exactly the free pages would wait forever) and gets HF's greedy tokens."""
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    config = ContinuousBatchingConfig(max_slots=1, page_size=4, max_model_len=16, prefill_chunk=8)
    engine = ServingEngine(load("qwen3_moe"), config)
    request = Request("all", prompts[1], RequestSettings(max_new_tokens=16 - len(prompts[1])))
    engine.add(request)
    engine.step()
    assert request.output.status != RequestStatus.PENDING and engine.book.free_pages() == 0
    finish(engine)
    assert request.output.generated_tokens == list(greedy[1][:12]) and request.output.finish_reason == "length"
    assert engine.book.free_pages() == engine.book.total_pages


def test_request_settings_keep_eos_id_0_and_drop_transformers_minus_1():
    """-1 is Transformers' "no EOS"; 0 is a token id like any other."""
    config = GenerationConfig(eos_token_id=(0, -1, 5))
    assert request_settings(config, 4).eos_token_id == (0, 5)
    assert request_settings(config, 4, eos_token_id=0).eos_token_id == (0,)
    assert request_settings(config, 4, eos_token_id=-1).eos_token_id == ()


def test_an_eos_id_of_0_ends_a_request():
    """The model's vocabulary permuted so that the token its greedy decoding emits 4th is id 0 (its embedding and
    head rows swapped with id 0's): with eos_token_id=0, the request ends with that token, as HF's greedy tokens
    mapped through the same permutation say."""
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    model = load("qwen3_moe")
    swap = np.arange(model.config.vocab_size)
    chosen = int(greedy[0][3])
    swap[[0, chosen]] = swap[[chosen, 0]]
    params = {name: np.asarray(value) for name, value in model.hf_params().items()}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        params[name] = params[name][swap]
    model.set_params(params)
    expected = [int(swap[token]) for token in greedy[0]]
    expected = expected[:expected.index(0) + 1]
    output = model.generate_batch([[int(swap[t]) for t in prompts[0]]], max_new_tokens=NEW_TOKENS,
                                  eos_token_id=0)["req_0"]
    assert output.generated_tokens == expected and output.finish_reason == "stop"
