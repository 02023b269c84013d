"""Packed rows (`segment_ids`): several documents per row attend only within themselves, positions restart per
document, nothing is predicted across a document's end, and the router's aux loss counts only real tokens —
so a packed row gives every document's logits, losses and gradients as the documents one per row, for every
family (sliding windows, gpt-oss's sinks, Llama 4's chunks and NoPE layers, DeepSeek's latent attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.inference import init_cache
from moe_jax.training.loss import model_loss, predicted_tokens, prediction_targets
from tests.heavy import representative
from tests.inference.hf_generation import MODELS

LENGTHS = (5, 3, 6)          # longer than the fixtures' windows (4-5) and Llama 4's chunks (4)
PACKED_LENGTH = 16           # 14 tokens and 2 of padding


def load(model_type: str, layout: dict | None = None):
    return AutoModelForCausalLM.from_pretrained(
        MODELS / model_type, None if layout is None else DistributedConfig(**layout),
        devices=jax.devices()[:1] if layout is None else None, progress=False)


def documents(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, n).astype(np.int32) for n in LENGTHS]


def packed(docs: list[np.ndarray], rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The documents in one row (repeated `rows` times), then padding: (input_ids, segment_ids) [rows, 16]."""
    ids, segments = np.zeros(PACKED_LENGTH, np.int32), np.zeros(PACKED_LENGTH, np.int32)
    start = 0
    for number, doc in enumerate(docs, 1):
        ids[start:start + len(doc)], segments[start:start + len(doc)] = doc, number
        start += len(doc)
    return np.tile(ids, (rows, 1)), np.tile(segments, (rows, 1))


def one_per_row(docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(doc) for doc in docs)
    ids, mask = np.zeros((len(docs), width), np.int32), np.zeros((len(docs), width), np.int32)
    for row, doc in enumerate(docs):
        ids[row, :len(doc)], mask[row, :len(doc)] = doc, 1
    return ids, mask


def assert_each_document(model, docs, logits_alone, rtol: float) -> None:
    """The packed row's logits, document by document, equal `logits_alone(doc)` (that document run alone)."""
    ids, segments = packed(docs)
    logits = np.asarray(model.apply(model.params, ids, segment_ids=segments).logits)[0]
    start = 0
    for doc in docs:
        np.testing.assert_allclose(logits[start:start + len(doc)], logits_alone(doc), atol=2e-5, rtol=rtol)
        start += len(doc)


# One family per attention kind: full (Qwen3-MoE), sliding window with sinks (gpt-oss), chunked with NoPE layers
# (Llama 4), latent (DeepSeek-V3); the suite runs the latent one (its own cache and positions path; the other
# kinds' packed logits meet Transformers' in the test below). Every family: scripts/checks/check_packing.py.
ATTENTION_KIND_FAMILIES = ("qwen3_moe", "gpt_oss", "llama4_text", "deepseek_v3")


@pytest.mark.parametrize("model_type", representative(ATTENTION_KIND_FAMILIES, suite=("deepseek_v3",)))
def test_a_packed_row_gives_each_document_s_logits_loss_and_gradients(model_type):
    check_packed_row_equals_one_per_row(model_type)


def check_packed_row_equals_one_per_row(model_type: str) -> None:
    """The packed row's logits (each document's), loss, aux loss and gradients equal the documents one per row."""
    model = load(model_type)
    docs = documents(model.config.vocab_size)
    assert_each_document(model, docs, lambda doc: np.asarray(model.apply(model.params, doc[None]).logits)[0], 1e-5)
    ids, segments = packed(docs)

    rows_ids, rows_mask = one_per_row(docs)
    packed_targets, row_targets = prediction_targets(ids, segments), prediction_targets(rows_ids, rows_mask)
    assert float(predicted_tokens(packed_targets)) == float(predicted_tokens(row_targets)) == sum(LENGTHS) - 3

    def loss(params, input_ids, mask, targets, **packing):
        return model_loss(model, params, input_ids, mask, targets, total_tokens=predicted_tokens(targets),
                          aux_weight=0.01, capacity=None, inference=True, step=model.apply, **packing)

    (packed_loss, packed_terms), packed_grads = jax.value_and_grad(loss, has_aux=True)(
        model.params, ids, None, packed_targets, segment_ids=segments)
    (row_loss, row_terms), row_grads = jax.value_and_grad(loss, has_aux=True)(
        model.params, rows_ids, rows_mask, row_targets)
    np.testing.assert_allclose(float(packed_terms["ce_sum"]), float(row_terms["ce_sum"]), rtol=1e-5)
    np.testing.assert_allclose(float(packed_terms["aux"]), float(row_terms["aux"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(packed_loss), float(row_loss), rtol=1e-5)
    for name in packed_grads:
        np.testing.assert_allclose(np.asarray(packed_grads[name]), np.asarray(row_grads[name]), atol=1e-5,
                                   rtol=1e-4, err_msg=name)


def test_packed_rows_on_an_8_device_layout_equal_one_device():
    docs = documents(128)
    ids, segments = packed(docs, rows=4)
    one_device = load("qwen3_moe")
    expected = np.asarray(one_device.apply(one_device.params, ids, segment_ids=segments).logits)
    model = load("qwen3_moe", dict(tp_size=2, fsdp_size=4, ep_size=4))
    sharded = np.asarray(model.apply(model.params, jnp.asarray(ids), segment_ids=segments, capacity=None).logits)
    np.testing.assert_allclose(sharded, expected, atol=2e-5, rtol=1e-5)


def test_packed_rows_are_refused_with_a_cache():
    model = load("qwen3_moe")
    ids, segments = packed(documents(128))
    with pytest.raises(ValueError, match="not with a KV cache"):
        model.apply(model.params, ids, segment_ids=segments, cache=init_cache(model, 1, 32))


@pytest.mark.reference
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3", "llama4_text"])
def test_a_packed_row_gives_transformers_logits_of_each_document_alone(model_type):
    """Transformers' own position_ids packing does not isolate documents on CPU (eager and sdpa: the second
    document sees the first; only flash attention's varlen path does, on a GPU), so the reference is each
    document run alone through Transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(MODELS / model_type, dtype=torch.float32).eval()
    model = load(model_type)

    def alone(doc):
        with torch.no_grad():
            return reference(input_ids=torch.tensor(doc[None]).long()).logits.numpy()[0]

    assert_each_document(model, documents(model.config.vocab_size), alone, 1e-4)
