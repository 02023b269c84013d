"""Pipeline stages (`pp_size > 1`, moe_jax/models/pipeline.py) give the one-stage model's logits, aux loss,
gradients and training curve, with TP, FSDP, HSDP and each ep_implementation; bubbles are inert; greedy
generation (each stage's KV cache) gives one device's tokens; loading reads only a stage's own layers; export is
unchanged. The suite runs a representative case of each; every family's case here runs with --heavy
(scripts/run_heavy_tests.sh), and the whole grid of pp layouts is `python scripts/checks/check_pipeline_layouts.py`."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import moe_jax
import moe_jax.models.pipeline
from converters import record_reads
from moe_jax import DistributedConfig
from moe_jax.causal_lm import MixtralForCausalLM, Qwen3MoeForCausalLM
from moe_jax.training import make_train_step

from ..heavy import representative
from .hf_reference import TINY_MIXTRAL, TINY_QWEN3_MOE
from .test_fixture_parity import FIXTURES, check_against_fixture

# 4 layers (dense 0, sparse 1-3): splits into 2 stages, and into 2 stages x 2 repeats for the circular schedule.
FOUR_LAYERS = dict(TINY_QWEN3_MOE, num_hidden_layers=4, output_router_logits=True, router_aux_loss_coef=0.02)


def _devices(layout: dict) -> list:
    config = DistributedConfig(**layout)
    return jax.devices()[:config.num_devices]


# Each family on one pp layout (with the layouts rotating through TP, FSDP + token dispatch, HSDP, all_reduce
# and a circular schedule); all 7 families x every legal pp layout: scripts/checks/check_pipeline_layouts.py.
FIXTURE_CASES = [
    ("qwen3_moe", dict(pp_size=2, fsdp_size=2, ep_size=2), dict(pipeline_microbatches=4)),
    ("qwen2_moe", dict(pp_size=2, tp_size=2, fsdp_size=2), {}),
    ("olmoe", dict(pp_size=2, tp_size=2, fsdp_size=2, ep_size=2, ep_implementation="all_reduce"), {}),
    ("mixtral", dict(pp_size=2, dp_replicate_size=2, fsdp_size=2, ep_size=2), {}),
    ("gpt_oss", dict(pp_size=2), dict(pipeline_microbatches=1)),
    ("deepseek_v3", dict(pp_size=2, fsdp_size=4, ep_size=4), {}),
    ("llama4_text", dict(pp_size=2, tp_size=2), dict(pipeline_schedule="circular", pipeline_repeats=2)),
]


# In the suite: FSDP + token dispatch with 4 microbatches (Qwen3-MoE) and a circular schedule over TP (Llama 4).
@pytest.mark.parametrize("family, layout, options", representative(
    FIXTURE_CASES, suite=("qwen3_moe", "llama4_text"), ids=[case[0] for case in FIXTURE_CASES]))
def test_logits_through_stages_match_pytorch_fixture(family, layout, options):
    """PyTorch's logits and aux loss (one process) on pp layouts; stages whose layers differ in structure
    (dense first layers, sliding / full, chunked / NoPE attention, an uneven 3-layer split) included."""
    check_against_fixture(family, layout, devices=_devices(layout), **options)


@pytest.fixture(scope="module")
def one_stage():
    model = Qwen3MoeForCausalLM(FOUR_LAYERS, devices=jax.devices()[:1])
    model.init_params(seed=5)
    params = {name: np.asarray(value * 20 if name.endswith("mlp.gate.weight") else value)
              for name, value in model.hf_params().items()}
    rng = np.random.default_rng(2)
    ids = rng.integers(0, FOUR_LAYERS["vocab_size"], (8, 10)).astype(np.int32)
    targets = rng.integers(0, FOUR_LAYERS["vocab_size"], (8, 10)).astype(np.int32)
    model.set_params(params)
    return params, ids, targets, *loss_and_grads(model, ids, targets)


def loss_and_grads(model, ids, targets):
    """(cross entropy + aux loss, every parameter's gradient under HF names) at the largest capacity."""

    def loss(params):
        output = model.apply(params, ids, inference=False)
        log_probs = jax.nn.log_softmax(output.logits, axis=-1)
        ce = -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))
        return ce + 0.02 * output.aux_loss

    value, grads = jax.jit(jax.value_and_grad(loss))(model.params)
    return float(value), jax.device_get(dict(model.hf_params(grads)))


GRADIENT_CASES = [
    (dict(pp_size=2, fsdp_size=2, ep_size=2), dict(pipeline_microbatches=2)),
    (dict(pp_size=2, tp_size=2, fsdp_size=2), dict(pipeline_schedule="circular", pipeline_repeats=2,
                                                   pipeline_microbatches=4)),
    (dict(pp_size=4, fsdp_size=2), dict(remat="full")),
]


@pytest.mark.parametrize("layout, options", representative(
    GRADIENT_CASES, suite=("pp2-tp2-fsdp2-circular",), ids=["pp2-fsdp2-ep2-m2", "pp2-tp2-fsdp2-circular",
                                                            "pp4-fsdp2-remat"]))
def test_gradients_through_stages_match_one_stage(one_stage, layout, options):
    params, ids, targets, expected_loss, expected_grads = one_stage
    model = Qwen3MoeForCausalLM(FOUR_LAYERS, DistributedConfig(**layout), devices=_devices(layout), **options)
    model.set_params(params)
    loss, grads = loss_and_grads(model, ids, targets)
    assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss)
    chex.assert_trees_all_close(grads, expected_grads, atol=1e-6, rtol=1e-5)


@pytest.mark.heavy   # the suite's gradients through stages above; scripts/checks/check_pipeline_training.py
def test_training_curve_through_stages_matches_one_stage(one_stage):
    """10 AdamW steps on pp2 x dp_replicate2 x fsdp2 with 2 microbatches per micro-batch (make_train_step's
    own count) follow the one-stage losses."""
    params, ids, _, _, _ = one_stage

    def losses(model, **step_options):
        model.set_params(params)
        train_step = make_train_step(model, optax.adamw(3e-3), grad_clip=1.0, **step_options)
        state, values = train_step.init_state(), []
        for _ in range(10):
            state, metrics = train_step(state, {"input_ids": ids})
            values.append(float(metrics["loss"]))
        return values

    expected = losses(Qwen3MoeForCausalLM(FOUR_LAYERS, devices=jax.devices()[:1]))
    layout = dict(pp_size=2, dp_replicate_size=2, fsdp_size=2)
    staged = losses(Qwen3MoeForCausalLM(FOUR_LAYERS, DistributedConfig(**layout), devices=_devices(layout)),
                    pipeline_microbatches=2)
    np.testing.assert_allclose(staged, expected, rtol=1e-5, atol=0)


def test_router_jitter_through_stages_equals_one_device():
    """Per-layer randomness follows the layer's own number: Mixtral's training jitter draws with
    fold_in(rng, layer), so the layers of stages 1-3 (one a stage) must not reuse stage 0's key. Four stages, so
    the hand-over from each stage to the next is not also the one to the previous. One microbatch, so every
    layer's draw has one device's shape."""
    config = {**TINY_MIXTRAL, "num_hidden_layers": 4, "router_jitter_noise": 0.5}
    one = MixtralForCausalLM(config, devices=jax.devices()[:1])
    one.init_params(seed=2)
    staged = MixtralForCausalLM(config, DistributedConfig(pp_size=4), devices=jax.devices()[:4],
                                pipeline_microbatches=1)
    staged.set_params(one.hf_params())
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 6)).astype(np.int32)
    key = jax.random.key(7)
    expected = np.asarray(one.apply(one.params, ids, inference=False, rng=key).logits)
    np.testing.assert_allclose(np.asarray(staged.apply(staged.params, ids, inference=False, rng=key).logits),
                               expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected, np.asarray(one.apply(one.params, ids).logits), atol=1e-4)


@pytest.mark.heavy
def test_bubbles_are_inert(one_stage, monkeypatch):
    """The buffers bubble iterations read filled with NaN: logits, aux loss, statistics and gradients are finite
    and equal to the zero-filled run's (pp4 with 2 microbatches: most iterations of stages 1-3 are bubbles)."""
    params, ids, targets, _, _ = one_stage
    layout = dict(pp_size=4, fsdp_size=2, ep_size=2)

    def run():
        model = Qwen3MoeForCausalLM(FOUR_LAYERS, DistributedConfig(**layout), devices=_devices(layout),
                                    pipeline_microbatches=2)
        model.set_params(params)
        output = jax.device_get(model.apply(model.params, ids, inference=False))
        return output, loss_and_grads(model, ids, targets)

    zero_output, (zero_loss, zero_grads) = run()
    monkeypatch.setattr(moe_jax.models.pipeline, "BUBBLE_FILL", math.nan)
    output, (loss, grads) = run()
    assert np.isfinite(output.logits).all() and np.isfinite(loss)
    assert all(np.isfinite(grad).all() for grad in grads.values())
    np.testing.assert_array_equal(output.logits, zero_output.logits)
    assert float(output.aux_loss) == float(zero_output.aux_loss)
    assert output.statistics.as_dict().keys() == zero_output.statistics.as_dict().keys()
    for name, value in output.statistics.as_dict().items():
        assert np.asarray(value) == np.asarray(zero_output.statistics.as_dict()[name]), name
    assert loss == zero_loss
    # NaN read by any real computation would reach the gradients; what differs is only the rounding of the
    # embedding's scatter-add, which XLA compiles differently for the two fills (last bit of a few entries).
    chex.assert_trees_all_close(grads, zero_grads, rtol=0, atol=1e-7)


def test_each_stage_reads_only_its_own_layers():
    """pp2 x fsdp4 (Qwen3-MoE fixture, 3 layers: stage 0 runs layer 0, stage 1 layers 1-2): a device of stage 0
    reads no byte of layers 1-2 and one of stage 1 none of layer 0."""
    layout = dict(pp_size=2, fsdp_size=4)
    with record_reads() as reads:
        model = moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3_moe", DistributedConfig(**layout),
                                                             devices=_devices(layout), progress=False)
    stage_of = {device.id: stage for stage, row in enumerate(model.mesh.devices) for device in row.flat}
    for read in reads:
        if not read.key.startswith("model.layers."):
            continue
        layer = int(read.key.split(".")[2])
        stages = {stage_of[device] for device in read.request[2]}
        assert stages == {0 if layer == 0 else 1}, (read.key, stages)


def test_export_through_stages_is_the_checkpoint(tmp_path):
    """save_pretrained of a model loaded onto pp2 x ep2 writes the checkpoint it loaded, bit for bit."""
    layout = dict(pp_size=2, fsdp_size=2, ep_size=2)
    model = moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / "deepseek_v3", DistributedConfig(**layout),
                                                         devices=_devices(layout), progress=False)
    model.save_pretrained(tmp_path / "out", progress=False)
    original, written = load_file(FIXTURES / "deepseek_v3" / "model.safetensors"), load_file(
        tmp_path / "out" / "model.safetensors")
    assert original.keys() == written.keys()
    for key in original:
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)


def greedy_tokens(family: str, layout: dict, **options) -> tuple[np.ndarray, np.ndarray]:
    """(tokens through the stages of `layout`, tokens on one device): 6 greedy tokens after three prompts of the
    fixture's vocabulary, one left-padded."""
    ids = np.random.default_rng(0).integers(3, 120, (3, 7)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    one = moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / family, None, devices=jax.devices()[:1],
                                                       progress=False)
    staged = moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / family, DistributedConfig(**layout),
                                                          devices=_devices(layout), progress=False, **options)
    return staged.generate(ids, mask, max_new_tokens=6), one.generate(ids, mask, max_new_tokens=6)


@pytest.mark.parametrize("family, layout, options", representative([
    ("gpt_oss", dict(pp_size=2), {}),   # sliding-window rings; 2 microbatches keep both stages busy
    ("deepseek_v3", dict(pp_size=2, tp_size=2, fsdp_size=2), dict(pipeline_microbatches=1)),  # stage by stage
], suite=("gpt_oss-pp2",), ids=["gpt_oss-pp2", "deepseek_v3-pp2-tp2-fsdp2-m1"]))
def test_greedy_generation_through_stages_equals_one_device(family, layout, options):
    """Prefill and decode with each stage's KV cache rows: the same tokens as one device (all 7 families:
    scripts/checks/check_pipeline_layouts.py)."""
    staged, one = greedy_tokens(family, layout, **options)
    np.testing.assert_array_equal(staged, one)


def test_bad_pipeline_inputs_are_one_clear_error():
    layout = dict(pp_size=2, fsdp_size=2)
    model = Qwen3MoeForCausalLM(FOUR_LAYERS, DistributedConfig(**layout), devices=_devices(layout),
                                pipeline_microbatches=4)
    model.init_params(seed=0)
    with pytest.raises(ValueError, match=r"batch size 4 cannot be cut into 4 pipeline microbatches each split over "
                                         r"the 2 data-parallel groups; use a multiple of 8"):
        model.apply(model.params, np.zeros((4, 5), np.int32))
    with pytest.raises(ValueError, match=r"pp_size=8 is larger than the model's 4 layers"):
        Qwen3MoeForCausalLM(FOUR_LAYERS, DistributedConfig(pp_size=8))
