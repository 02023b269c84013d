"""scripts/nnx_train_example.py, the NNX loop of docs/training.md, runs end to end: it trains, replays what overflowed,
and writes an orbax NNX state that restores and an HF checkpoint that loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import chex
import jax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import moe_jax
import moe_jax.nnx

from ..training.hf_training import CHECKPOINT

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nnx_train_example.py"


def load_script():
    spec = importlib.util.spec_from_file_location("nnx_train_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# heavy: the example script end to end; the NNX module's steps are the suite's in tests/nnx
@pytest.mark.heavy
def test_the_example_trains_and_writes_a_restorable_state_and_an_hf_checkpoint(tmp_path, capsys):
    out = tmp_path / "out"
    assert load_script().main(["--model", str(CHECKPOINT), "--steps", "2", "--fsdp", "2", "--ep", "2",
                               "--batch-size", "4", "--seq-len", "8", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step 1: loss" in printed and "step 2: loss" in printed

    exported = moe_jax.AutoModelForCausalLM.from_pretrained(out / "hf", devices=jax.devices()[:1], progress=False)
    abstract = nnx.eval_shape(lambda: moe_jax.nnx.AutoModelForCausalLM.from_config(
        CHECKPOINT, moe_jax.DistributedConfig(fsdp_size=2, ep_size=2), devices=jax.devices()[:2]))
    graphdef, target = nnx.split(abstract)
    restored = nnx.merge(graphdef, ocp.StandardCheckpointer().restore(out / "nnx_state", target))
    chex.assert_trees_all_equal(jax.device_get(restored.weights()), jax.device_get(exported.params))


def test_a_used_output_directory_is_refused(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        load_script().main(["--model", str(CHECKPOINT), "--output-dir", str(tmp_path / "taken")])
    assert exit_.value.code == 2
