"""Speculative decoding: prompt-lookup drafts (host), their acceptance (device: greedy rows exactly plain
decoding's tokens, sampling rows the target distribution, tested statistically), the scheduler's verification
steps (fake step), and on a model the same greedy tokens with and without speculation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.inference import ServingEngine
from moe_jax.inference.requests import ContinuousBatchingConfig, Request, RequestSettings
from moe_jax.inference.sampling import next_tokens_per_row, warp_per_row
from moe_jax.inference.speculative import MAX_SPECULATIVE_TOKENS, accepted_tokens, ngram_drafts
from tests.heavy import representative

from .test_continuous import load
from .test_scheduler import VOCAB, FakeStep, run_all, scheduler


# ---- drafts ------------------------------------------------------------------------------------------------------
def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_tail():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_drafts(context, k=3, ngram_min=1, ngram_max=3) == [7, 8, 5]     # "2 3" latest before the tail
    assert ngram_drafts(context + [7], k=2, ngram_min=2, ngram_max=4) == [8, 5]  # "2 3 7" beats "3 7"
    assert ngram_drafts([4, 5, 6], k=3, ngram_min=1, ngram_max=2) == []
    assert ngram_drafts([5, 5], k=4, ngram_min=1, ngram_max=4) == [5]            # what follows, up to the end
    assert ngram_drafts([6], k=4, ngram_min=1, ngram_max=4) == []


# ---- acceptance on the device --------------------------------------------------------------------------------------
def keys_for(rows: int, length: int, seed: int = 0) -> jax.Array:
    return jax.vmap(lambda r: jax.vmap(lambda j: jax.random.fold_in(jax.random.key(seed), r * 100 + j))(
        jnp.arange(length)))(jnp.arange(rows))


def settings(rows: int, do_sample: bool, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    return (jnp.full(rows, do_sample), jnp.full(rows, temperature, jnp.float32), jnp.full(rows, top_k, jnp.int32),
            jnp.full(rows, top_p, jnp.float32))


def test_greedy_rows_accept_drafts_while_they_equal_the_argmax_then_take_the_argmax():
    vocab = 6
    argmaxes = np.array([[2, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4, 5], [1, 1, 1, 1]])
    logits = jax.nn.one_hot(argmaxes, vocab) * 5.0
    ids = jnp.array([[0, 2, 3, 4], [0, 2, 0, 4], [0, 2, 3, 4], [0, 0, 0, 0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])   # row 2: one draft; row 3: idle
    tokens, counts = accepted_tokens(logits, ids, mask, keys_for(4, 4), *settings(4, False))
    assert counts.tolist() == [4, 2, 2, 1]
    assert tokens[:3].tolist() == [[2, 3, 4, 5], [2, 3, -1, -1], [2, 3, -1, -1]]


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_sampling_rows_keep_the_target_distribution_whatever_the_draft(temperature, top_k):
    """20k rows with the same logits: the first token's frequencies equal the warped target's probabilities and a
    draft is kept with its probability, whether it drafts the likeliest token, an unlikely one, or one the warpers
    drop; the tokens are plain sampling's under the same keys."""
    rows, vocab = 20_000, 5
    base = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0])
    logits = jnp.broadcast_to(base, (rows, 2, vocab))
    target = np.asarray(jax.nn.softmax(warp_per_row(base[None], *settings(1, True, temperature, top_k)[1:])[0]))
    for draft in (0, 3, 4):
        keys = keys_for(rows, 2, draft)
        ids = jnp.broadcast_to(jnp.array([1, draft]), (rows, 2))
        tokens, counts = accepted_tokens(logits, ids, jnp.ones((rows, 2), jnp.int32), keys,
                                         *settings(rows, True, temperature, top_k))
        first = np.asarray(tokens[:, 0])
        frequencies = np.bincount(first, minlength=vocab) / rows
        assert np.abs(frequencies - target).max() < 0.015, (draft, frequencies, target)
        kept = np.asarray(counts) == 2
        assert np.all(first[kept] == draft) and abs(kept.mean() - target[draft]) < 0.015
        plain = next_tokens_per_row(logits[:, 0], keys[:, 0], *settings(rows, True, temperature, top_k))
        assert np.array_equal(first, np.asarray(plain))


# ---- the scheduler's verification steps (fake step) ------------------------------------------------------------
class FakeTarget(FakeStep):
    """The fake step's rule (next = last + 1 mod VOCAB) for verification steps too: drafts accepted while each is
    its predecessor + 1."""

    def __call__(self, kind, inputs):
        if kind != "verify":
            return super().__call__(kind, inputs)
        self.calls.append((kind, {name: values.copy() for name, values in inputs.items()}))
        ids, mask = inputs["ids"], inputs["mask"]
        out = np.full((ids.shape[0], ids.shape[1] + 1), -1, np.int64)
        for row in range(ids.shape[0]):
            accepted = 0
            while accepted + 1 < mask[row].sum() and ids[row, accepted + 1] == (ids[row, accepted] + 1) % VOCAB:
                accepted += 1
            out[row, 1:accepted + 1] = ids[row, 1:accepted + 1]
            out[row, accepted + 1] = (ids[row, accepted] + 1) % VOCAB
            out[row, 0] = accepted + 1
        return out


def test_verification_steps_emit_accepted_drafts_and_stop_at_the_budget():
    step = FakeTarget()
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=64, speculative="ngram",
                       num_speculative_tokens=3, ngram_min=1, ngram_max=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    request = Request("a", prompt, RequestSettings(max_new_tokens=8))
    engine.add(request)
    run_all(engine)
    assert request.output.generated_tokens == [3, 4, 5, 6, 7, 8, 9, 10]
    # After the first token (3): drafts 4 5 6 (after "2 3"), all accepted, and 7; then room for 2: 8 1 (after
    # "6 7"), 8 accepted and 9 instead of 1; then no room left for a draft: a plain decode step (10).
    verify = [inputs for kind, inputs in step.calls if kind == "verify"]
    assert [list(inputs["ids"][0, :int(inputs["mask"][0].sum())]) for inputs in verify] == [[3, 4, 5, 6], [7, 8, 1]]
    assert [kind for kind, _ in step.calls] == ["mixed", "verify", "verify", "decode"]
    assert (engine.draft_tokens, engine.accepted_draft_tokens, engine.acceptance_rate) == (5, 4, 0.8)
    assert engine.book.free_pages() == engine.book.total_pages


def test_a_request_without_drafts_decodes_plainly():
    step = FakeTarget()
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=64, speculative="ngram")
    engine.add(Request("a", [10, 20, 30], RequestSettings(max_new_tokens=3)))
    run_all(engine)
    assert {kind for kind, _ in step.calls} == {"mixed", "decode"} and engine.draft_tokens == 0


@pytest.mark.parametrize("fields,match", [
    (dict(speculative="ngram", num_speculative_tokens=0), r"num_speculative_tokens=0 must be an int in \[1, 16\]"),
    (dict(speculative="ngram", num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1), r"\[1, 16\]"),
    (dict(speculative="ngram", num_speculative_tokens=True), r"num_speculative_tokens=True"),
    (dict(speculative="eagle"), r"speculative='eagle': expected one of \('ngram', 'mtp'\)"),
    (dict(speculative="ngram", ngram_min=3, ngram_max=2), r"1 <= ngram_min <= ngram_max"),
])
def test_bad_speculative_settings_are_refused_by_value(fields, match):
    with pytest.raises(ValueError, match=match):
        ContinuousBatchingConfig(**fields)


# ---- on a model ----------------------------------------------------------------------------------------------------
def repetitive_prompts(vocab: int, groups: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(1, vocab, 7)] * 3 for _ in range(2 * groups)]


@pytest.mark.parametrize("layout", representative(
    [None, dict(tp_size=2, fsdp_size=4, ep_size=4)], suite=("one_device",), ids=["one_device", "tp2_fsdp4_ep4"]))
def test_greedy_tokens_are_plain_decodings_with_ngram_speculation(layout):
    model = load("qwen3_moe", layout)
    prompts = repetitive_prompts(model.config.vocab_size, model.data_parallel_size)
    fields = dict(max_slots=2 * model.data_parallel_size, page_size=4, max_model_len=64, prefill_chunk=8)
    outputs, decode_steps = {}, {}
    for speculative in (None, "ngram"):
        engine = ServingEngine(model, ContinuousBatchingConfig(**fields, speculative=speculative,
                                                               num_speculative_tokens=3))
        requests = [Request(f"r{i}", prompt, RequestSettings(max_new_tokens=24)) for i, prompt in enumerate(prompts)]
        for request in requests:
            engine.add(request)
        run_all(engine)
        outputs[speculative] = [request.output.generated_tokens for request in requests]
        decode_steps[speculative] = engine.steps["decode"] + engine.steps["verify"]
        assert engine.book.free_pages() == engine.book.total_pages
    assert outputs["ngram"] == outputs[None]
    assert engine.steps["verify"] > 0 and engine.accepted_draft_tokens > 0
    assert decode_steps["ngram"] <= decode_steps[None]


@pytest.mark.heavy   # the suite keeps the rejection sampler's statistical tests
def test_sampled_tokens_are_plain_samplings_with_ngram_speculation():
    """A seed draws the same tokens with and without speculation (each output index keyed alike), whatever else is
    batched: two requests of one seed, admitted a step apart (at a temperature low enough that the random model's
    loops are drafted and kept), and one at temperature 1."""
    model = load("qwen3_moe")
    prompt = repetitive_prompts(model.config.vocab_size, 1)[0]
    outputs = {}
    for speculative in (None, "ngram"):
        engine = ServingEngine(model, ContinuousBatchingConfig(max_slots=4, page_size=4, max_model_len=64,
                                                               prefill_chunk=8, speculative=speculative, ngram_min=1,
                                                               num_speculative_tokens=3))
        requests = [Request(f"s{i}", prompt, RequestSettings(max_new_tokens=24, do_sample=True, temperature=t,
                                                             seed=seed))
                    for i, (seed, t) in enumerate([(7, 1e-3), (7, 1e-3), (8, 1.0)])]
        for request in requests:
            engine.add(request)
        run_all(engine)
        outputs[speculative] = [request.output.generated_tokens for request in requests]
    same, again, _ = outputs["ngram"]
    assert outputs["ngram"] == outputs[None] and same == again and engine.accepted_draft_tokens > 0


def test_mtp_speculation_needs_mtp_layers():
    with pytest.raises(ValueError, match="speculative='mtp' drafts with .* does not hold"):
        ServingEngine(load("qwen3_moe"), ContinuousBatchingConfig(speculative="mtp", mixed_steps=False))


def test_generate_with_ngram_speculation_returns_generates_greedy_sequences():
    model = load("qwen3_moe")
    rows = repetitive_prompts(model.config.vocab_size, 1)
    rows[1] = rows[1][:15]                                   # left padding on the shorter row
    width = max(map(len, rows))
    ids = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    for row, prompt in enumerate(rows):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    plain = model.generate(ids, mask, max_new_tokens=12)
    speculated = model.generate(ids, mask, max_new_tokens=12, speculative="ngram", num_speculative_tokens=3)
    assert np.array_equal(np.asarray(plain), speculated)
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        model.generate(ids, mask, max_new_tokens=4, speculative="ngram", num_speculative_tokens=0)


# ---- drafting with a DeepSeek-V3 checkpoint's MTP layers --------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    pytest.importorskip("torch")   # the checkpoint's decoder blocks come from Transformers' (tests/models/mtp_checkpoints.py)
    from tests.models.mtp_checkpoints import write_mtp_checkpoint
    directory = tmp_path_factory.mktemp("mtp") / "checkpoint"
    write_mtp_checkpoint(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, devices=jax.devices()[:1], progress=False)
    assert model.mtp_layers == 2
    return model


@pytest.mark.heavy   # the suite's MTP speculation: generate's, below
def test_mtp_drafts_are_the_mtp_layers_predictions_and_greedy_tokens_are_plain_decodings(mtp_model):
    """Drafts are verified and the greedy tokens are plain decoding's; a request's last drafts are the straight-line
    MTP logits' argmax after its whole sequence (the MTP layer's paged keys and values, written over prefill and
    verification steps, rejected drafts' overwritten, are what a forward pass computes)."""
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(1, mtp_model.config.vocab_size, n)] for n in (9, 5)]
    fields = dict(max_slots=2, page_size=4, max_model_len=48, prefill_chunk=4, mixed_steps=False)
    outputs, engines = {}, {}
    for speculative in (None, "mtp"):
        engine = engines[speculative] = ServingEngine(mtp_model, ContinuousBatchingConfig(
            **fields, speculative=speculative, num_speculative_tokens=3))
        requests = [Request(f"r{i}", prompt, RequestSettings(max_new_tokens=12)) for i, prompt in enumerate(prompts)]
        for request in requests:
            engine.add(request)
        run_all(engine)
        outputs[speculative] = [request.output.generated_tokens for request in requests]
        last_drafts = [request.drafts for request in requests]
    assert outputs["mtp"] == outputs[None]
    assert engines["mtp"].steps["verify"] > 0 and engines["mtp"].draft_tokens > 0
    for prompt, tokens, drafts in zip(prompts, outputs[None], last_drafts):
        sequence = np.asarray([prompt + tokens])
        mtp_logits = np.asarray(mtp_model.apply(mtp_model.params, sequence, return_mtp_logits=True).mtp_logits)
        assert len(drafts) == 3 and drafts[0] == int(np.argmax(mtp_logits[0, 0, sequence.shape[1] - 2]))


def test_generate_with_mtp_speculation_returns_generates_greedy_sequences(mtp_model):
    ids = np.random.default_rng(4).integers(1, mtp_model.config.vocab_size, (1, 7))
    plain = mtp_model.generate(ids, max_new_tokens=8)
    assert np.array_equal(np.asarray(plain), mtp_model.generate(ids, max_new_tokens=8, speculative="mtp",
                                                                num_speculative_tokens=2))


def test_mtp_speculation_needs_separate_prefill_and_decode_programs():
    with pytest.raises(ValueError, match="speculative='mtp' .* mixed_steps=False"):
        ContinuousBatchingConfig(speculative="mtp")
