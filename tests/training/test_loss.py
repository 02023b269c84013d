"""The chunked causal-LM loss: every chunking gives the plain cross entropy, its count and its gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moe_jax.training import loss as loss_module
from moe_jax.training.loss import IGNORE_INDEX, chunked_cross_entropy

BATCH, SEQUENCE, WIDTH, VOCAB = 2, 7, 8, 11


def inputs():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((BATCH, SEQUENCE, WIDTH)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((VOCAB, WIDTH)), jnp.float32)
    targets = rng.integers(0, VOCAB, (BATCH, SEQUENCE))
    targets[0, -2:] = IGNORE_INDEX
    targets[1, 0] = IGNORE_INDEX
    return hidden, head, jnp.asarray(targets, jnp.int32)


def chunked(hidden, head, targets, chunk):
    return chunked_cross_entropy(hidden, targets, lambda h: h @ head.T, chunk)[0]


def plain(hidden, head, targets):
    counted = targets != IGNORE_INDEX
    losses = optax.softmax_cross_entropy_with_integer_labels(hidden @ head.T, jnp.where(counted, targets, 0))
    return jnp.sum(jnp.where(counted, losses, 0.0))


@pytest.mark.parametrize("kept_logits_bytes", [0, 2**30])   # recomputed in the backward pass, or kept
@pytest.mark.parametrize("chunk", [1, 3, SEQUENCE, 64])  # many, padded last, exactly one, larger than S
def test_every_chunking_gives_the_plain_loss_and_gradients(chunk, kept_logits_bytes, monkeypatch):
    monkeypatch.setattr(loss_module, "KEPT_LOGITS_BYTES", kept_logits_bytes)
    hidden, head, targets = inputs()
    value, grads = jax.value_and_grad(chunked, argnums=(0, 1))(hidden, head, targets, chunk)
    want_value, want_grads = jax.value_and_grad(plain, argnums=(0, 1))(hidden, head, targets)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    _, count = chunked_cross_entropy(hidden, targets, lambda h: h @ head.T, chunk)
    assert int(count) == BATCH * SEQUENCE - 3


def test_large_logits_are_recomputed_in_the_backward_pass_and_small_ones_kept(monkeypatch):
    hidden, head, targets = inputs()
    for kept_logits_bytes, recomputed in ((0, True), (2**30, False)):
        monkeypatch.setattr(loss_module, "KEPT_LOGITS_BYTES", kept_logits_bytes)
        jaxpr = str(jax.make_jaxpr(jax.grad(chunked, argnums=1), static_argnums=3)(hidden, head, targets, 3))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == recomputed


def test_chunk_must_be_positive():
    hidden, head, targets = inputs()
    with pytest.raises(ValueError, match="loss chunk=0 must be >= 1"):
        chunked(hidden, head, targets, 0)
