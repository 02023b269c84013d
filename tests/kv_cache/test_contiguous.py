"""The KV cache: laid out like the attention heads, sliding-window layers keep only their window, and a
prompt fed in pieces through `apply(cache=...)` gives the logits of one full forward."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.inference import bucket_length, init_cache, prompt_positions
from tests.inference.hf_generation import MODELS


def test_lengths_are_bucketed():
    assert [bucket_length(n) for n in (1, 3, 64, 65, 128, 129, 300)] == [1, 4, 64, 128, 128, 256, 384]
    with pytest.raises(ValueError, match="at least one token"):
        bucket_length(0)


def test_window_layers_keep_a_ring_of_their_window_and_heads_split_over_tp():
    """Qwen2-MoE fixture: layers 0 and 2 slide over 4 tokens (a ring of 3), layer 1 attends to all 64."""
    model = AutoModelForCausalLM.from_pretrained(MODELS / "qwen2_moe", DistributedConfig(tp_size=2, fsdp_size=4),
                                                 progress=False)
    cache = init_cache(model, batch=4, max_length=40)
    assert {key: array.shape for key, array in cache.keys.items()} == {
        "0": (1, 4, 3, 2, 8), "1": (1, 4, 64, 2, 8), "2": (1, 4, 3, 2, 8)}
    assert set(cache.window_masks) == {"0", "2"}
    spec = cache.keys["1"].sharding.spec
    assert spec[1] is not None and spec[3] == "tp"          # rows over the data axes, KV heads over tp
    with pytest.raises(ValueError, match="longer than the model's 256 positions"):
        init_cache(model, batch=4, max_length=300)


def test_a_prompt_fed_in_pieces_gives_the_full_forward_logits():
    """Mixtral's window (5) is shorter than the 10 tokens: its layers run on the ring."""
    model = AutoModelForCausalLM.from_pretrained(MODELS / "mixtral", devices=jax.devices()[:1], progress=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, model.config.vocab_size, (2, 10)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    positions = np.asarray(prompt_positions(mask))
    full = np.asarray(model.apply(model.params, ids, attention_mask=mask, positions=positions).logits)
    cache, pieces = init_cache(model, 2, 10), []
    for start, stop in [(0, 6), (6, 7), (7, 10)]:
        out = model.apply(model.params, ids[:, start:stop], attention_mask=mask[:, start:stop],
                          positions=positions[:, start:stop], cache=cache)
        cache = out.cache
        pieces.append(np.asarray(out.logits))
    assert int(cache.length) == 10
    np.testing.assert_allclose(np.concatenate(pieces, axis=1)[mask == 1], full[mask == 1], atol=1e-5)


def test_a_prompt_fed_in_pieces_into_the_full_cache_gives_the_reference_logits():
    """OLMoE has no sliding window, so every layer writes its new keys/values into the full cache at slots
    [length, length + S); the Mixtral test above runs only rings. A wrong write slot or query index there
    (off by one, or every piece written at 0) misaligns keys with `key_mask` and positions, and fails here
    rather than only in the end-to-end generate tests. The committed fixture's 12 left-padded tokens (rows 1
    and 5, row 5's first piece all padding) go in 4 pieces of 3 (one compilation), compared on the real
    tokens with the PyTorch reference's logits of one full forward."""
    model = AutoModelForCausalLM.from_pretrained(MODELS / "olmoe", devices=jax.devices()[:1], progress=False)
    reference = np.load(MODELS / "olmoe" / "reference.npz")
    ids, mask = reference["input_ids"].astype(np.int32), reference["attention_mask"]
    positions = np.asarray(prompt_positions(mask))
    cache, pieces = init_cache(model, *ids.shape), []
    assert cache.window_masks == {} and cache.max_length == 16      # full per-layer caches, 4 slots spare
    for start in range(0, ids.shape[1], 3):
        piece = slice(start, start + 3)
        out = model.apply(model.params, ids[:, piece], attention_mask=mask[:, piece],
                          positions=positions[:, piece], cache=cache)
        cache = out.cache
        pieces.append(np.asarray(out.logits))
    assert int(cache.length) == ids.shape[1]
    real = mask == 1
    np.testing.assert_allclose(np.concatenate(pieces, axis=1)[real], reference["logits"][real],
                               atol=1e-5, rtol=0)
