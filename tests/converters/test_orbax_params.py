"""Orbax parameter checkpoints: saved on one layout, restored bit-identically onto another; strict and atomic."""

import json

import numpy as np
import pytest

import converters.orbax_params as orbax_params
from converters import CheckpointMismatchError
from converters.orbax_params import (
    nest_names,
    read_orbax_config,
    restore_orbax_params,
    save_orbax_params,
    stored_shapes,
)
from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.pretrained import saved_config
from tests.models.hf_reference import TINY_QWEN3_MOE

from .tiny_checkpoints import read_checkpoint, same_bits

CONFIG = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe"}
SAVING_LAYOUT = dict(fsdp_size=8, ep_size=8)
RESTORING_LAYOUT = dict(tp_size=2, fsdp_size=4, ep_size=4)
HSDP_LAYOUT = dict(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=2)
EXPERTS = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE written by moe_jax itself (init_params + save_pretrained)."""
    directory = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    model = AutoModelForCausalLM.from_config(CONFIG)
    model.init_params(seed=3)
    model.save_pretrained(directory, progress=False)
    return directory


@pytest.fixture(scope="module")
def saved(hf_checkpoint, tmp_path_factory):
    """(model on the saving layout, its orbax checkpoint directory)."""
    model = AutoModelForCausalLM.from_pretrained(hf_checkpoint, DistributedConfig(**SAVING_LAYOUT), progress=False)
    directory = tmp_path_factory.mktemp("orbax") / "ckpt"
    save_orbax_params(model.params, directory, config=saved_config(model))
    return model, directory


def restoring_model(layout=RESTORING_LAYOUT, **overrides):
    return AutoModelForCausalLM.from_config({**CONFIG, **overrides}, DistributedConfig(**layout))


def assert_every_shard_holds_its_slice(array, expected: np.ndarray, name: str) -> None:
    """Each device's block equals `expected` at the block's index. `np.asarray(array)` would read one
    replica per block only, so a wrong HSDP replica would go unseen."""
    for shard in array.addressable_shards:
        assert same_bits(np.asarray(shard.data), expected[shard.index]), f"{name} on {shard.device}"


@pytest.mark.parametrize("layout", [RESTORING_LAYOUT, HSDP_LAYOUT], ids=["tp2-fsdp4-ep4", "hsdp-r2-fsdp2-tp2-ep2"])
def test_restore_onto_another_layout_is_bit_identical_and_in_the_new_shardings(saved, layout):
    source, directory = saved
    model = restoring_model(layout)
    shardings = model.named_shardings()
    assert shardings[EXPERTS] != source.named_shardings()[EXPERTS]  # the layouts really differ

    restored = restore_orbax_params(directory, model)

    assert list(restored) == [name for name, _ in model.module_tree.named_parameters()]
    for name, array in restored.items():
        assert array.sharding == shardings[name], name
        assert_every_shard_holds_its_slice(array, np.asarray(source.params[name]), name)


def test_orbax_to_hf_round_trip_is_bit_identical_to_the_original_safetensors(saved, hf_checkpoint, tmp_path):
    _, directory = saved
    model = restoring_model()
    model.set_params(restore_orbax_params(directory, model))
    model.save_pretrained(tmp_path / "hf", progress=False)

    original, round_trip = read_checkpoint(hf_checkpoint), read_checkpoint(tmp_path / "hf")
    assert sorted(round_trip) == sorted(original)
    for key in original:
        assert same_bits(round_trip[key], original[key]), key
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (hf_checkpoint / "config.json").read_text())


def test_directory_holds_config_and_arrays_named_by_their_hf_names(saved):
    source, directory = saved
    assert sorted(path.name for path in directory.iterdir()) == ["config.json", "params"]
    assert read_orbax_config(directory) == saved_config(source)
    assert stored_shapes(directory / "params") == {
        name: tuple(array.shape) for name, array in source.params.items()
    }
    assert not [path for path in directory.parent.iterdir() if path.name != "ckpt"]  # no staging left behind


def test_restore_casts_to_the_model_dtype(saved):
    import jax.numpy as jnp

    source, directory = saved
    model = AutoModelForCausalLM.from_config(CONFIG, DistributedConfig(**RESTORING_LAYOUT), dtype=jnp.bfloat16)
    restored = restore_orbax_params(directory, model)
    assert restored[EXPERTS].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored[EXPERTS]),
                                  np.asarray(source.params[EXPERTS].astype(jnp.bfloat16)))


@pytest.mark.parametrize("problem", ["missing", "unexpected", "shape"])
def test_mismatched_checkpoints_are_refused_naming_the_parameter(saved, tmp_path, problem):
    source, _ = saved
    params = dict(source.params)
    if problem == "missing":
        del params["model.norm.weight"]
    elif problem == "unexpected":
        params["model.extra.weight"] = np.zeros(3, np.float32)
    else:
        params["model.norm.weight"] = np.ones(5, np.float32)
    save_orbax_params(params, tmp_path / "bad", config=CONFIG)

    with pytest.raises(CheckpointMismatchError) as caught:
        restore_orbax_params(tmp_path / "bad", restoring_model())
    error = caught.value
    if problem == "missing":
        assert error.missing == ["model.norm.weight"] and not error.unexpected and not error.shape_mismatches
    elif problem == "unexpected":
        assert error.unexpected == ["model.extra.weight"] and not error.missing
    else:
        assert error.shape_mismatches == ["model.norm.weight: checkpoint (5,) != declared (32,)"]
    assert ("model.extra.weight" if problem == "unexpected" else "model.norm.weight") in str(error)


def test_a_non_empty_destination_is_refused_and_left_alone(saved, tmp_path):
    source, _ = saved
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="taken already exists and is not an empty directory"):
        save_orbax_params(source.params, tmp_path / "taken", config=CONFIG)
    assert [path.name for path in (tmp_path / "taken").iterdir()] == ["notes.txt"]

    (tmp_path / "empty").mkdir()
    save_orbax_params(source.params, tmp_path / "empty", config=CONFIG)
    assert (tmp_path / "empty" / "config.json").is_file()


def test_a_failed_save_leaves_neither_destination_nor_staging(saved, tmp_path, monkeypatch):
    source, _ = saved

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(orbax_params, "_write_config", fail)
    with pytest.raises(OSError, match="disk full"):
        save_orbax_params(source.params, tmp_path / "ckpt", config=CONFIG)
    assert list(tmp_path.iterdir()) == []


def test_missing_config_json_is_reported(saved, tmp_path):
    (tmp_path / "params").mkdir()
    with pytest.raises(FileNotFoundError, match="No config.json in .* not an orbax parameter checkpoint"):
        read_orbax_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="No config.json"):
        restore_orbax_params(tmp_path, restoring_model())


def test_config_must_name_its_model_and_match_the_restoring_model(saved, tmp_path):
    source, _ = saved
    with pytest.raises(ValueError, match="'model_type'"):
        save_orbax_params(source.params, tmp_path / "anonymous", config={"hidden_size": 32})
    assert not (tmp_path / "anonymous").exists()

    save_orbax_params(source.params, tmp_path / "mixtral", config={**CONFIG, "model_type": "mixtral"})
    with pytest.raises(ValueError, match="model_type='mixtral' checkpoint, but the model is Qwen3MoeForCausalLM"):
        restore_orbax_params(tmp_path / "mixtral", restoring_model())


def test_an_abstract_model_cannot_be_restored_onto(saved):
    _, directory = saved
    model = AutoModelForCausalLM.from_config(CONFIG, DistributedConfig(**RESTORING_LAYOUT), abstract=True)
    with pytest.raises(ValueError, match="abstract=True"):
        restore_orbax_params(directory, model)


def test_names_are_nested_on_dots_and_must_form_a_tree():
    assert nest_names({"a.b.c": 1, "a.d": 2}) == {"a": {"b": {"c": 1}, "d": 2}}
    with pytest.raises(ValueError, match="'a.b' is also the parent of 'a.b.c'"):
        nest_names({"a.b": 1, "a.b.c": 2})
    with pytest.raises(ValueError, match="'a.b' is also the parent of other parameters"):
        nest_names({"a.b.c": 1, "a.b": 2})
    with pytest.raises(ValueError, match="empty part"):
        nest_names({"a..b": 1})
