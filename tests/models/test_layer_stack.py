"""Scanned layers: which layers form a run, stacked storage under HF-facing APIs, and the same numbers.

Every family's fixture is loaded with scanned layers onto representative layouts and compared with the
PyTorch logits; loading reads each layer's tensors once and only the slices a device holds; exporting a
scanned model reproduces the checkpoint bit for bit.
"""

from pathlib import Path

import chex
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import converters.load
import moe_jax
from converters import record_reads
from moe_jax import DistributedConfig
from moe_jax.causal_lm import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from moe_jax.models.layer_stack import LayerRun, resolve_scan_option
from moe_jax.module_tree import unflatten

from .hf_reference import TINY_QWEN2_MOE, TINY_QWEN3_MOE

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
# The whole grid, scanned, is `python scripts/checks/check_all_layouts.py --scan-layers`.
LAYOUTS = [dict(tp_size=2, fsdp_size=4, ep_size=4)]


def test_runs_follow_layer_structure():
    # Qwen3-MoE fixture shape: dense layer 0, sparse 1-2 -> layer 0 alone, 1-2 scanned.
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, scan_layers=True)
    assert model.layer_stack.runs == (LayerRun(0, 1, False), LayerRun(1, 3, True))
    # Qwen2-MoE with sliding windows on layers 0 and 2 only: no two neighbours agree, nothing to scan.
    qwen2 = Qwen2MoeForCausalLM(TINY_QWEN2_MOE, scan_layers=True)
    assert not qwen2.layer_stack.scanned
    uniform = Qwen2MoeForCausalLM(dict(TINY_QWEN2_MOE, num_hidden_layers=5, use_sliding_window=False),
                                  scan_layers=True)
    assert uniform.layer_stack.runs == (LayerRun(0, 1, False), LayerRun(1, 5, True))
    assert resolve_scan_option("auto", 15) is False and resolve_scan_option("auto", 16) is True
    with pytest.raises(ValueError, match="scan_layers='yes': use True, False or 'auto'"):
        resolve_scan_option("yes", 4)


def test_storage_names_shapes_and_shardings():
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(fsdp_size=8, ep_size=8), scan_layers=True)
    shapes = model.storage_shapes()
    assert shapes["model.layers.1-2.mlp.experts.gate_up_proj"] == (2, 8, 32, 32)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (64, 32)
    assert "model.layers.1.mlp.experts.gate_up_proj" not in shapes
    per_layer = model.named_shardings()["model.layers.1.mlp.experts.gate_up_proj"].spec
    stacked = model.storage_shardings()["model.layers.1-2.mlp.experts.gate_up_proj"].spec
    assert stacked == P(None, *per_layer)  # the layer axis is never sharded
    # Plans and `moe-jax plan` keep speaking HF names.
    assert "model.layers.2.mlp.experts.gate_up_proj" in model.param_layouts
    # The step's nested view, from a structure built with the stack, is `unflatten`'s.
    storage = {name: index for index, name in enumerate(shapes)}
    assert model.layer_stack.nest(storage) == unflatten(storage)
    assert model.layer_stack.nest(storage)["model"]["layers"]["1-2"]["mlp"]["experts"]["gate_up_proj"] == \
        storage["model.layers.1-2.mlp.experts.gate_up_proj"]


def test_stack_and_unstack_are_inverse_and_init_does_not_depend_on_scanning():
    unrolled = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, scan_layers=False)
    scanned = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, scan_layers=True)
    unrolled.init_params(seed=1)
    scanned.init_params(seed=1)
    hf = scanned.hf_params()
    assert list(hf) == [name for name, _ in scanned.module_tree.named_parameters()]  # declaration order
    chex.assert_trees_all_equal(dict(hf), unrolled.params)
    chex.assert_trees_all_equal(scanned.layer_stack.stack(hf), scanned.params)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items()))
# OLMoE's scanned grid: `python scripts/checks/check_all_layouts.py olmoe --scan-layers true` (docs/benchmarks.md).
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_scanned_logits_match_pytorch_fixture(model_type, layout):
    directory = FIXTURES / model_type
    reference = np.load(directory / "reference.npz")
    model = moe_jax.AutoModelForCausalLM.from_pretrained(
        directory, DistributedConfig(**layout), progress=False, scan_layers=True)
    assert model.layer_stack.scanned
    output = model.forward(reference["input_ids"], reference["attention_mask"])
    real = reference["attention_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(output.logits)[real], reference["logits"][real], atol=1e-5, rtol=0)
    assert abs(float(output.aux_loss) - float(reference["aux_loss"])) < 1e-6


def test_scanned_qwen2_moe_equals_unrolled():
    """Qwen2-MoE's fixture has no run to scan; with uniform attention its sparse layers form one."""
    config = dict(TINY_QWEN2_MOE, num_hidden_layers=3, use_sliding_window=False)
    unrolled = Qwen2MoeForCausalLM(config, scan_layers=False)
    unrolled.init_params(seed=2)
    scanned = Qwen2MoeForCausalLM(config, scan_layers=True)
    scanned.set_params(unrolled.hf_params())
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (4, 9))
    np.testing.assert_allclose(np.asarray(scanned(ids)), np.asarray(unrolled(ids)), atol=1e-6, rtol=0)


def test_scanned_loading_reads_each_slice_once_and_only_where_it_lives():
    directory = FIXTURES / "qwen3_moe"
    with record_reads() as reads:
        model = moe_jax.AutoModelForCausalLM.from_pretrained(
            directory, DistributedConfig(fsdp_size=8, ep_size=8), progress=False, scan_layers=True)
    expert_reads = [read for read in reads if ".mlp.experts." in read.key]
    # Every expert tensor of both scanned layers is read exactly once, by the one device that owns it.
    keys = [read.key for read in expert_reads]
    assert len(keys) == len(set(keys)) == 2 * 8 * 3  # layers x experts x (gate, up, down)
    stacked = model.params["model.layers.1-2.mlp.experts.gate_up_proj"]
    for shard in stacked.addressable_shards:
        assert shard.data.shape == (2, 1, 32, 32)  # both layers, one expert per device


@pytest.mark.parametrize("layout", [dict(fsdp_size=8, ep_size=8), dict(tp_size=2, fsdp_size=4, ep_size=4)])
def test_large_stacked_blocks_are_read_one_layer_at_a_time(layout, monkeypatch):
    """Above `LAYERWISE_READ_BYTES` (0 here, so every stacked block qualifies) a device's block of a stacked run
    is read layer by layer into its device buffer: each read covers one layer, and the loaded parameters are
    the whole-block load's bit for bit (tp2/fsdp4/ep4 also copies blocks that several devices hold)."""
    directory = FIXTURES / "qwen3_moe"
    whole = moe_jax.AutoModelForCausalLM.from_pretrained(directory, DistributedConfig(**layout), progress=False,
                                                         scan_layers=True)
    monkeypatch.setattr(converters.load, "LAYERWISE_READ_BYTES", 0)
    with record_reads() as reads:
        layerwise = moe_jax.AutoModelForCausalLM.from_pretrained(directory, DistributedConfig(**layout),
                                                                 progress=False, scan_layers=True)
    stacked = [name for name in layerwise.params if name.startswith("model.layers.1-2.")]
    assert stacked
    stacked_reads = [read for read in reads if read.request[0] in stacked]
    assert stacked_reads and all(bounds[0][1] - bounds[0][0] == 1 for _, bounds, _ in
                                 (read.request for read in stacked_reads))
    for name in layerwise.params:
        assert layerwise.params[name].sharding == whole.params[name].sharding, name
        for ours, theirs in zip(layerwise.params[name].addressable_shards, whole.params[name].addressable_shards,
                                strict=True):
            assert ours.device == theirs.device and np.array_equal(np.asarray(ours.data), np.asarray(theirs.data))


def test_export_of_a_scanned_model_reproduces_the_checkpoint(tmp_path):
    directory = FIXTURES / "mixtral"
    model = moe_jax.AutoModelForCausalLM.from_pretrained(
        directory, DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4), progress=False, scan_layers=True)
    assert model.layer_stack.scanned
    model.save_pretrained(tmp_path / "export", progress=False)
    original, exported = load_file(directory / "model.safetensors"), {}
    for path in (tmp_path / "export").glob("*.safetensors"):
        exported.update(load_file(path))
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
