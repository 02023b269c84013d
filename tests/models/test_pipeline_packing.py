"""Packed rows (`segment_ids`, positions restarting per document) through pipeline stages: each microbatch's
documents travel with it, so packed training through stages gives packed one-stage training's losses, gradients
and per-layer expert loads, for every attention kind (full, sliding window with sinks, chunked with NoPE layers,
latent); `moe-jax train --pp ... --pack` runs and its records carry `expert_load`."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import optax
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli import main
from moe_jax.tokenization import write_byte_tokenizer
from moe_jax.training import make_train_step
from moe_jax.training.loss import model_loss, predicted_tokens, prediction_targets

from ..heavy import representative
from ..inference.hf_generation import MODELS

ROWS, LENGTH = 4, 16


def packed_batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, segment_ids) [4, 16]: three documents of varying lengths per row, then 0-3 tokens of padding
    (documents longer than the fixtures' windows (4-5) and Llama 4's chunks (4))."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 128, (ROWS, LENGTH)).astype(np.int32)
    segments = np.zeros((ROWS, LENGTH), np.int32)
    for row in range(ROWS):
        first, second = sorted(rng.choice(np.arange(2, LENGTH - 4), 2, replace=False))
        segments[row, :first], segments[row, first:second], segments[row, second:LENGTH - row] = 1, 2, 3
    ids[segments == 0] = 0
    return ids, segments


def load(family: str, layout: dict | None = None, **options):
    config = None if layout is None else DistributedConfig(**layout)
    devices = jax.devices()[:1] if config is None else jax.devices()[:config.num_devices]
    return AutoModelForCausalLM.from_pretrained(MODELS / family, config, devices=devices, progress=False, **options)


def loss_and_grads(model, ids, segments):
    """(loss, its terms, every gradient under HF names) of the packed batch, training mode, largest capacity."""
    targets = prediction_targets(ids, segments)

    def loss(params):
        return model_loss(model, params, ids, None, targets, total_tokens=predicted_tokens(targets),
                          aux_weight=0.01, capacity=None, inference=False, step=model.apply, segment_ids=segments)

    (value, terms), grads = jax.value_and_grad(loss, has_aux=True)(model.params)
    return float(value), jax.device_get(terms), jax.device_get(dict(model.hf_params(grads)))


# One family per attention kind, each on a pp layout of its own (token dispatch, circular schedule over TP, ...);
# the suite runs Llama 4's (chunks restarting at each document, NoPE layers, two chunks per stage), --heavy all.
ATTENTION_KIND_CASES = [
    ("qwen3_moe", dict(pp_size=2, fsdp_size=2, ep_size=2), dict(pipeline_microbatches=2)),       # full
    ("gpt_oss", dict(pp_size=2), dict(pipeline_microbatches=4)),                         # sliding window, sinks
    ("llama4_text", dict(pp_size=2, tp_size=2), dict(pipeline_schedule="circular", pipeline_repeats=2)),  # chunks
    ("deepseek_v3", dict(pp_size=2, fsdp_size=2, ep_size=2), {}),                        # latent, a dense layer
]


@pytest.mark.parametrize("family, layout, options", representative(
    ATTENTION_KIND_CASES, suite=(), ids=[case[0] for case in ATTENTION_KIND_CASES]))   # the suite: the CLI's below
def test_packed_rows_through_stages_give_one_stage_s_loss_gradients_and_loads(family, layout, options):
    ids, segments = packed_batch()
    expected_loss, expected_terms, expected_grads = loss_and_grads(load(family), ids, segments)
    loss, terms, grads = loss_and_grads(load(family, layout, **options), ids, segments)
    assert abs(loss - expected_loss) <= 1e-6 * abs(expected_loss)
    np.testing.assert_allclose(float(terms["aux"]), float(expected_terms["aux"]), rtol=1e-6, atol=1e-7)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, expected_grads[name], rtol=0, atol=1e-6, err_msg=name)
    # Each sparse layer's load is counted in the stage that runs it: the one-stage counts, exactly.
    np.testing.assert_array_equal(np.asarray(terms["expert_load"]), np.asarray(expected_terms["expert_load"]))


# heavy: the suite's packed run through stages is the command below (its train step, records and expert_load); the
# gradients' equality is the test above
@pytest.mark.heavy
def test_packed_training_through_stages_follows_one_stage_and_reports_expert_load():
    """3 AdamW steps of the train step on packed batches (2 micro-batches of accumulation, each cut into 2 pipeline
    microbatches): the losses of one stage, and every step's metrics hold each sparse layer's expert load."""

    def run(model, **step_options):
        train_step = make_train_step(model, optax.adamw(3e-3), grad_clip=1.0, grad_accum=2, **step_options)
        state, losses, loads = train_step.init_state(), [], []
        for step in range(3):
            ids, segments = packed_batch(step)
            state, metrics = train_step(state, {"input_ids": ids, "segment_ids": segments})
            losses.append(float(metrics["loss"]))
            loads.append(np.asarray(metrics["expert_load"]))
        return losses, loads

    expected_losses, expected_loads = run(load("qwen3_moe"))
    losses, loads = run(load("qwen3_moe", dict(pp_size=2, tp_size=2)), pipeline_microbatches=2)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6, atol=0)
    for load_, expected in zip(loads, expected_loads, strict=True):
        np.testing.assert_array_equal(load_, expected)
    assert loads[0].shape == (2, 8) and loads[0].sum() == 2 * 2 * int((packed_batch(0)[1] > 0).sum())


def test_moe_jax_train_packs_a_corpus_through_stages(tmp_path):
    """The command that refused packing through stages: it trains, and its records carry the router panels'
    data (`expert_load` per sparse layer)."""
    pytest.importorskip("grain")
    model = tmp_path / "model"
    shutil.copytree(MODELS / "qwen3_moe", model)
    write_byte_tokenizer(model)
    words = ("moe", "jax", "expert", "token", "router", "layer", "page", "slot")
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.jsonl").write_text("\n".join(
        json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(2, 14))))}) for _ in range(60)))
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--model", str(model), "--data", str(tmp_path / "corpus.jsonl"), "--pack", "--seq-len",
                 "32", "--batch-size", "4", "--steps", "2", "--pp", "2", "--fsdp", "2", "--metrics-jsonl",
                 str(metrics), "--no-progress"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    for record in records:
        assert np.asarray(record["expert_load"]).shape == (2, 8)
        assert record["expert_load_layers"] == [1, 2]   # the fixture's layer 0 is dense
