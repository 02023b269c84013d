"""Exporting moe_jax parameters to hub-layout checkpoints: bit-identical round trips, shards, atomicity."""

import json
import os

import jax
import numpy as np
import pytest

import converters.export as export_module
from converters import KeyMap, KeyRule, load_params, save_params
from converters.key_maps import KEY_MAPS
from converters.safetensors_io import read_header

from .tiny_checkpoints import (
    BFLOAT16,
    MIXTRAL_CONFIG,
    QWEN3_CONFIG,
    ScaleFromInt8,
    mixtral_hub_tensors,
    mixtral_tree,
    qwen3_hub_tensors,
    qwen3_tree,
    random_params,
    read_checkpoint,
    same_bits,
    shardings_for,
    write_checkpoint,
)


def assert_same_checkpoint_tensors(directory_a, directory_b):
    a, b = read_checkpoint(directory_a), read_checkpoint(directory_b)
    assert sorted(a) == sorted(b)
    for key in a:
        assert same_bits(a[key], b[key]), key


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
def test_hub_to_moe_jax_to_hub_is_bit_identical(tmp_path, dtype):
    tree = qwen3_tree(np.dtype(dtype).name)
    hub = qwen3_hub_tensors(random_params(tree))
    write_checkpoint(tmp_path / "hub", hub, max_shard_bytes=16_000)
    params = load_params(tmp_path / "hub", tree, "qwen3_moe", progress=False)
    save_params(params, "qwen3_moe", tmp_path / "out", config={"model_type": "qwen3_moe"},
                max_shard_bytes=16_000, progress=False)
    assert_same_checkpoint_tensors(tmp_path / "hub", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "qwen3_moe"}
    # The export loads back to the same parameters.
    again = load_params(tmp_path / "out", tree, "qwen3_moe", progress=False)
    for name in params:
        assert same_bits(np.asarray(again[name]), np.asarray(params[name]))


def test_mixtral_round_trip_keeps_block_sparse_moe_names(tmp_path):
    tree = mixtral_tree()
    write_checkpoint(tmp_path / "hub", mixtral_hub_tensors(random_params(tree)))
    params = load_params(tmp_path / "hub", tree, "mixtral", progress=False)
    save_params(params, "mixtral", tmp_path / "out", config={"model_type": "mixtral"}, progress=False)
    assert_same_checkpoint_tensors(tmp_path / "hub", tmp_path / "out")


def test_export_of_ep8_sharded_params_gathers_each_parameter(tmp_path):
    tree, shardings = shardings_for(8, fsdp_size=8, ep_size=8)
    hub = qwen3_hub_tensors(random_params(tree))
    write_checkpoint(tmp_path / "hub", hub)
    params = load_params(tmp_path / "hub", tree, "qwen3_moe", shardings, progress=False)
    assert len(params["model.layers.1.mlp.experts.gate_up_proj"].sharding.device_set) == 8
    save_params(params, "qwen3_moe", tmp_path / "out", config={}, progress=False)
    assert_same_checkpoint_tensors(tmp_path / "hub", tmp_path / "out")


def test_shards_respect_the_size_limit_and_the_index_lists_every_key(tmp_path):
    tree = qwen3_tree()
    params = random_params(tree)
    limit = 10_000
    save_params(params, "qwen3_moe", tmp_path / "out", config={}, max_shard_bytes=limit, progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shard_names = sorted(set(index["weight_map"].values()))
    assert shard_names == [f"model-{i:05d}-of-{len(shard_names):05d}.safetensors" for i in range(1, len(shard_names) + 1)]
    sizes = {}
    for name in shard_names:
        header = read_header(tmp_path / "out" / name)
        assert {key for key, file in index["weight_map"].items() if file == name} == set(header)
        sizes[name] = sum(info.nbytes for info in header.values())
    largest_tensor = max(value.nbytes for value in qwen3_hub_tensors(params).values())
    assert all(size <= max(limit, largest_tensor) for size in sizes.values())
    assert index["metadata"]["total_size"] == sum(value.nbytes for value in params.values())
    assert index["weight_map"] == dict(sorted(index["weight_map"].items()))


def test_everything_in_one_shard_is_a_single_model_safetensors(tmp_path):
    params = random_params(qwen3_tree())
    save_params(params, "qwen3_moe", tmp_path / "out", config={}, progress=False)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]


def test_a_failure_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    params = random_params(qwen3_tree())
    calls = []

    def gather_then_fail(array):
        calls.append(1)
        if len(calls) == 20:
            raise OSError("disk full (injected)")
        return np.asarray(jax.device_get(array))

    monkeypatch.setattr(export_module, "gather_to_host", gather_then_fail)
    with pytest.raises(OSError, match="injected"):
        save_params(params, "qwen3_moe", tmp_path / "out", config={}, max_shard_bytes=10_000, progress=False)
    assert len(calls) == 20  # several shards had been written when it failed
    assert os.listdir(tmp_path) == []  # no out/, no staging directory

    (tmp_path / "out").mkdir()  # an empty destination survives a failure as it was
    with pytest.raises(OSError, match="injected"):
        calls.clear()
        save_params(params, "qwen3_moe", tmp_path / "out", config={}, max_shard_bytes=10_000, progress=False)
    assert os.listdir(tmp_path) == ["out"] and os.listdir(tmp_path / "out") == []


def test_existing_files_are_never_overwritten(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="choose a new directory"):
        save_params(random_params(qwen3_tree()), "qwen3_moe", tmp_path / "out", config={}, progress=False)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_bad_inputs_fail_before_writing(tmp_path):
    params = random_params(qwen3_tree())
    one_way = KeyMap("toy", (KeyRule(param="lm_head.weight", hub=("lm_head.qweight",), transforms=(ScaleFromInt8(),)),))
    with pytest.raises(TypeError, match="one-way"):
        save_params(params, one_way, tmp_path / "out", config={}, progress=False)
    clash = {**params, "model.layers.1.mlp.experts.0.up_proj.weight": np.zeros((16, 32), np.float32)}
    with pytest.raises(ValueError, match="'model.layers.1.mlp.experts.0.up_proj.weight' would be written for both"):
        save_params(clash, "qwen3_moe", tmp_path / "out", config={}, progress=False)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_params(params, "qwen3_moe", tmp_path / "out", config={"x": object()}, progress=False)
    assert os.listdir(tmp_path) == []


@pytest.mark.reference
@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_transformers_round_trip_is_bit_identical_and_gives_identical_logits(tmp_path, architecture):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if architecture == "qwen3_moe":
        model_class, config = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(**QWEN3_CONFIG)
        tree = qwen3_tree()
    else:
        model_class, config = transformers.MixtralForCausalLM, transformers.MixtralConfig(**MIXTRAL_CONFIG)
        tree = mixtral_tree()
    model = model_class(config).eval()
    model.save_pretrained(tmp_path / "hf", max_shard_size="50KB")

    params = load_params(tmp_path / "hf", tree, KEY_MAPS[architecture], progress=False)
    save_params(params, architecture, tmp_path / "ours", config=model.config.to_dict(), max_shard_bytes=50_000,
                progress=False)
    assert_same_checkpoint_tensors(tmp_path / "hf", tmp_path / "ours")

    reloaded = model_class.from_pretrained(tmp_path / "ours").eval()
    tokens = torch.tensor([[3, 17, 5, 60, 2, 9]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reloaded(tokens).logits)
