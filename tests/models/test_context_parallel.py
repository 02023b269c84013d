"""Models under context parallelism: PyTorch's logits and training curve on cp layouts, gradients equal to cp=1
(packed rows too), and one clear error for what cp does not run. Every family x cp x strategy x packing:
`python scripts/checks/check_context_parallel.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax import DistributedConfig
from moe_jax.checkpoint_files import read_config
from moe_jax.training.loss import model_loss, predicted_tokens, prediction_targets

from ..heavy import representative
from ..training.conftest import build_trainer, reference_curve  # noqa: F401  (a fixture)
from ..training.hf_training import SETUP
from ..training.test_loss_curves import AUX_RTOL, GRAD_NORM_RTOL, LOSS_RTOL, train_curve
from .test_fixture_parity import FAMILIES, FIXTURES, check_against_fixture, has_ep_plan

# The fixtures' rows are 12 tokens: cp 2 (2 x 2 zig-zag chunks of 3).
CP2_LAYOUTS = [dict(cp_size=2, fsdp_size=4, ep_size=4), dict(cp_size=2, tp_size=2, fsdp_size=2, cp_strategy="ring"),
               dict(cp_size=2, fsdp_size=2, ep_size=2, tp_size=2, enable_sequence_parallel=True),
               dict(cp_size=2, fsdp_size=4, ep_size=8, cp_strategy="ring")]


def cp2_layout(index: int, family: str) -> dict:
    layout = CP2_LAYOUTS[index % len(CP2_LAYOUTS)]
    return layout if has_ep_plan(family) else dict(cp_size=2, tp_size=2, fsdp_size=2, cp_strategy="ring")


# heavy: qwen3_moe's layout is the curve's below, qwen2_moe's (ring with tp) DeepSeek-V3's and Llama 4's
@pytest.mark.parametrize("family", representative(FAMILIES, suite=[family for family in FAMILIES
                                                                  if family not in ("qwen3_moe", "qwen2_moe")]))
def test_logits_match_pytorch_with_the_sequence_split_over_cp(family):
    check_against_fixture(family, cp2_layout(FAMILIES.index(family), family))


@pytest.mark.parametrize("layout", representative(
    [dict(cp_size=2, fsdp_size=4, ep_size=4), dict(cp_size=2, tp_size=2, fsdp_size=2, cp_strategy="ring")],
    suite=("cp2_fsdp4_ep4",), ids=["cp2_fsdp4_ep4", "cp2_tp2_fsdp2_ring"]))
def test_ten_adamw_steps_follow_the_reference_curve_under_cp(reference_curve, layout):
    _, train_step = build_trainer(layout)
    records = train_curve(train_step)
    np.testing.assert_allclose([r["loss"] for r in records], reference_curve["losses"], rtol=LOSS_RTOL)
    np.testing.assert_allclose([r["aux_loss"] for r in records], reference_curve["aux_losses"], rtol=AUX_RTOL)
    np.testing.assert_allclose([r["grad_norm"] for r in records], reference_curve["grad_norms"], rtol=GRAD_NORM_RTOL)


def packed_batch(vocab: int, batch: int = 4, length: int = 32):
    """Rows of several documents (segment ids 1, 2, ...; 0 padding at the end) and random tokens."""
    ids = np.random.default_rng(3).integers(1, vocab, (batch, length)).astype(np.int32)
    segments = np.zeros((batch, length), np.int32)
    for row in range(0, batch, 2):
        segments[row, :9], segments[row, 9:23], segments[row, 23:30] = 1, 2, 3
        segments[row + 1, :20], segments[row + 1, 20:] = 1, 2
    return ids, segments


def loss_and_gradients(model, ids, segments=None, mask=None):
    targets = prediction_targets(jnp.asarray(ids), jnp.asarray(segments if mask is None else mask))

    def loss(params):
        return model_loss(model, params, ids, mask, targets, total_tokens=predicted_tokens(targets), aux_weight=0.01,
                          capacity=None, segment_ids=segments)[0]

    value, grads = jax.jit(jax.value_and_grad(loss))(model.params)
    by_name = model.hf_params(grads)   # the same names whatever the layout stores (pipeline stages stack them)
    return float(value), {name: np.asarray(by_name[name]) for name in by_name}


def differences_from_one_device(family: str, layout: dict, packed: bool = True) -> tuple[float, float]:
    """(|loss - one device's|, max |gradient - one device's|) of `family` on `layout`, fp32, on packed rows or
    left-padded ones."""
    load = lambda config=None: moe_jax.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        FIXTURES / family, config, devices=jax.devices()[:1] if config is None else None, progress=False)
    single = load()
    ids, segments = packed_batch(single.config.vocab_size)
    inputs = dict(segments=segments) if packed else dict(mask=np.where(np.arange(ids.shape[1]) < 5 * np.arange(
        ids.shape[0])[:, None], 0, 1).astype(np.int32))
    expected = loss_and_gradients(single, ids, **inputs)
    got = loss_and_gradients(load(DistributedConfig(**layout)), ids, **inputs)
    return abs(got[0] - expected[0]), max(float(np.max(np.abs(got[1][name] - expected[1][name])))
                                          for name in expected[1])


def assert_equal_to_one_device(family: str, layout: dict, packed: bool = True, atol: float = 1e-5):
    loss, gradients = differences_from_one_device(family, layout, packed)
    assert loss < atol and gradients < atol, (family, layout, loss, gradients)


# Packed rows: documents end inside cp chunks; gpt-oss adds sinks and sliding windows, DeepSeek-V3 MLA, Llama 4
# chunked attention and its NoPE layers' temperature (from each token's index in its document); Qwen3-MoE runs
# through pipeline stages.
PACKED_CASES = [("gpt_oss", dict(cp_size=4, fsdp_size=2, ep_size=4, cp_strategy="ring")),
                ("qwen3_moe", dict(pp_size=2, cp_size=2, fsdp_size=2, ep_size=2, cp_strategy="ring")),
                ("deepseek_v3", dict(cp_size=4, tp_size=2)),
                ("llama4_text", dict(cp_size=8, cp_strategy="ring")),
                ("qwen2_moe", dict(cp_size=4, fsdp_size=2, ep_size=4))]


@pytest.mark.parametrize("family, layout", representative(
    PACKED_CASES, suite=(), ids=[case[0] for case in PACKED_CASES]))   # the cp grid script runs them too
def test_packed_rows_give_one_devices_loss_and_gradients(family, layout):
    assert_equal_to_one_device(family, layout)


@pytest.fixture(scope="module")
def cp_model():
    return moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3_moe", DistributedConfig(cp_size=4),
                                                        progress=False)


def test_generation_is_refused_with_what_to_use_instead(cp_model):
    with pytest.raises(ValueError, match=r"cp_size=4: a KV cache's steps .* layout without cp \(cp_size=1\)"):
        cp_model.generate(np.ones((1, 8), np.int32), max_new_tokens=2)


def test_a_sequence_cp_cannot_split_is_refused(cp_model):
    with pytest.raises(ValueError, match=r"sequence length 12 cannot be split over cp_size=4.*multiple of 8"):
        cp_model.forward(np.ones((2, 12), np.int32))


def test_the_mtp_loss_is_refused_under_cp():
    config = {**read_config(FIXTURES / "deepseek_v3"), "num_nextn_predict_layers": 1}
    model = moe_jax.AutoModelForCausalLM.from_config(config, DistributedConfig(cp_size=2), mtp_layers=1)
    model.init_params(0)
    with pytest.raises(ValueError, match=r"cp_size=2: the MTP layers .* train the MTP loss with cp_size=1"):
        model.apply(model.params, np.ones((2, 8), np.int32), return_mtp_logits=True)


def test_sequence_parallelism_keeps_the_norms_split_over_tp_and_the_losses():
    """`enable_sequence_parallel`: the compiled step's RMSNorm statistics are [B/fsdp, S/tp, 1] per device, and its
    temporaries fewer."""
    ids, _ = packed_batch(128, batch=4, length=64)
    records = {}
    for parallel in (False, True):
        model = moe_jax.AutoModelForCausalLM.from_pretrained(
            FIXTURES / "qwen3_moe", DistributedConfig(tp_size=4, fsdp_size=2, enable_sequence_parallel=parallel),
            progress=False)
        targets = prediction_targets(jnp.asarray(ids))
        step = jax.jit(jax.value_and_grad(lambda p, m=model: model_loss(
            m, p, ids, None, targets, total_tokens=predicted_tokens(targets), aux_weight=0.01, capacity=None)[0]))
        compiled = step.lower(model.params).compile()
        records[parallel] = (float(step(model.params)[0]), compiled.as_text(),
                             compiled.memory_analysis().temp_size_in_bytes)
    assert abs(records[True][0] - records[False][0]) < 1e-6
    assert "f32[2,16,1]{2,1,0} rsqrt(" in records[True][1] and "f32[2,16,1]{2,1,0} rsqrt(" not in records[False][1]
    assert "f32[2,64,1]{2,1,0} rsqrt(" in records[False][1]
    assert records[True][2] < records[False][2]


# A model whose activations, not its parameters, fill a long sequence's step (the fixtures' are too narrow).
LONG_SEQUENCE_CONFIG = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                            moe_intermediate_size=128, intermediate_size=512, num_hidden_layers=2,
                            max_position_embeddings=65536)


def step_temporaries(cp: int, length: int, strategy: str = "all_gather") -> int:
    """Per-device temporaries (bytes, XLA's memory analysis) of the loss-and-gradient step of one row of `length`
    tokens on cp devices."""
    config = {**read_config(FIXTURES / "qwen3_moe"), **LONG_SEQUENCE_CONFIG}
    model = moe_jax.AutoModelForCausalLM.from_config(
        config, DistributedConfig(cp_size=cp, cp_strategy=strategy) if cp > 1 else None, devices=jax.devices()[:cp])

    def loss(params, ids):
        targets = prediction_targets(ids)
        return model_loss(model, params, ids, None, targets, total_tokens=predicted_tokens(targets), aux_weight=0.01,
                          capacity=None)[0]

    ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(model.abstract_params(), ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("cps", representative([[2, 4], [2, 4, 8]], suite=("cp2-4",), ids=["cp2-4", "cp2-4-8"]))
def test_per_device_activation_memory_falls_as_one_over_cp_at_16k_tokens(cps):
    """Each doubling of cp halves the step's temporaries within 15% (attention in blocks: no [S, S] scores).
    cp 1 runs the one-device attention path, which holds [S, S] scores: far more (docs/benchmarks.md)."""
    sizes = {cp: step_temporaries(cp, 16384) for cp in cps}
    for cp in sizes:
        if 2 * cp in sizes:
            assert abs(sizes[2 * cp] / sizes[cp] - 0.5) <= 0.5 * 0.15, sizes
