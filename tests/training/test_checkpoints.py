"""Orbax train-state checkpoints: restore onto another layout, refuse another model's state, survive an
interrupted write, finish the last save of a script that ends. (Resume after a real SIGKILL of `moe-jax
train`: tests/training/test_train_job.py.)"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.cli.demo import DEMO_CONFIG
from moe_jax.training import TrainCheckpoints, TrainLoop, make_train_step
from moe_jax.training.state import ARRAY_FIELDS

from .conftest import FixtureBatches, reference_optimizer


def run(train_step, state, until_step, checkpoints=None, capacity_state=None):
    records = []
    loop = TrainLoop(train_step, FixtureBatches(), on_step=records.append,
                     should_save=checkpoints.should_save if checkpoints else None,
                     save=checkpoints.save if checkpoints else None)
    state, capacity_state = loop.run(state, until_step, capacity_state)
    return state, capacity_state, records


@pytest.mark.heavy   # scripts/checks/check_training_layouts.py resumes across layouts too
def test_a_state_saved_on_one_layout_resumes_on_another_with_the_same_next_losses(trainers, tmp_path):
    _, saving_step = trainers("tp2_fsdp4_ep4")
    checkpoints = TrainCheckpoints(tmp_path / "ckpt", saving_step.model, saving_step, save_every=3, keep=2)
    state, _, _ = run(saving_step, saving_step.init_state(), 3, checkpoints)
    checkpoints.wait()
    _, _, continued = run(saving_step, state, 5)

    _, restoring_step = trainers("hsdp2_fsdp2_tp2_ep2_all_reduce")
    restored, capacity_state = TrainCheckpoints(tmp_path / "ckpt", restoring_step.model, restoring_step).restore()
    assert int(restored.step) == 3 and int(restored.data_position) == 3
    assert restored.params["lm_head.weight"].sharding == restoring_step.shardings(restored.capacity).params[
        "lm_head.weight"]
    _, _, resumed = run(restoring_step, restored, 5, capacity_state=capacity_state)
    assert [r["step"] for r in resumed] == [4, 5]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in continued], rtol=1e-6)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_read(trainers, tmp_path):
    model, train_step = trainers("one_device")
    checkpoints = TrainCheckpoints(tmp_path, model, train_step)
    checkpoints.save(1, train_step.init_state(), None)
    checkpoints.close()
    other = AutoModelForCausalLM.from_config(DEMO_CONFIG, devices=jax.devices()[:1])
    other_step = make_train_step(other, reference_optimizer())
    with pytest.raises(ValueError, match="holds a train state of another model: parameter shapes differ"):
        TrainCheckpoints(tmp_path, other, other_step).restore()


def test_an_interrupted_write_leaves_the_last_complete_checkpoint(trainers, tmp_path):
    model, train_step = trainers("one_device")
    checkpoints = TrainCheckpoints(tmp_path, model, train_step, keep=3)
    state = train_step.init_state()
    checkpoints.save(2, state, None)
    checkpoints.close()
    # What a write killed half-way leaves: orbax's temporary directory, never renamed into place.
    shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp-1764500000000000")
    next(p for p in (tmp_path / "3.orbax-checkpoint-tmp-1764500000000000").rglob("*") if p.is_file()).write_bytes(b"")
    reopened = TrainCheckpoints(tmp_path, model, train_step)
    assert reopened.latest_step() == 2
    restored, _ = reopened.restore()
    for field in ARRAY_FIELDS:
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(getattr(restored, field)),
                     jax.device_get(getattr(state, field)))


ROOT = Path(__file__).resolve().parents[2]
TRAINING_GUIDE = ROOT / "docs" / "training.md"
# What docs/training.md's loop snippet leaves to the reader: a model and a data source.
SNIPPET_PRELUDE = """
import jax
from moe_jax import AutoModelForCausalLM
from tests.training.conftest import FixtureBatches
from tests.training.hf_training import CHECKPOINT

model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, devices=jax.devices()[:1], progress=False)
data = FixtureBatches()
"""
# After the snippet: a save nobody waits for, which the interpreter's exit must finish.
SNIPPET_EPILOGUE = """
TrainCheckpoints("late/", model, train_step).save(5, state, capacity)
"""


def guide_training_snippet() -> str:
    """docs/training.md's python block that trains with TrainCheckpoints, shortened to 4 steps saved every 2."""
    blocks = re.findall(r"```python\n(.*?)```", TRAINING_GUIDE.read_text(), flags=re.S)
    snippet = next(block for block in blocks if "TrainCheckpoints(" in block)
    assert "until_step=1000" in snippet and "save_every=100" in snippet
    return snippet.replace("until_step=1000", "until_step=4").replace("save_every=100", "save_every=2")


def complete_steps(directory: Path) -> list[int]:
    """The steps orbax finished in `directory`, after checking nothing else (a temporary step) is there."""
    names = sorted(path.name for path in directory.iterdir())
    assert all(name.isdigit() for name in names), names
    return [int(name) for name in names]


def test_the_guide_snippet_run_as_a_script_leaves_complete_checkpoints(tmp_path):
    """The last checkpoint of a script that ends right after training is complete (was: left as
    `4.orbax-checkpoint-tmp`, with orbax's "cannot schedule new futures" traceback at exit, exit code 0),
    and so is a save the script never waits for."""
    script = tmp_path / "train.py"
    script.write_text(SNIPPET_PRELUDE + guide_training_snippet() + SNIPPET_EPILOGUE)
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "cannot schedule" not in result.stderr, result.stderr[-3000:]
    assert complete_steps(tmp_path / "ckpt") == [2, 4] and complete_steps(tmp_path / "late") == [5]
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    assert manager.restore(4, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]["step"] == 4


class RandomBatches:
    def batch(self, index: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.random.default_rng(index).integers(0, 128, (8, 10)).astype(np.int32)}


# heavy: three layouts' train steps compiled; restoring onto another layout is in the suite above
@pytest.mark.heavy
def test_a_state_saved_with_pipeline_stages_resumes_on_other_stage_counts(tmp_path):
    """pp2 x fsdp2 x ep2 -> one device (scanned layers) -> pp4 x fsdp2: each restore restacks params and AdamW's
    moments into the new layer layout, and the losses go on as the uninterrupted pp2 run's."""
    from moe_jax import DistributedConfig
    from moe_jax.causal_lm import Qwen3MoeForCausalLM

    from ..models.hf_reference import TINY_QWEN3_MOE

    config = dict(TINY_QWEN3_MOE, num_hidden_layers=4)

    def trainer(layout):
        distributed = DistributedConfig(**layout)
        model = Qwen3MoeForCausalLM(config, distributed, devices=jax.devices()[:distributed.num_devices],
                                    scan_layers=True)
        model.init_params(seed=1)
        return make_train_step(model, reference_optimizer(), grad_clip=1.0)

    def losses(train_step, state, until, checkpoints=None, capacity_state=None):
        records = []
        loop = TrainLoop(train_step, RandomBatches(), on_step=records.append, checkpoints=checkpoints)
        state, capacity_state = loop.run(state, until, capacity_state)
        return state, [record["loss"] for record in records]

    staged = trainer(dict(pp_size=2, fsdp_size=2, ep_size=2))
    first = TrainCheckpoints(tmp_path / "pp2", staged.model, staged, save_every=2)
    state, _ = losses(staged, staged.init_state(), 2, first)
    _, expected = losses(staged, state, 4)

    one = trainer({})
    restored, _ = TrainCheckpoints(tmp_path / "pp2", one.model, one).restore()
    assert "model.layers.1-3.mlp.experts.gate_up_proj" in restored.params
    second = TrainCheckpoints(tmp_path / "pp1", one.model, one, save_every=3)
    _, resumed = losses(one, restored, 3, second)

    four = trainer(dict(pp_size=4, fsdp_size=2))
    restored, _ = TrainCheckpoints(tmp_path / "pp1", four.model, four).restore()
    assert int(restored.step) == 3
    _, resumed_again = losses(four, restored, 4)
    np.testing.assert_allclose(resumed + resumed_again, expected, rtol=1e-5)


def test_a_preempted_loop_saves_the_step_it_stops_at_and_a_resume_gives_the_uninterrupted_losses(trainers, tmp_path):
    """A signal during step 2 (`Preemption.request`, what the SIGTERM handler does): the loop dispatches nothing
    more, confirms the step in flight, saves the state of the last confirmed step and returns; resumed from that
    checkpoint, the next steps' losses are the uninterrupted run's."""
    import signal

    from moe_jax.training.preemption import Preemption

    model, train_step = trainers("one_device")
    _, _, uninterrupted = run(train_step, train_step.init_state(), 5)
    checkpoints = TrainCheckpoints(tmp_path, model, train_step, save_every=100)
    preemption = Preemption()
    records = []

    def on_step(record):
        records.append(record)
        if record["step"] == 2:
            preemption.request("SIGTERM")

    loop = TrainLoop(train_step, FixtureBatches(), on_step=on_step, checkpoints=checkpoints, preemption=preemption)
    with preemption:
        assert signal.getsignal(signal.SIGTERM) == preemption._handle
        state, _ = loop.run(train_step.init_state(), 5)
    assert signal.getsignal(signal.SIGTERM) != preemption._handle          # the handlers are given back
    stopped = int(state.step)
    assert loop.preempted_at == stopped and stopped in (2, 3)               # the step in flight is confirmed
    assert checkpoints.latest_step() == stopped and [r["step"] for r in records] == list(range(1, stopped + 1))
    restored, capacity_state = TrainCheckpoints(tmp_path, model, train_step).restore()
    _, _, resumed = run(train_step, restored, 5, capacity_state=capacity_state)
    np.testing.assert_allclose([r["loss"] for r in records + resumed], [r["loss"] for r in uninterrupted],
                               rtol=1e-6)


def test_the_record_after_a_save_says_how_long_the_loop_waited_in_it(trainers, tmp_path):
    model, train_step = trainers("one_device")
    checkpoints = TrainCheckpoints(tmp_path, model, train_step, save_every=2)
    _, _, records = run(train_step, train_step.init_state(), 4, checkpoints)
    checkpoints.wait()
    assert [r["step"] for r in records if "save_wait_s" in r] == [3] and records[2]["save_wait_s"] > 0
