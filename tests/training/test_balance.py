"""The train step's expert load balance terms (`moe_jax.training.balance`): ST-MoE's router z-loss on the tiny
Qwen3-MoE, DeepSeek-V3's aux-loss-free router bias update on its tiny fixture, and their flags."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli import main
from moe_jax.lora import LoraConfig
from moe_jax.ops.routing import router_z_loss
from moe_jax.training import make_train_step

from ..heavy import representative
from ..test_cli_errors import error_line
from .conftest import LAYOUTS, FixtureBatches, build_trainer, reference_optimizer
from .hf_training import CONFIG_CHANGES, FIXTURES

DEEPSEEK = FIXTURES / "models" / "deepseek_v3"
BIAS = "mlp.gate.e_score_correction_bias"


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def numpy_z_loss(router_logits: list, mask: np.ndarray) -> float:
    """Per layer: the mean over real tokens of logsumexp(logits)^2; then the mean over layers (float64)."""
    real = mask.reshape(-1) > 0
    per_layer = []
    for logits in router_logits:
        logits = np.asarray(logits, np.float64)[real]
        top = logits.max(-1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
        per_layer.append(np.mean(lse ** 2))
    return float(np.mean(per_layer))


# ---- router z-loss ----------------------------------------------------------------------------------------------
# The suite runs one device; --heavy the sharded layout too (the sharded bias update below runs fsdp8/ep8).
@pytest.mark.parametrize("layout", representative(["one_device", "tp2_fsdp4_ep4"], suite=("one_device",)))
def test_the_z_loss_is_the_router_logits_logsumexp_squared_and_joins_the_loss(layout):
    coef = 0.05
    model, train_step = build_trainer(LAYOUTS[layout], router_z_loss_coef=coef)
    batch = FixtureBatches().batch(0)                      # rows 1 and 5 padded: the mean is over real tokens
    logits = model.apply(model.params, batch["input_ids"], attention_mask=batch["attention_mask"]).router_logits
    expected = numpy_z_loss(logits, batch["attention_mask"])
    # The largest dispatch capacity drops no token (a dropped one would change the later layers' router inputs).
    state = train_step.init_state(capacity=None if LAYOUTS[layout] is None else model.capacity_schedule.largest)
    _, metrics = train_step(state, batch)
    metrics = host(metrics)
    assert metrics["dropped"] == 0
    np.testing.assert_allclose(metrics["router_z_loss"], expected, rtol=1e-5)
    aux = CONFIG_CHANGES["router_aux_loss_coef"] * metrics["aux_loss"]
    np.testing.assert_allclose(metrics["loss"], metrics["ce_loss"] + aux + coef * expected, rtol=1e-6)
    # The padding is left out: counting every row gives another value.
    assert abs(numpy_z_loss(logits, np.ones_like(batch["attention_mask"])) - expected) > 1e-3


def test_the_z_loss_adds_its_own_gradient_and_nothing_else():
    """One SGD step at learning rate 1, no clipping: the parameters with the z-loss minus those without are
    -coef * d(z)/d(params), the gradient of the z-loss of the model's router logits on its own."""
    coef, batch = 0.5, FixtureBatches().batch(0)
    results = {}
    for c in (0.0, coef):
        model, train_step = build_trainer(None, optimizer=optax.sgd(1.0), grad_clip=None, router_z_loss_coef=c)
        state, metrics = train_step(train_step.init_state(), batch)
        results[c] = host(metrics), host(state.params)
    (plain, plain_params), (with_z, z_params) = results[0.0], results[coef]
    # The other terms are computed exactly as without the z-loss.
    for name in ("ce_loss", "aux_loss"):
        np.testing.assert_array_equal(with_z[name], plain[name])
    assert "router_z_loss" not in plain

    mask = batch["attention_mask"]

    def z_of(params):
        output = model.apply(params, batch["input_ids"], attention_mask=mask, inference=False)
        return router_z_loss(output.router_logits, mask)

    gradient = host(jax.grad(z_of)(model.params))
    for name, value in gradient.items():
        np.testing.assert_allclose(z_params[name] - plain_params[name], -coef * value, atol=2e-5, err_msg=name)
    assert np.abs(gradient["model.layers.2.mlp.gate.weight"]).max() > 1e-2      # it reaches the routers
    assert not gradient["lm_head.weight"].any()                                    # and not the head


def test_micro_batches_with_the_z_loss_give_the_step_of_the_whole_batch():
    """grad_accum=2 on four rows each twice (both micro-batches are those four rows, one of them padded): the
    z-loss, the loss and the SGD step equal one step on the whole batch only if each micro-batch's z-loss enters
    the gradient weighted by coef / grad_accum."""
    batch = {name: np.repeat(array[:4], 2, axis=0) for name, array in FixtureBatches().batch(0).items()}
    results = []
    for grad_accum in (1, 2):
        _, train_step = build_trainer(None, optimizer=optax.sgd(1.0), grad_clip=None, grad_accum=grad_accum,
                                      router_z_loss_coef=0.5)
        state, metrics = train_step(train_step.init_state(), batch)
        results.append((host(metrics), host(state.params)))
    (whole, whole_params), (micro, micro_params) = results
    for name in ("loss", "router_z_loss", "aux_loss"):
        np.testing.assert_allclose(micro[name], whole[name], rtol=1e-6, err_msg=name)
    for name in whole_params:
        np.testing.assert_allclose(micro_params[name], whole_params[name], rtol=0, atol=2e-5, err_msg=name)


def test_without_the_balance_terms_the_step_is_the_program_it_was():
    model, default = build_trainer(None)
    explicit = make_train_step(model, reference_optimizer(), grad_clip=1.0, loss_chunk=5, router_z_loss_coef=0.0,
                               router_bias_update_rate=0.0)
    batch = FixtureBatches().batch(0)
    state = default.init_state()
    assert str(default.trace(state, batch).jaxpr) == str(explicit.trace(state, batch).jaxpr)


# ---- router bias update -----------------------------------------------------------------------------------------
def deepseek(layout: dict | None = None, **options):
    model = AutoModelForCausalLM.from_pretrained(
        DEEPSEEK, None if layout is None else DistributedConfig(**layout),
        devices=jax.devices()[:1] if layout is None else None, progress=False, **options)
    return model


def bias_rows(model, params) -> np.ndarray:
    """[sparse layers, E] router biases of a storage-layout params dict."""
    per_layer = model.layer_stack.unstack(params)
    return np.stack([np.asarray(per_layer[f"model.layers.{layer}.{BIAS}"]) for layer in model.sparse_layers()])


def skewed_batch(rows: int = 8, length: int = 16) -> dict:
    rng = np.random.default_rng(3)
    return {"input_ids": rng.integers(0, 6, (rows, length)).astype(np.int32)}   # 6 of the 128 tokens


@pytest.mark.parametrize(("layout", "scan"), [(None, False), ({"fsdp_size": 8, "ep_size": 8}, True)],
                         ids=["one_device", "fsdp8_ep8_scanned"])
def test_a_step_moves_the_bias_by_rate_times_the_sign_of_mean_minus_load(layout, scan):
    rate = 0.01
    model = deepseek(layout, scan_layers=scan)
    assert any(BIAS in name and "1-2" in name for name in model.params) == scan    # one stacked entry when scanned
    train_step = make_train_step(model, optax.adamw(1e-3), router_bias_update_rate=rate)
    # The largest dispatch capacity never drops, so the step is applied.
    state = train_step.init_state(capacity=None if layout is None else model.capacity_schedule.largest)
    before = bias_rows(model, host(state.params))
    state, metrics = train_step(state, skewed_batch())
    assert bool(metrics["applied"])
    load = host(metrics)["expert_load"].astype(np.float32)
    assert load.sum() == 8 * 16 * 2 * 2 and (load != load.mean(-1, keepdims=True)).any()
    sign = np.sign(load.mean(-1, keepdims=True) - load).astype(np.float32)
    np.testing.assert_array_equal(bias_rows(model, host(state.params)), before + np.float32(rate) * sign)


# heavy: the suite's bias tests check the update itself and its round trips; this one the rest of the params.
@pytest.mark.heavy
def test_the_bias_update_changes_nothing_else_and_is_skipped_with_the_step():
    model = deepseek()
    batch = skewed_batch()
    states = {}
    for rate in (0.0, 0.02):
        train_step = make_train_step(model, optax.adamw(1e-3, weight_decay=0.1), router_bias_update_rate=rate)
        states[rate], _ = train_step(train_step.init_state(), batch)
    plain, moved = host(states[0.0].params), host(states[0.02].params)
    biases = [f"model.layers.{layer}.{BIAS}" for layer in (1, 2)]
    assert all(np.abs(moved[name] - plain[name]).max() > 0.019 for name in biases)
    for name in plain.keys() - set(biases):   # two programs: the same math, float order aside
        np.testing.assert_allclose(moved[name], plain[name], atol=1e-6, rtol=0, err_msg=name)
    # Without the update the bias is a buffer: the optimizer (weight decay included) leaves it as loaded.
    np.testing.assert_array_equal(bias_rows(model, plain), bias_rows(model, host(model.params)))
    # A step that is skipped (a state already skipping after an overflow) leaves the bias too.
    model = deepseek({"fsdp_size": 8, "ep_size": 8})
    train_step = make_train_step(model, optax.adamw(1e-3), router_bias_update_rate=0.02)
    state = train_step.init_state()
    state = state.replace(skipping=jax.device_put(np.ones((), bool), state.skipping.sharding))
    state, metrics = train_step(state, batch)
    assert not bool(metrics["applied"])
    np.testing.assert_array_equal(bias_rows(model, host(state.params)), bias_rows(model, host(model.params)))


def test_twenty_steps_balance_a_skewed_load_and_the_bias_round_trips_through_save_pretrained(tmp_path):
    model = deepseek()
    # Only the bias moves (learning rate 0): what changes the load is the update alone.
    train_step = make_train_step(model, optax.sgd(0.0), router_bias_update_rate=0.05)
    state, batch, imbalance = train_step.init_state(), skewed_batch(), []
    for _ in range(20):
        state, metrics = train_step(state, batch)
        load = host(metrics)["expert_load"].astype(np.float64)
        imbalance.append(load.max(-1) / load.mean(-1))
    first, last = imbalance[0], np.mean(imbalance[-3:], axis=0)
    assert (first > 2.0).all(), first                     # the batch is skewed
    assert (last < 0.6 * first).all(), (first, last)

    params, _ = train_step.weights(state.params)
    trained = bias_rows(model, host(params))
    assert not np.array_equal(trained, bias_rows(model, host(model.params)))
    model.save_pretrained(tmp_path, params=params, progress=False)
    stored = {}
    for file in tmp_path.glob("*.safetensors"):
        stored.update(load_file(file))
    np.testing.assert_array_equal(np.stack([stored[f"model.layers.{layer}.{BIAS}"] for layer in (1, 2)]), trained)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, devices=jax.devices()[:1], progress=False)
    np.testing.assert_array_equal(bias_rows(reloaded, host(reloaded.params)), trained)


@pytest.mark.reference
def test_transformers_reads_the_updated_bias_and_gives_our_logits(tmp_path):
    import torch
    import transformers

    model = deepseek()
    train_step = make_train_step(model, optax.sgd(0.0), router_bias_update_rate=0.05)
    state = train_step.init_state()
    for _ in range(3):
        state, _ = train_step(state, skewed_batch())
    params, _ = train_step.weights(state.params)
    model.save_pretrained(tmp_path, params=params, progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    trained = bias_rows(model, host(params))
    for row, layer in enumerate((1, 2)):
        bias = reference.model.layers[layer].mlp.gate.e_score_correction_bias.detach().numpy()
        np.testing.assert_array_equal(bias, trained[row])
    ids = np.asarray(skewed_batch()["input_ids"])[:2]
    with torch.no_grad():
        expected = reference(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.apply(params, ids).logits), expected, rtol=0, atol=1e-5)


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_a_family_without_a_router_bias_is_refused_naming_those_with_one():
    model, _ = build_trainer(None)
    with pytest.raises(ValueError, match=r"which a qwen3_moe model does not have; .* whose routers hold one: "
                                         r"deepseek_v3\. Balance"):
        make_train_step(model, optax.adamw(1e-3), router_bias_update_rate=1e-3)


def test_the_balance_terms_refuse_what_they_cannot_do():
    model = deepseek()
    with pytest.raises(ValueError, match="router_bias_update_rate=-0.1 must be >= 0"):
        make_train_step(model, optax.adamw(1e-3), router_bias_update_rate=-0.1)
    with pytest.raises(ValueError, match="router_z_loss_coef=-1.0 must be >= 0"):
        make_train_step(model, optax.adamw(1e-3), router_z_loss_coef=-1)
    with pytest.raises(ValueError, match="only when the step trains every parameter"):
        make_train_step(model, optax.adamw(1e-3), router_bias_update_rate=1e-3, trainable="*.self_attn.*")
    model.add_adapter(LoraConfig(r=2, target_modules=["o_proj"]))
    with pytest.raises(ValueError, match="only when the step trains every parameter"):
        make_train_step(model, optax.adamw(1e-3), router_bias_update_rate=1e-3)
    staged = AutoModelForCausalLM.from_pretrained(DEEPSEEK, DistributedConfig(pp_size=2), devices=jax.devices()[:2],
                                                  progress=False)
    with pytest.raises(ValueError, match="pipeline stages keep in their stage: train with pp_size=1"):
        make_train_step(staged, optax.adamw(1e-3), router_z_loss_coef=1e-3)


# ---- the command line ---------------------------------------------------------------------------------------------
def test_train_takes_the_balance_flags(tmp_path, capsys):
    metrics, out = tmp_path / "metrics.jsonl", tmp_path / "trained"
    assert main(["train", "--model", str(DEEPSEEK), "--steps", "2", "--batch-size", "4", "--seq-len", "16",
                 "--router-z-loss-coef", "0.01", "--router-bias-update-rate", "0.01", "--no-progress",
                 "--metrics-jsonl", str(metrics), "--export-hf", str(out)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    assert all(record["router_z_loss"] > 0 for record in records)
    stored = load_file(next(out.glob("*.safetensors")))
    original = load_file(next(DEEPSEEK.glob("*.safetensors")))
    moved = stored[f"model.layers.1.{BIAS}"] - original[f"model.layers.1.{BIAS}"]
    # Two steps of +-0.01 (or 0 where an expert got exactly the mean load).
    assert np.isin(np.round(moved / 0.01).astype(int), [-2, -1, 0, 1, 2]).all() and moved.any()
    capsys.readouterr()

    assert main(["train", "--steps", "1", "--router-z-loss-coef", "-1"]) == 2
    assert error_line(capsys) == "--router-z-loss-coef -1.0 must be >= 0 (0 turns it off)."
    assert main(["train", "--steps", "1", "--router-bias-update-rate", "0.01", "--no-progress"]) == 2
    assert "whose routers hold one: deepseek_v3" in error_line(capsys)


def test_a_bias_update_is_checked_against_config_json_before_loading(monkeypatch, capsys):
    """The family's router bias is read from config.json: a family without one is refused before any weight is
    read (the loader is not reached)."""
    from moe_jax.checkpoint_files import read_config
    from moe_jax.cli.balance_flags import check_router_bias

    check_router_bias(read_config(DEEPSEEK), 0.01)
    check_router_bias(read_config(FIXTURES / "models" / "qwen3_moe"), 0.0)
    with pytest.raises(ValueError, match="which a qwen3_moe model does not have; .* hold one: deepseek_v3"):
        check_router_bias(read_config(FIXTURES / "models" / "qwen3_moe"), 0.01)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights read before the flags were checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    assert main(["train", "--model", str(FIXTURES / "models" / "qwen3_moe"), "--steps", "1",
                 "--router-bias-update-rate", "0.01", "--no-progress"]) == 2
    assert "which a qwen3_moe model does not have" in error_line(capsys)


def test_the_aux_loss_flag_sets_the_config_and_a_collapse_names_the_family_s_balance_flag(capsys):
    """--router-aux-loss-coef turns the family's aux loss on (or off) for the run, is refused for a family whose
    reference has none, and is the flag a collapsing router's warning names where the family has no router bias."""
    from moe_jax.checkpoint_files import read_config
    from moe_jax.cli import build_parser
    from moe_jax.cli.balance_flags import check_router_aux_loss, collapse_remedy, with_router_aux_loss
    from moe_jax.cli.train import _checked_request

    qwen, deepseek = read_config(FIXTURES / "models" / "qwen3_moe"), read_config(DEEPSEEK)
    parse = build_parser().parse_args
    args = parse(["train", "--model", str(FIXTURES / "models" / "qwen3_moe"), "--router-aux-loss-coef", "0.02"])
    config = _checked_request(args).config
    assert (config["output_router_logits"], config["router_aux_loss_coef"]) == (True, 0.02)
    assert with_router_aux_loss(qwen, 0.0)["output_router_logits"] is False and with_router_aux_loss(qwen, None) is qwen
    with pytest.raises(SystemExit):
        parse(["train", "--help"])
    assert "--router-aux-loss-coef C" in capsys.readouterr().out    # the flag the warning names is offered

    no_flags = parse(["train"])
    assert collapse_remedy(no_flags, {**qwen, "output_router_logits": False}) == "--router-aux-loss-coef C (e.g. 1e-2)"
    assert collapse_remedy(no_flags, config) == "a larger --router-aux-loss-coef than 0.02"
    assert collapse_remedy(no_flags, deepseek) == "--router-bias-update-rate GAMMA (e.g. 1e-3)"
    assert collapse_remedy(parse(["train", "--router-bias-update-rate", "0.005"]), deepseek) == (
        "a larger --router-bias-update-rate than 0.005")

    check_router_aux_loss(deepseek, 0.0)   # off: nothing to refuse
    with pytest.raises(ValueError, match="a deepseek_v3 model has no router aux loss .* --router-bias-update-rate"):
        check_router_aux_loss(deepseek, 0.01)
    assert main(["train", "--steps", "1", "--router-aux-loss-coef", "-1"]) == 2
    assert error_line(capsys) == "--router-aux-loss-coef -1.0 must be >= 0 (0 turns the aux loss off)."
