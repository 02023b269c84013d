"""Routing out of the sampler (`return_routing`): the expert ids the engine's steps and `generate` record for every
token they read equal a full forward's (`apply(..., return_routing=True)`) on the prompt and generated tokens,
through chunked prefill, mixed steps, speculative verification (accepted drafts only) and a prefix cache that a
recording request does not read; the last token's row is -1. One device and an EP layout; greedy, fp32."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings

from .test_continuous import fixture_prompts, load

CONFIG = ContinuousBatchingConfig(max_slots=2, page_size=4, max_model_len=64, prefill_chunk=3)


@pytest.fixture(scope="module")
def model():
    return load("qwen3_moe")


def forward_routing(model, tokens: list[int]) -> np.ndarray:
    """[L, N, K]: a full forward's routing of `tokens` (the row repeated over the data-parallel groups)."""
    rows = np.tile(np.asarray(tokens), (model.data_parallel_size, 1))
    return np.asarray(model.apply(model.params, rows, return_routing=True).routing[0])


def assert_replayable(model, output) -> None:
    """`output.routing` is the forward's at every token the model read, -1 at the last."""
    tokens = output.prompt_ids + output.generated_tokens
    routing = output.routing
    assert routing.dtype == np.int16 and routing.shape == (len(model.sparse_layers()), len(tokens),
                                                           model.config.num_experts_per_tok)
    np.testing.assert_array_equal(routing[:, :-1], forward_routing(model, tokens)[:, :-1])
    assert (routing[:, -1] == -1).all()


@pytest.mark.heavy   # the suite's routing records: generate's and the ep layout's below
def test_generate_batch_records_every_read_token_through_chunks_and_mixed_steps(model):
    prompts, _, _ = fixture_prompts("qwen3_moe")   # 7, 4 and 2 tokens: chunks of 3; the third waits for a slot
    outputs = model.generate_batch(prompts, continuous_batching_config=CONFIG, max_new_tokens=5,
                                   return_routing=True)
    for output in outputs.values():
        assert_replayable(model, output)


@pytest.mark.heavy
def test_only_recording_requests_get_routing_and_they_bypass_the_prefix_cache(model):
    prompts, _, _ = fixture_prompts("qwen3_moe")
    engine = model.continuous_batching_engine(CONFIG)
    prompt = prompts[0] + prompts[1]   # 11 tokens: two full pages before its last token
    first = Request("plain", prompt, RequestSettings(max_new_tokens=3))
    engine.add(first)
    while engine.has_work():
        engine.step()
    recording = Request("recording", prompt, RequestSettings(max_new_tokens=4, return_routing=True))
    other = Request("other", prompt, RequestSettings(max_new_tokens=4))
    engine.add(recording)
    engine.add(other)
    while engine.has_work():
        engine.step()
    assert first.output.routing is None and other.output.routing is None
    assert recording.output.cached_tokens == 0 and other.output.cached_tokens == 8
    assert_replayable(model, recording.output)
    assert other.output.generated_tokens == recording.output.generated_tokens
    plain = model.continuous_batching_engine(ContinuousBatchingConfig(max_slots=2, page_size=4, max_model_len=32,
                                                                      prefill_chunk=3))
    plain.add(Request("p", prompts[2], RequestSettings(max_new_tokens=2)))
    while plain.has_work():
        plain.step()
    assert not any(name.endswith("+routing") for name, _, _ in plain.compiled_shapes)   # nothing to pay for


@pytest.mark.heavy
def test_verification_steps_record_the_accepted_drafts_only(model):
    prompts, _, _ = fixture_prompts("qwen3_moe")
    config = ContinuousBatchingConfig(max_slots=2, page_size=4, max_model_len=64, prefill_chunk=4,
                                      mixed_steps=False, speculative="ngram", num_speculative_tokens=3)
    # The first prompt's greedy tokens repeat a bigram, so prompt lookup drafts, some accepted, some not.
    outputs = model.generate_batch([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], prompts[0]], continuous_batching_config=config,
                                   max_new_tokens=24, return_routing=True)
    engine = model._batch_engine
    assert engine.steps["verify"] > 0 and 0 < engine.accepted_draft_tokens < engine.draft_tokens
    for output in outputs.values():
        assert_replayable(model, output)


def test_generate_returns_routing_aligned_with_its_left_padded_sequences(model):
    _, _, expected = fixture_prompts("qwen3_moe")
    ids, mask = expected["input_ids"], expected["attention_mask"]
    sequences, routing = model.generate(ids, mask, max_new_tokens=4, return_routing=True)
    assert routing.shape == (ids.shape[0], len(model.sparse_layers()), sequences.shape[1],
                             model.config.num_experts_per_tok)
    for row in range(ids.shape[0]):
        real = np.concatenate([mask[row] > 0, np.ones(sequences.shape[1] - ids.shape[1], bool)])
        recorded = routing[row][:, real]
        np.testing.assert_array_equal(recorded[:, :-1], forward_routing(model, list(sequences[row][real]))[:, :-1])
        assert (recorded[:, -1] == -1).all() and (routing[row][:, ~real] == -1).all()
    speculative = model.generate(ids, mask, max_new_tokens=4, return_routing=True, speculative="ngram")
    np.testing.assert_array_equal(speculative[0], sequences)
    np.testing.assert_array_equal(speculative[1], routing)   # through continuous batching, the same array


# heavy: the suite's RL agreement (tests/rl/test_logprob_agreement.py) replays what the engine recorded on
# tp2/fsdp4/ep2 and gets the sampler's logprobs
@pytest.mark.heavy
def test_an_ep_layout_records_the_forwards_routing():
    sharded = load("qwen3_moe", dict(tp_size=2, ep_size=2, fsdp_size=4))
    prompts, _, _ = fixture_prompts("qwen3_moe")
    config = ContinuousBatchingConfig(max_slots=4, page_size=4, max_model_len=32, prefill_chunk=3)  # 4 dp groups
    outputs = sharded.generate_batch(prompts[:2], continuous_batching_config=config, max_new_tokens=4,
                                     return_routing=True)
    for output in outputs.values():
        assert_replayable(sharded, output)
