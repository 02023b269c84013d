"""The multi-token-prediction loss (`moe_jax.training.mtp_loss`) on a tiny DeepSeek-V3 checkpoint with two MTP
layers: the step's loss is the main loss plus coef times the mean of the depths' cross entropies computed here
from the model's logits, and every MTP parameter (its own embedding and shared head included) is trained."""

import jax
import numpy as np
import optax
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.causal_lm import DeepseekV3ForCausalLM
from moe_jax.cli import main
from moe_jax.training import make_train_step
from moe_jax.training.mtp_loss import mtp_targets
from tests.models.hf_reference import TINY_DEEPSEEK_V3
from tests.models.mtp_checkpoints import MTP_LAYERS, write_mtp_checkpoint
from tests.test_cli_errors import error_line

COEF = 0.3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp("mtp") / "deepseek_v3"
    write_mtp_checkpoint(directory)
    return AutoModelForCausalLM.from_pretrained(directory, progress=False, devices=jax.devices()[:1])


def cross_entropy(logits: np.ndarray, targets: dict[tuple[int, int], int]) -> float:
    """Mean over the (row, position) -> token pairs of -log softmax(logits[row, position])[token]."""
    logits = logits.astype(np.float64)
    losses = [np.log(np.exp(logits[b, i] - logits[b, i].max()).sum()) + logits[b, i].max() - logits[b, i, token]
              for (b, i), token in targets.items()]
    return float(np.mean(losses))


def test_depth_targets_shift_by_the_depth_and_never_cross_padding_or_documents():
    targets = np.array([[5, 6, 7, 8, -100], [9, 10, -100, 11, -100]])
    segments = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 2, 2]])
    np.testing.assert_array_equal(mtp_targets(targets, segments, 1), [[6, 7, 8, -100, -100],
                                                                      [10, -100, -100, -100, -100]])
    right_padded = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(mtp_targets(targets, right_padded, 2), [[7, -100, -100, -100, -100],
                                                                          [-100, 11, -100, -100, -100]])


def test_the_step_adds_the_mean_depth_loss_and_trains_every_mtp_parameter(model):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY_DEEPSEEK_V3["vocab_size"], (2, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0                                                     # right padding
    output = model.apply(model.params, ids, attention_mask=mask, return_mtp_logits=True)
    logits, mtp_logits = np.asarray(output.logits), np.asarray(output.mtp_logits)
    sequence = ids.shape[1]

    def predicted(shift):   # position i -> token i + shift, both real
        return {(b, i): ids[b, i + shift] for b in range(2) for i in range(sequence - shift)
                if mask[b, i] and mask[b, i + shift]}

    main = cross_entropy(logits, predicted(1))
    depths = [cross_entropy(mtp_logits[k - 1], predicted(k + 1)) for k in range(1, MTP_LAYERS + 1)]

    train_step = make_train_step(model, optax.sgd(1.0), mtp_loss_coef=COEF)
    state = train_step.init_state()
    state, metrics = train_step(state, {"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(float(metrics["ce_loss"]), main, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["mtp_loss"]), np.mean(depths), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), main + COEF * np.mean(depths), rtol=1e-5)
    layers = [f"model.layers.{TINY_DEEPSEEK_V3['num_hidden_layers'] + depth}." for depth in range(MTP_LAYERS)]
    trained = {name for name in model.params if name.startswith(tuple(layers))
               and not name.endswith("e_score_correction_bias")}   # a buffer: never trained
    assert {f"{layers[0]}embed_tokens.weight", f"{layers[1]}shared_head.head.weight"} <= trained
    unchanged = [name for name in sorted(trained)
                 if np.array_equal(np.asarray(state.params[name]), np.asarray(model.params[name]))]
    assert not unchanged


def test_a_model_without_mtp_layers_refuses_the_mtp_loss():
    model = DeepseekV3ForCausalLM(TINY_DEEPSEEK_V3, devices=jax.devices()[:1])   # num_nextn_predict_layers 1
    assert model.mtp_layers == 0
    with pytest.raises(ValueError, match=r"mtp_loss_coef=0.5 trains multi-token-prediction layers, which this "
                                         r"deepseek_v3 model does not hold.*or train with mtp_loss_coef=0"):
        make_train_step(model, optax.sgd(1.0), mtp_loss_coef=0.5)
    with pytest.raises(ValueError, match="mtp_loss_coef=-1.0 must be >= 0"):
        make_train_step(model, optax.sgd(1.0), mtp_loss_coef=-1)


def test_train_refuses_the_flag_for_a_model_without_mtp_layers(capsys):
    assert main(["train", "--steps", "1", "--mtp-loss-coef", "0.1", "--no-progress"]) == 2
    assert error_line(capsys).startswith("mtp_loss_coef=0.1 trains multi-token-prediction layers, which this ")
    assert main(["train", "--steps", "1", "--mtp-loss-coef", "-1"]) == 2
    assert error_line(capsys) == "--mtp-loss-coef -1.0 must be >= 0 (0 turns it off)."
