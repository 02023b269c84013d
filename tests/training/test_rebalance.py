"""Redundant expert slots in training: the placement is an input of the train step held in its state (re-placing
compiles nothing), `TrainLoop(rebalance_every=N)` re-places from the last N steps' expert load (the latest weighing
most) and the next batch's, and a checkpoint resumes placement and load window bit-exactly; the command line's
flags and errors (serving's re-placement: tests/distributed/test_redundant_experts.py)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli import main
from moe_jax.distributed.eplb import balanced_placement, better_placement, expected_rank_load, identity_placement
from moe_jax.distributed.placement_search import replacement, searched_placement
from moe_jax.training import make_train_step
from moe_jax.training.checkpoints import TrainCheckpoints
from moe_jax.training.loop import TrainLoop
from moe_jax.training.step import LOAD_WINDOW_DECAY

from ..distributed.test_redundant_experts import imbalance, skewed_batch
from ..models.test_apply import count_compilations
from ..test_cli_errors import error_line
from .hf_training import CHECKPOINT


class SkewedBatches:
    """Batch i: 8 rows of 16 tokens, half of them one repeated token (which one moves with i)."""

    def batch(self, index: int) -> dict[str, np.ndarray]:
        ids = np.random.default_rng(index).integers(0, 128, (8, 16)).astype(np.int32)
        ids[:4] = 75 + index % 3
        return {"input_ids": ids}


def test_rebalancing_compiles_nothing_and_a_resume_continues_bit_exactly(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False, num_redundant_experts=8)
    train_step = make_train_step(model, optax.adamw(1e-3))
    checkpoints = TrainCheckpoints(tmp_path, model, train_step, save_every=2, async_save=False)
    records = []
    loop = TrainLoop(train_step, SkewedBatches(), checkpoints=checkpoints, rebalance_every=2,
                     on_step=records.append)
    # At the largest capacity nothing overflows: one program, whatever the placement does to the buffers.
    state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
    assert state.expert_placement is not None and state.expert_load_window.shape == (2, 8)
    with count_compilations("_step") as compiled, count_compilations("_load") as probes:
        final, _ = loop.run(state, 4)
    assert compiled[0] == len(train_step._compiled) == 1      # re-placing compiled nothing
    assert probes[0] == 1                                     # the next batch's forward pass: once
    assert [record.get("rebalanced", False) for record in records] == [False, True, False, True]
    replicas = np.asarray(final.expert_placement.replica_count)
    assert (replicas != 1).any() and (replicas.sum(1) == 16).all()          # replicas went to the busy experts
    np.testing.assert_array_equal(model.expert_placement.physical_to_logical, final.expert_placement.physical_to_logical)
    assert not np.asarray(final.expert_load_window).any()                    # zeroed by the last re-placement

    resumed, capacity_state = checkpoints.restore(2)
    # The state after step 2 runs the placement for two loads: steps 1 and 2's (the latest weighing most) and
    # step 3's batch under the parameters after step 2, which is the load step 3 then reports.
    window = np.add(np.multiply(records[0]["expert_load"], LOAD_WINDOW_DECAY), records[1]["expert_load"])
    loads = np.stack([window, records[2]["expert_load"]])
    np.testing.assert_array_equal(resumed.expert_placement.physical_to_logical,
                                  searched_placement(loads, num_redundant_experts=8, ep_size=8).physical_to_logical)
    again, _ = TrainLoop(train_step, SkewedBatches(), rebalance_every=2).run(resumed, 4, capacity_state)
    jax.tree.map(np.testing.assert_array_equal, again.arrays(), final.arrays())


class RepeatedBatch:
    """One skewed batch every step: tests/distributed/test_redundant_experts.py's (half the rows one token)."""

    def __init__(self):
        self.ids = skewed_batch(128)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.ids}


def test_a_training_window_places_as_the_forward_does_and_never_worse_on_an_unchanged_load():
    """At rate 0 on one repeated batch the load stays put: the first re-placement (from 2 steps under the identity)
    is the forward's searched placement of that batch, whose busiest rank the following steps run, and later
    re-placements (from windows under that placement: logical expert ids) keep it."""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False, num_redundant_experts=8)
    data = RepeatedBatch()
    forward = model.apply(model.params, data.ids)
    placement = searched_placement(forward.expert_load, num_redundant_experts=8, ep_size=8)
    balanced = model.apply(model.params, data.ids, expert_placement=placement)
    train_step = make_train_step(model, optax.sgd(0.0))
    records = []
    state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
    final, _ = TrainLoop(train_step, data, rebalance_every=2, on_step=records.append).run(state, 6)
    for record in records:
        np.testing.assert_array_equal(record["expert_load"], forward.expert_load)
    shares = np.array([imbalance(record["ep_rank_load"]) for record in records])     # [steps, sparse layers]
    np.testing.assert_array_equal(records[0]["ep_rank_load"], forward.ep_rank_load)
    for record in records[2:]:
        np.testing.assert_array_equal(record["ep_rank_load"], balanced.ep_rank_load)
    assert (shares[0] > 1.4).all() and (shares[2:] <= 1.3).all(), shares     # identity: 1.52, 1.64
    assert (np.diff(shares, axis=0) <= 0).all(), shares
    np.testing.assert_array_equal(final.expert_placement.physical_to_logical, placement.physical_to_logical)


class StationarySkew:
    """Batch i: 8 rows of 64 fresh random tokens, 3 in 4 of them one token: the skew stays, the batches change."""

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(100 + index)
        ids = rng.integers(0, 128, (8, 64))
        ids[rng.random(ids.shape) < 0.75] = 75
        return {"input_ids": ids.astype(np.int32)}


def run_at_rate_zero(model, data, steps: int, **loop_options) -> tuple[np.ndarray, list[np.ndarray], list[dict]]:
    """(busiest shares [steps, sparse layers], each step's expert_load, the records) of `steps` SGD steps at rate 0
    (the router stays) from the identity placement, under `TrainLoop(**loop_options)`."""
    model.set_expert_placement(model.identity_expert_placement())    # the state starts at the model's
    train_step = make_train_step(model, optax.sgd(0.0))
    records = []
    state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
    TrainLoop(train_step, data, on_step=records.append, **loop_options).run(state, steps)
    shares = np.array([imbalance(record["ep_rank_load"]) for record in records])
    return shares, [np.asarray(record["expert_load"], np.float64) for record in records], records


def test_a_stationary_skew_runs_within_1_3_of_the_mean_rank_after_the_first_re_placement():
    """Rate 0 (the router stays) on changing batches of one skew: every step after the first re-placement has every
    layer's busiest rank within 1.3x the mean, each step as its placement predicts; EPLB's placements of the same
    windows leave steps above 1.3x (two hot experts' extra replicas sharing ranks)."""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False, num_redundant_experts=8)
    shares, loads, _ = run_at_rate_zero(model, StationarySkew(), 6, rebalance_every=2)
    layers, experts = loads[0].shape
    placements = {"searched": identity_placement(layers, experts, num_redundant_experts=8, ep_size=8)}
    placements["eplb"] = placements["searched"]
    predicted = {name: [] for name in placements}
    window = np.zeros((layers, experts))
    for step, load in enumerate(loads, start=1):
        for name, placement in placements.items():
            predicted[name].append(imbalance(expected_rank_load(placement, load, 8)))
        window = window * LOAD_WINDOW_DECAY + load
        if step % 2 == 0:     # the loop's rule: the window and the next step's load (the probe's)
            served = np.stack([window, loads[step]]) if step < len(loads) else window
            placements["searched"] = replacement(placements["searched"], served, num_redundant_experts=8, ep_size=8)
            proposed = balanced_placement(window, num_redundant_experts=8, ep_size=8)
            placements["eplb"] = better_placement(placements["eplb"], proposed, window, 8)
            window = np.zeros_like(window)
    assert (shares[:2] > 1.5).all() and (shares[2:] <= 1.3).all(), shares
    # The placement each step ran, as predicted (each replica an even share of its expert's pairs: spread_replicas).
    np.testing.assert_allclose(shares, predicted["searched"], atol=0.02)
    assert np.asarray(predicted["eplb"])[2:].max() > 1.3, predicted["eplb"]


class MovingSkew:
    """Batch i: 8 rows of 64 fresh random tokens, 3 in 4 of them one token that changes with i (75, 33, 101, ...):
    the hot token, and the experts it routes to, move every step."""

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(100 + index)
        ids = rng.integers(0, 128, (8, 64))
        ids[rng.random(ids.shape) < 0.75] = (75, 33, 101)[index % 3]
        return {"input_ids": ids.astype(np.int32)}


def test_each_step_after_a_re_placement_runs_a_placement_of_its_own_load_where_the_window_points_elsewhere():
    """Rate 0 on a skew that moves every step, re-placed every step: the window (the step before) names the wrong
    experts, the next batch's load under the parameters (`load_probe`) the right ones. Every step after the first
    runs within 1.3x of the mean rank; placements from the window alone leave every one of them above 3x."""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False, num_redundant_experts=8)
    shares, loads, _ = run_at_rate_zero(model, MovingSkew(), 6, rebalance_every=1)
    window_only = identity_placement(2, 8, num_redundant_experts=8, ep_size=8)
    replayed = []
    for load in loads:
        replayed.append(imbalance(expected_rank_load(window_only, load, 8)))
        window_only = replacement(window_only, load, num_redundant_experts=8, ep_size=8)
    assert (shares[0] > 1.5).all() and (shares[1:] <= 1.3).all(), shares
    assert (np.asarray(replayed)[1:] > 3).all(), replayed


def test_a_lookahead_of_the_whole_interval_serves_every_step_until_the_next_re_placement():
    """Re-placed every 3 steps on the moving skew (3 hot tokens in turn): one batch measured leaves the two steps
    after it on a window that names other experts (over 3x). All 3 measured (`rebalance_lookahead=3`; the router
    stays, so those are the loads the steps then have): every step runs the placement searched for the window and
    the three loads together, as predicted; three skews that 16 slots cannot all serve within 1.3x, none above 1.8x."""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False, num_redundant_experts=8)
    shares, loads = {}, None
    for lookahead in (1, 3):
        shares[lookahead], loads, records = run_at_rate_zero(model, MovingSkew(), 9, rebalance_every=3,
                                                             rebalance_lookahead=lookahead)
        assert all(record["rebalance_s"] > 0 for record in records if record.get("rebalanced"))
    placement, predicted = identity_placement(2, 8, num_redundant_experts=8, ep_size=8), []
    for step, load in enumerate(loads):
        if step and step % 3 == 0:
            window = loads[step - 3] * LOAD_WINDOW_DECAY ** 2 + loads[step - 2] * LOAD_WINDOW_DECAY + loads[step - 1]
            placement = replacement(placement, np.stack([window, *loads[step:step + 3]]), num_redundant_experts=8,
                                    ep_size=8)
        predicted.append(imbalance(expected_rank_load(placement, load, 8)))
    np.testing.assert_allclose(shares[3], predicted, atol=0.02)
    np.testing.assert_array_equal(shares[1][:3], shares[3][:3])
    assert shares[1][3:].max() > 3 and shares[3][3:].max() < 1.8, shares
    train_step = make_train_step(model, optax.sgd(0.0))
    with pytest.raises(ValueError, match=r"rebalance_lookahead=0 must be >= 1"):
        TrainLoop(train_step, MovingSkew(), rebalance_every=3, rebalance_lookahead=0)
    with pytest.raises(ValueError, match=r"rebalance_lookahead=4 would measure batches past the next re-placement "
                                         r"\(rebalance_every=3\): use at most 3"):
        TrainLoop(train_step, MovingSkew(), rebalance_every=3, rebalance_lookahead=4)


def test_rebalancing_needs_redundant_slots(capsys):
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, devices=jax.devices()[:1], progress=False)
    with pytest.raises(ValueError, match="re-places experts into redundant expert slots, and this model has none"):
        TrainLoop(make_train_step(model, optax.sgd(1e-3)), SkewedBatches(), rebalance_every=2)
    assert main(["train", "--steps", "1", "--rebalance-every", "2"]) == 2
    assert error_line(capsys) == ("--rebalance-every re-places experts into redundant expert slots: pass "
                                  "--num-redundant-experts R (R > 0, with --ep > 1) too.")
    assert main(["train", "--steps", "1", "--rebalance-lookahead", "2"]) == 2
    assert error_line(capsys) == ("--rebalance-lookahead sets what each re-placement measures: pass "
                                  "--rebalance-every N too.")
    assert main(["train", "--steps", "1", "--rebalance-every", "2", "--num-redundant-experts", "8",
                 "--rebalance-lookahead", "0"]) == 2
    assert "--rebalance-lookahead 0 must be >= 1" in error_line(capsys)
    assert main(["train", "--steps", "1", "--rebalance-every", "2", "--num-redundant-experts", "8",
                 "--rebalance-lookahead", "3"]) == 2
    assert "--rebalance-lookahead 3 would measure batches past the next re-placement" in error_line(capsys)
    assert main(["train", "--steps", "1", "--num-redundant-experts", "2", "--no-progress"]) == 2
    assert "ep_size=1: every device already holds every expert" in error_line(capsys)
    assert main(["serve", "--model", str(CHECKPOINT), "--rebalance-every", "5"]) == 2   # engine steps there
    assert error_line(capsys).startswith("--rebalance-every re-places experts into redundant expert slots")


def test_rebalancing_every_3_steps_trains_the_same_losses_as_the_identity_placement():
    """Re-placing moves work between ranks, not math: 10 SGD steps re-placed every 3 give the losses of the same
    model kept on the identity placement, up to float32 summation order."""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False, num_redundant_experts=8)
    train_step = make_train_step(model, optax.sgd(0.1))
    losses = {}
    for every in (None, 3):
        records = []
        model.set_expert_placement(model.identity_expert_placement())
        state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
        TrainLoop(train_step, SkewedBatches(), rebalance_every=every, on_step=records.append).run(state, 10)
        losses[every] = [record["loss"] for record in records]
        assert [record.get("rebalanced", False) for record in records] == [
            every is not None and step % 3 == 0 for step in range(1, 11)]
    assert (np.asarray(model.expert_placement.replica_count) != 2).any()     # the last re-placement's, not identity
    np.testing.assert_allclose(losses[3], losses[None], rtol=1e-5)
    assert losses[None][-1] < losses[None][0]
