"""Key patterns, transforms and the per-architecture tables, without any file."""

from types import SimpleNamespace

import numpy as np
import pytest

from converters.fp8 import DequantizeFP8
from converters.key_maps import KEY_MAPS, KeyMap, KeyRule, checkpoint_key_map, key_map_for, rename
from converters.key_patterns import KeyPattern
from converters.lazy_tensors import LayoutError, LazyTensor
from converters.safetensors_io import normalize_index
from converters.transforms import ConcatGateUp, StackExperts

from .tiny_checkpoints import ScaleFromInt8, mixtral_hub_tensors, qwen3_hub_tensors


class ArrayTensor(LazyTensor):
    """A lazy tensor over an in-memory array that records the blocks asked of it."""

    def __init__(self, name, array, log):
        self.name, self.array, self.log = name, array, log
        self.shape, self.dtype = array.shape, array.dtype

    def read(self, index):
        self.log.append((self.name, tuple((s.start, s.stop) for s in index)))
        return self.array[index]

    def describe(self):
        return self.name


def build_from_hub(rule, bindings, num_experts, hub, log):
    keys = rule.hub_keys(bindings, num_experts)
    leaves = [
        [ArrayTensor(k, hub[k], log) for k in entry] if isinstance(entry, list) else ArrayTensor(entry, hub[entry], log)
        for entry in keys
    ]
    return rule.build(leaves)


def test_pattern_matches_formats_and_binds():
    pattern = KeyPattern("model.layers.{layer}.mlp.experts.{expert}.w1.weight")
    assert pattern.placeholders == ("layer", "expert")
    assert pattern.match("model.layers.12.mlp.experts.3.w1.weight") == {"layer": 12, "expert": 3}
    assert pattern.match("model.layers.01.mlp.experts.3.w1.weight") is None  # keys never carry leading zeros
    assert pattern.match("model.layers.1.mlp.experts.3.w1.weightx") is None
    assert pattern.format(layer=2, expert=0) == "model.layers.2.mlp.experts.0.w1.weight"
    assert str(pattern.bind(layer=4)) == "model.layers.4.mlp.experts.{expert}.w1.weight"


@pytest.mark.parametrize("architecture", ["qwen3_moe", "qwen2_moe", "olmoe"])
def test_qwen_style_export_splits_experts_per_hf_layout(architecture):
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((4, 2 * 3, 5)).astype(np.float32)  # [E, 2I, H]
    down = rng.standard_normal((4, 5, 3)).astype(np.float32)  # [E, H, I]
    key_map = KEY_MAPS[architecture]
    exported = dict(key_map.to_hub("model.layers.7.mlp.experts.gate_up_proj", gate_up))
    exported.update(key_map.to_hub("model.layers.7.mlp.experts.down_proj", down))
    expected = qwen3_hub_tensors(
        {"model.layers.7.mlp.experts.gate_up_proj": gate_up, "model.layers.7.mlp.experts.down_proj": down}
    )
    assert list(exported) == list(expected)
    for key in expected:
        np.testing.assert_array_equal(exported[key], expected[key])
    # Everything else keeps its name.
    norm = np.ones(5, np.float32)
    assert key_map.to_hub("model.norm.weight", norm) == [("model.norm.weight", norm)]


def test_mixtral_export_uses_block_sparse_moe_names():
    rng = np.random.default_rng(1)
    params = {
        "model.layers.0.mlp.gate.weight": rng.standard_normal((4, 5)).astype(np.float32),
        "model.layers.0.mlp.experts.gate_up_proj": rng.standard_normal((4, 6, 5)).astype(np.float32),
        "model.layers.0.mlp.experts.down_proj": rng.standard_normal((4, 5, 3)).astype(np.float32),
    }
    exported = {}
    for name, value in params.items():
        exported.update(KEY_MAPS["mixtral"].to_hub(name, value))
    expected = mixtral_hub_tensors(params)
    assert sorted(exported) == sorted(expected)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in exported
    assert "model.layers.0.block_sparse_moe.gate.weight" in exported
    for key in expected:
        np.testing.assert_array_equal(exported[key], expected[key])


@pytest.mark.parametrize("architecture", sorted(KEY_MAPS))
def test_every_rule_loads_back_what_it_exports(architecture):
    """Export is derived from the load table: load(export(x)) == x for every rule."""
    rng = np.random.default_rng(2)
    for rule in KEY_MAPS[architecture].rules:
        bindings = {name: 3 for name in rule.param.placeholders}
        param_name = rule.param.format(**bindings)
        value = rng.standard_normal((4, 6, 5) if "experts" in param_name else (4, 5)).astype(np.float32)
        hub = dict(rule.export(param_name, value))
        log = []
        rebuilt = build_from_hub(rule, bindings, value.shape[0], hub, log)
        assert rebuilt.shape == value.shape
        np.testing.assert_array_equal(rebuilt.read(normalize_index(None, value.shape)), value)


def test_lazy_gate_up_reads_only_the_experts_and_rows_asked_for():
    rule = KEY_MAPS["qwen3_moe"].rules_for("model.layers.1.mlp.experts.gate_up_proj")[0][1]
    gate_up = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)  # E=4, I=3, H=5
    hub = dict(rule.export("model.layers.1.mlp.experts.gate_up_proj", gate_up))
    log = []
    tensor = build_from_hub(rule, {"layer": 1}, 4, hub, log)

    block = tensor.read((slice(2, 3), slice(0, 6), slice(0, 5)))
    np.testing.assert_array_equal(block, gate_up[2:3])
    assert {name for name, _ in log} == {
        "model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight"
    }

    log.clear()  # rows 0..3 of the fused dim are gate rows only: up is never touched
    np.testing.assert_array_equal(tensor.read((slice(0, 4), slice(0, 3), slice(0, 5))), gate_up[:, :3])
    assert all(".gate_proj." in name for name, _ in log)

    log.clear()  # a block straddling gate and up reads the needed rows of each
    np.testing.assert_array_equal(tensor.read((slice(1, 2), slice(2, 5), slice(1, 4))), gate_up[1:2, 2:5, 1:4])
    assert log == [
        ("model.layers.1.mlp.experts.1.gate_proj.weight", ((2, 3), (1, 4))),
        ("model.layers.1.mlp.experts.1.up_proj.weight", ((0, 2), (1, 4))),
    ]


def test_one_way_transform_loads_but_refuses_export():
    rule = KeyRule(param="model.layers.{layer}.q.weight", hub=("model.layers.{layer}.q.qweight",),
                   transforms=(ScaleFromInt8(),))
    key_map = KeyMap("toy", (rule,))
    assert not rule.invertible
    quantized = np.array([[2, -4]], np.int8)
    tensor = build_from_hub(rule, {"layer": 0}, 0, {"model.layers.0.q.qweight": quantized}, [])
    np.testing.assert_array_equal(tensor.read(normalize_index(None, (1, 2))), [[1.0, -2.0]])
    with pytest.raises(TypeError, match=r"Cannot export model.layers.0.q.weight.*ScaleFromInt8"):
        key_map.to_hub("model.layers.0.q.weight", np.zeros((1, 2), np.float32))


def test_rules_are_checked_when_declared():
    with pytest.raises(ValueError, match=r"adds placeholders \['expert'\].*StackExperts"):
        KeyRule(param="a.{layer}.w", hub=("a.{layer}.experts.{expert}.w",))
    with pytest.raises(ValueError, match=r"lacks placeholders \['layer'\]"):
        rename("a.w", "a.{layer}.w")
    with pytest.raises(ValueError, match="appears twice"):
        KeyPattern("a.{layer}.{layer}")


def test_layout_errors_name_the_parts():
    rule = KEY_MAPS["qwen3_moe"].rules_for("model.layers.1.mlp.experts.gate_up_proj")[0][1]
    hub = {f"model.layers.1.mlp.experts.{e}.{p}.weight": np.zeros((3, 5), np.float32)
           for e in range(2) for p in ("gate_proj", "up_proj")}
    hub["model.layers.1.mlp.experts.1.up_proj.weight"] = np.zeros((3, 5), np.float16)
    with pytest.raises(LayoutError, match="differ in dtype.*experts.1.up_proj") as error:
        build_from_hub(rule, {"layer": 1}, 2, hub, [])
    assert error.value.kind == "dtype"


def test_unknown_architecture_lists_known_ones():
    with pytest.raises(KeyError, match="known: deepseek_v3, gpt_oss, llama4, llama4_text, mixtral, olmoe, qwen2_moe, qwen3_moe"):
        key_map_for("llama")
    assert key_map_for("mixtral") is KEY_MAPS["mixtral"]
    assert isinstance(ConcatGateUp(), ConcatGateUp) and isinstance(StackExperts(), StackExperts)


def test_a_family_whose_table_depends_on_its_config_is_built_from_it():
    config = SimpleNamespace(num_hidden_layers=3, num_nextn_predict_layers=1, weight_block_size=(16, 32))
    deepseek = checkpoint_key_map("deepseek_v3", config)
    assert deepseek.is_ignored("model.layers.3.eh_proj.weight") and not deepseek.is_ignored("model.layers.2.x")
    assert {transform.block for rule in deepseek.load_only for transform in rule.transforms
            if isinstance(transform, DequantizeFP8)} == {(16, 32)}
    assert checkpoint_key_map("mixtral", config) is KEY_MAPS["mixtral"]
