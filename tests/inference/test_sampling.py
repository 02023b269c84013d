"""Next-token rules: greedy is argmax; the warpers filter as Transformers' do, in its order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.inference import Sampling, next_tokens, next_tokens_per_row, warp

LOGITS = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3


def test_greedy_is_argmax():
    np.testing.assert_array_equal(next_tokens(jnp.asarray(LOGITS), jax.random.key(0), Sampling()),
                                  LOGITS.argmax(-1))


@pytest.mark.reference
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)])
def test_warpers_keep_the_tokens_transformers_keeps(temperature, top_k, top_p):
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + (
        [TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    expected = processors(None, torch.tensor(LOGITS)).numpy()
    ours = np.asarray(warp(jnp.asarray(LOGITS), Sampling(True, temperature, top_k, top_p)))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(expected))
    np.testing.assert_allclose(ours[~np.isinf(ours)], expected[~np.isinf(expected)], rtol=1e-6)


def test_bad_sampling_settings_are_refused():
    with pytest.raises(ValueError, match="temperature=0 must be > 0"):
        Sampling(True, temperature=0)
    with pytest.raises(ValueError, match=r"top_p=1.5 must be in \(0, 1\]"):
        Sampling(True, top_p=1.5)


def test_each_row_draws_by_its_own_settings_and_key():
    """`next_tokens_per_row` (one program for every request's settings) against each row alone: a greedy row is
    its argmax, a sampling row categorical(its key, warp(its logits, its settings))."""
    rows = [Sampling(False), Sampling(True, 0.7, 5, 1.0), Sampling(True, 1.3, 0, 0.8), Sampling(True, 2.0, 0, 1.0)]
    logits = jnp.asarray(LOGITS)
    keys = jnp.stack([jax.random.fold_in(jax.random.key(9), row) for row in range(len(rows))])
    tokens = next_tokens_per_row(logits, keys, jnp.asarray([s.do_sample for s in rows]),
                                 jnp.asarray([s.temperature for s in rows]), jnp.asarray([s.top_k for s in rows]),
                                 jnp.asarray([s.top_p for s in rows]))
    expected = [int(LOGITS[0].argmax())] + [
        int(jax.random.categorical(keys[row], warp(logits[row:row + 1], sampling)[0]))
        for row, sampling in enumerate(rows) if sampling.do_sample]
    assert [int(t) for t in tokens] == expected
