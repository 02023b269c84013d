"""The logits controls of continuous batching (`RequestSettings`: logprobs / top_logprobs, logit_bias, presence /
frequency / repetition penalties, min_tokens, stop_token_ids), by value: each request's greedy tokens and log
probabilities equal a numpy re-implementation of the same rule applied to the model's own logits (teacher
forced on the tokens the engine produced), whatever else shares its steps, and no request recompiles a program.

One engine (one qwen3_moe fixture, 2 slots, one page width) serves every test of this file."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings, ServingEngine

from .hf_generation import MODELS, NEW_TOKENS
from .test_continuous import fixture_prompts

# Pages of 32 tokens and a context of 32: every step reads one page (one page width: few programs to compile).
CONFIG = ContinuousBatchingConfig(max_slots=2, page_size=32, max_model_len=32, prefill_chunk=4)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODELS / "qwen3_moe", devices=jax.devices()[:1], progress=False)


@pytest.fixture(scope="module")
def engine(model):
    return ServingEngine(model, CONFIG)


def run(engine: ServingEngine, *requests: tuple[list[int], RequestSettings]) -> list[Request]:
    """Run the requests together (all added before the first step) -> them, finished."""
    made = [Request(f"q{i}", list(prompt), settings) for i, (prompt, settings) in enumerate(requests)]
    for request in made:
        engine.add(request)
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    assert all(request.output.is_finished() for request in made)
    return made


def model_logits(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens), V]: the model's logits before each of `tokens` (the prompt, then the tokens before it)."""
    sequence = np.asarray([prompt + tokens[:-1]], np.int32)
    return np.asarray(model.apply(model.params, sequence).logits[0, len(prompt) - 1:], np.float64)


def penalized(logits: np.ndarray, prompt: list[int], generated: list[int], s: RequestSettings) -> np.ndarray:
    """vLLM's rule for one row, in numpy: logit_bias, then repetition (over prompt + generated), frequency and
    presence (over generated)."""
    logits = logits.copy()
    for token, bias in s.logit_bias:
        logits[token] += bias
    counts = np.bincount(np.asarray(generated, np.int64), minlength=logits.size).astype(np.float64)
    seen = counts > 0
    seen[prompt] = True
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / s.repetition_penalty,
                            logits[seen] * s.repetition_penalty)
    return logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)


def reference_greedy(model, prompt: list[int], tokens: list[int], s: RequestSettings) -> list[int]:
    """The greedy token of the penalized logits at each position, teacher forced on `tokens`."""
    logits = model_logits(model, prompt, tokens)
    return [int(np.argmax(penalized(logits[i], prompt, tokens[:i], s))) for i in range(len(tokens))]


def test_penalties_change_greedy_tokens_as_a_numpy_reference_predicts_each_row_by_its_own(model, engine):
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    new = min(NEW_TOKENS, CONFIG.max_model_len - len(prompts[0]))
    plain = RequestSettings(max_new_tokens=new)
    penalties = [RequestSettings(max_new_tokens=new, presence_penalty=1.5, frequency_penalty=0.7),
                 RequestSettings(max_new_tokens=new, repetition_penalty=1.8),
                 RequestSettings(max_new_tokens=new, presence_penalty=-0.5, repetition_penalty=0.6,
                                 frequency_penalty=2.0, logit_bias=((int(greedy[1][0]), 1.5),))]
    compiled = engine.compilations
    # Each penalized request shares its steps with a plain one (slot 1 reused by the next pair: its counts reset).
    for settings in penalties:
        mine, other = run(engine, (prompts[0], settings), (prompts[1], plain))
        tokens = mine.output.generated_tokens
        assert tokens == reference_greedy(model, prompts[0], tokens, settings), settings
        assert tokens != list(greedy[0][:new]), "the penalty changes nothing: the test would prove nothing"
        assert other.output.generated_tokens == list(greedy[1][:new])
        alone, = run(engine, (prompts[0], settings))
        assert alone.output.generated_tokens == tokens
    # The same request in the other slot, beside another penalized one.
    first, second = run(engine, (prompts[2], penalties[1]), (prompts[0], penalties[0]))
    assert second.output.generated_tokens == run(engine, (prompts[0], penalties[0]))[0].output.generated_tokens
    tokens = first.output.generated_tokens
    assert tokens == reference_greedy(model, prompts[2], tokens, penalties[1])
    assert engine.compilations - compiled <= 3   # the first run's programs only: no request recompiles one


def test_greedy_logprobs_equal_log_softmax_of_the_models_logits(model, engine):
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    with_logprobs = RequestSettings(max_new_tokens=8, logprobs=True, top_logprobs=5)
    mine, other = run(engine, (prompts[1], with_logprobs), (prompts[0], RequestSettings(max_new_tokens=8)))
    tokens = mine.output.generated_tokens
    assert tokens == list(greedy[1][:8]) and other.output.generated_tokens == list(greedy[0][:8])
    assert other.output.logprobs == [] and other.output.top_logprobs == []
    logits = model_logits(model, prompts[1], tokens)
    reference = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    np.testing.assert_allclose(mine.output.logprobs, reference[np.arange(len(tokens)), tokens], atol=1e-5)
    assert [len(top) for top in mine.output.top_logprobs] == [5] * len(tokens)
    for i, top in enumerate(mine.output.top_logprobs):
        ids, values = zip(*top)
        assert ids[0] == tokens[i]   # greedy: the chosen token is the likeliest
        np.testing.assert_allclose(values, np.sort(reference[i])[::-1][:5], atol=1e-5)
        np.testing.assert_allclose(values, reference[i][list(ids)], atol=1e-5)
    # Raw log probabilities: a bias changes the token chosen, not the distribution they are reported under.
    forced = RequestSettings(max_new_tokens=3, logprobs=True, logit_bias={7: 100})
    biased, = run(engine, (prompts[1], forced))
    assert biased.output.generated_tokens == [7, 7, 7]
    logits = model_logits(model, prompts[1], [7, 7, 7])
    np.testing.assert_allclose(biased.output.logprobs,
                               [row[7] - np.log(np.exp(row).sum()) for row in logits], atol=1e-5)


def test_logit_bias_forces_and_forbids_tokens(engine):
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    plain = RequestSettings(max_new_tokens=6)
    banned = sorted(set(int(token) for token in greedy[2][:6]))
    forbid = RequestSettings(max_new_tokens=6, logit_bias={token: -100 for token in banned})
    force = RequestSettings(max_new_tokens=6, logit_bias={42: 100.0, int(greedy[2][0]): -3})
    forbidden, forced = run(engine, (prompts[2], forbid), (prompts[2], force))
    assert not set(forbidden.output.generated_tokens) & set(banned)
    assert forced.output.generated_tokens == [42] * 6
    assert run(engine, (prompts[2], plain))[0].output.generated_tokens == list(greedy[2][:6])


def test_min_tokens_holds_back_eos_and_stop_token_ids_end_a_request(engine):
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    expected = [int(token) for token in greedy[0][:10]]
    stop_id = expected[2]
    first = expected.index(stop_id)   # where it first appears (maybe earlier than index 2)
    stopped, eos = run(engine, (prompts[0], RequestSettings(max_new_tokens=10, stop_token_ids=(stop_id,))),
                       (prompts[0], RequestSettings(max_new_tokens=10, eos_token_id=(stop_id,))))
    assert stopped.output.generated_tokens == expected[:first + 1] == eos.output.generated_tokens
    assert stopped.output.finish_reason == "stop"
    held = RequestSettings(max_new_tokens=10, eos_token_id=(stop_id,), min_tokens=6)
    late, = run(engine, (prompts[0], held))
    tokens = late.output.generated_tokens
    assert len(tokens) >= 6 and stop_id not in tokens[:6]
    assert tokens[:first] == expected[:first]   # the same tokens until the stop id was due
    assert late.output.finish_reason == ("stop" if tokens[-1] == stop_id else "length")


def test_settings_are_checked_by_name():
    for bad, message in [(dict(top_logprobs=3), "needs logprobs"), (dict(logprobs=True, top_logprobs=21), "top_logp"),
                         (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
                         (dict(logit_bias={i: 1 for i in range(301)}), "at most 300"),
                         (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=True), "frequ"),
                         (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_tokens=30), "min_tokens"),
                         (dict(stop_token_ids=(-2,)), "stop_token_ids"), (dict(logprobs=1), "logprobs")]:
        with pytest.raises(ValueError, match=message):
            RequestSettings(max_new_tokens=20, **bad)


def test_token_ids_outside_the_vocabulary_are_refused_when_added(engine):
    vocab = engine.vocab_size
    for settings in (RequestSettings(logit_bias={vocab: 1.0}), RequestSettings(stop_token_ids=(vocab,))):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.check(Request("bad", [1, 2], settings))
