"""`model.generate` against Transformers' `generate` (committed fixtures; live with torch), on one device and
on 8-device layouts; compilation count and host transfers of decoding; batching; sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.inference import init_cache
from moe_jax.inference.sampling import Sampling, warp
from tests.heavy import representative
from tests.models.test_apply import count_compilations, jit_names

from .hf_generation import FAMILIES, FIXTURES, MODELS, NEW_TOKENS, hf_generate

# tp = ep (the masked all_reduce path under auto) and tp < ep (token dispatch); every layout x
# implementation, FSDP alone included: scripts/checks/check_generate_layouts.py.
LAYOUTS = {
    "tp2_ep2_fsdp4": dict(tp_size=2, ep_size=2, fsdp_size=4),
    "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4),
}


def load(model_type: str, layout: dict | None = None):
    return AutoModelForCausalLM.from_pretrained(
        MODELS / model_type, None if layout is None else DistributedConfig(**layout),
        devices=jax.devices()[:1] if layout is None else None, progress=False)


def fixture(model_type: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / f"{model_type}.npz"))


@pytest.fixture(scope="module")
def one_device():
    cache = {}

    def get(model_type):
        if model_type not in cache:
            cache[model_type] = load(model_type)
        return cache[model_type]

    return get


# In the suite: one family per attention kind (the others: heavy, and scripts/checks/check_generate_layouts.py).
@pytest.mark.parametrize("model_type", representative(
    FAMILIES, suite=("qwen3_moe", "gpt_oss", "deepseek_v3", "llama4_text")))
def test_greedy_tokens_equal_transformers_and_stop_at_eos(one_device, model_type):
    model, expected = one_device(model_type), fixture(model_type)
    prompt = expected["input_ids"], expected["attention_mask"]
    np.testing.assert_array_equal(model.generate(*prompt, max_new_tokens=NEW_TOKENS), expected["greedy"])
    with_eos = model.generate(*prompt, max_new_tokens=NEW_TOKENS, eos_token_id=int(expected["eos_token_id"]),
                              pad_token_id=0)
    np.testing.assert_array_equal(with_eos, expected["with_eos"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_tokens_equal_transformers_on_8_devices(layout):
    """Three rows on 4-8 data-parallel groups: the batch is smaller than the data-parallel size."""
    model, expected = load("qwen3_moe", LAYOUTS[layout]), fixture("qwen3_moe")
    sequences = model.generate(expected["input_ids"], expected["attention_mask"], max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(sequences, expected["greedy"])


@pytest.mark.reference
def test_greedy_tokens_equal_live_transformers(one_device):
    pytest.importorskip("torch")
    live = hf_generate("olmoe")
    model = one_device("olmoe")
    np.testing.assert_array_equal(model.generate(live["input_ids"], live["attention_mask"],
                                                 max_new_tokens=NEW_TOKENS), live["greedy"])


def test_decode_compiles_once_and_reads_only_the_new_tokens(one_device):
    model, expected = one_device("qwen3_moe"), fixture("qwen3_moe")
    prompt = expected["input_ids"], expected["attention_mask"]
    model.generate(*prompt, max_new_tokens=NEW_TOKENS)      # prefill and decode programs exist now
    seen = []
    with count_compilations() as count, jax.transfer_guard_device_to_host("disallow"):
        # A prompt of another length in the same bucket, and a longer generation in the same cache bucket.
        sequences = model.generate(prompt[0][:, 1:], prompt[1][:, 1:], max_new_tokens=NEW_TOKENS + 4,
                                   streamer=lambda step, ids: seen.append(ids))
    assert count[0] == 0
    assert len(seen) == NEW_TOKENS + 4 and sequences.shape == (3, 6 + NEW_TOKENS + 4)
    np.testing.assert_array_equal(np.stack(seen, axis=1), sequences[:, 6:])


def test_prefill_and_decode_trace_the_model_s_step_into_their_own_jit(one_device):
    """Each program owns its one jit (the cache donated): the model's step is traced into it, not called as
    `model.apply`'s nested jit; `apply`'s checks run at `generate`'s call instead."""
    model, expected = one_device("qwen3_moe"), fixture("qwen3_moe")
    ids, mask = expected["input_ids"], expected["attention_mask"]
    rows = ids.shape[0]
    key, eos, sampling = jax.random.key(0), jnp.asarray([-1], jnp.int32), Sampling()
    weights = (model.params, None, None)   # (params, the LoRA adapter's arrays, the expert placement: none here)
    prefill = model.generator.jitted("prefill", sampling).trace(
        weights, ids, mask, init_cache(model, rows, 16), key, eos)
    tokens, positions = jnp.zeros(rows, jnp.int32), jnp.full(rows, ids.shape[1], jnp.int32)
    decode = model.generator.jitted("decode", sampling).trace(
        weights, tokens, positions, init_cache(model, rows, 16), jnp.zeros(rows, bool), key, eos,
        jnp.asarray(0, jnp.int32))
    for traced in (prefill, decode):
        assert "step_math" not in jit_names(traced.jaxpr.jaxpr)
    params = {name: value for name, value in model.params.items() if name != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"params do not have this model's storage layout: missing \['lm_head"):
        model.generate(ids, mask, max_new_tokens=2, params=params)


def test_a_padded_row_of_a_batch_equals_its_prompt_alone(one_device):
    """Row 2 has 5 padding tokens before its 2 real ones; alone it has none (and another prompt bucket)."""
    model, expected = one_device("mixtral"), fixture("mixtral")
    alone = model.generate(expected["input_ids"][2:, 5:], max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(alone[0, 2:], expected["greedy"][2, 7:])


def test_sampling_is_reproducible_and_top_k_1_is_greedy(one_device):
    model, expected = one_device("olmoe"), fixture("olmoe")
    prompt = expected["input_ids"], expected["attention_mask"]
    sample = lambda seed, **kw: model.generate(*prompt, max_new_tokens=12, do_sample=True, seed=seed, **kw)  # noqa: E731
    first = sample(1, temperature=1.5, top_k=0)
    np.testing.assert_array_equal(first, sample(1, temperature=1.5, top_k=0))
    assert not np.array_equal(first, sample(2, temperature=1.5, top_k=0))
    np.testing.assert_array_equal(sample(3, top_k=1), expected["greedy"][:, :7 + 12])


def test_sampled_tokens_are_draws_of_the_warped_logits_keyed_by_seed_and_step(one_device):
    """By value: the first new token is categorical(key(seed), warp(logits)), token i after it draws with
    fold_in(key(seed), i), each from the logits `model.apply` gives its position."""
    model, expected = one_device("olmoe"), fixture("olmoe")
    prompt = expected["input_ids"][:1]
    sampling = Sampling(True, temperature=0.7, top_k=12, top_p=0.9)
    sequence = model.generate(prompt, max_new_tokens=8, do_sample=True, seed=4, temperature=0.7, top_k=12,
                              top_p=0.9)
    logits = model.apply(model.params, sequence[:, :-1]).logits[0, prompt.shape[1] - 1:]
    warped = warp(logits, sampling)
    keys = [jax.random.key(4)] + [jax.random.fold_in(jax.random.key(4), i) for i in range(1, 8)]
    draws = [int(jax.random.categorical(key, warped[i:i + 1], axis=-1)[0]) for i, key in enumerate(keys)]
    assert list(sequence[0, prompt.shape[1]:]) == draws


def test_generation_config_json_supplies_the_defaults(tmp_path):
    import json
    import shutil

    expected = fixture("qwen2_moe")
    shutil.copytree(MODELS / "qwen2_moe", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": int(expected["eos_token_id"]),
         "pad_token_id": 0}))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", devices=jax.devices()[:1], progress=False)
    np.testing.assert_array_equal(model.generate(expected["input_ids"], expected["attention_mask"]),
                                  expected["with_eos"])
