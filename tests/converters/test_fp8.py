"""DeepSeek-V3's FP8 hub weights: dequantised as Transformers does, block by block, each device reading its own
experts; the multi-token-prediction layer skipped; an FP8 load exports the plain layout."""

from __future__ import annotations

import json

import chex
import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from converters.errors import CheckpointMismatchError
from converters.fp8 import FP8BlockTensor, dequantize_fp8
from converters.lazy_tensors import CheckpointTensor
from converters.safetensors_io import record_reads
from moe_jax import AutoModelForCausalLM, DistributedConfig
from tests.models.test_fixture_parity import FIXTURES

from .fp8_checkpoints import quantize_fp8, write_fp8_checkpoint

SOURCE = FIXTURES / "deepseek_v3"
# Every linear dimension of the fixture is a multiple of 8 (Transformers derives the block from the grid).
EVEN_BLOCK, RAGGED_BLOCK = (8, 8), (16, 16)


class ArrayReader:
    def __init__(self, arrays):
        self.arrays = arrays

    def read(self, key, index):
        return self.arrays[key][index]


def lazy(arrays: dict, key: str) -> CheckpointTensor:
    return CheckpointTensor(ArrayReader(arrays), key, arrays[key].shape, arrays[key].dtype)


def test_each_value_is_its_float8_times_its_blocks_scale():
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(40, 24)).astype(np.float32)          # 3 x 2 blocks of 16, the last ones partial
    quantised, scales = quantize_fp8(weight, RAGGED_BLOCK)
    values = dequantize_fp8(quantised, scales, RAGGED_BLOCK)
    for r, c in [(0, 0), (15, 15), (16, 3), (39, 23), (33, 17)]:
        assert values[r, c] == np.float32(quantised[r, c]) * scales[r // 16, c // 16]
    np.testing.assert_allclose(values, weight, rtol=0.07, atol=1e-6)  # 3 mantissa bits


def test_a_block_read_equals_the_whole_dequantised_slice():
    rng = np.random.default_rng(1)
    quantised, scales = quantize_fp8(rng.normal(size=(40, 24)).astype(np.float32), RAGGED_BLOCK)
    arrays = {"w": quantised, "s": scales}
    tensor = FP8BlockTensor(lazy(arrays, "w"), lazy(arrays, "s"), RAGGED_BLOCK)
    whole = dequantize_fp8(quantised, scales, RAGGED_BLOCK)
    for rows, columns in [(slice(0, 40), slice(0, 24)), (slice(10, 35), slice(5, 20)), (slice(32, 40), slice(16, 24))]:
        np.testing.assert_array_equal(tensor.read((rows, columns)), whole[rows, columns])


def test_a_scale_grid_that_does_not_fit_the_block_is_refused():
    arrays = {"w": np.zeros((40, 24), ml_dtypes.float8_e4m3fn), "s": np.ones((2, 2), np.float32)}
    with pytest.raises(ValueError, match=r"not the \[3, 2\] scale grid .* blocks of \[16, 16\]"):
        FP8BlockTensor(lazy(arrays, "w"), lazy(arrays, "s"), RAGGED_BLOCK)


@pytest.mark.reference
def test_dequantisation_equals_transformers():
    torch = pytest.importorskip("torch")
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    rng = np.random.default_rng(2)
    quantised, scales = quantize_fp8(rng.normal(size=(48, 32)).astype(np.float32), EVEN_BLOCK)
    weight = torch.from_numpy(quantised.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    theirs = Fp8Dequantize(None)._dequantize_one(weight, torch.from_numpy(scales), output_dtype=torch.float32)
    np.testing.assert_array_equal(dequantize_fp8(quantised, scales, EVEN_BLOCK), theirs.numpy())


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """The DeepSeek-V3 fixture quantised in 16 x 16 blocks (partial ones included), with an MTP layer 3."""
    directory = tmp_path_factory.mktemp("fp8") / "deepseek_v3"
    mtp = {"model.layers.3.eh_proj.weight": np.zeros((32, 64), np.float32),
           "model.layers.3.shared_head.norm.weight": np.ones(32, np.float32)}
    return directory, write_fp8_checkpoint(SOURCE, directory, RAGGED_BLOCK, extra=mtp)


def test_loading_dequantises_every_linear_and_reads_each_devices_experts_only(fp8_checkpoint):
    directory, quantised = fp8_checkpoint
    with record_reads() as reads:
        model = AutoModelForCausalLM.from_pretrained(directory, DistributedConfig(fsdp_size=8, ep_size=8),
                                                     progress=False)
    params = model.hf_params()
    for key, (weight, scales) in quantised.items():
        expected = dequantize_fp8(weight, scales, RAGGED_BLOCK)
        if ".experts." in key:  # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
            parts = key.split(".")
            experts, expert, projection = ".".join(parts[:5]), int(parts[5]), parts[6]
            fused = np.asarray(params[f"{experts}.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"])
            rows = weight.shape[0]
            actual = {"gate_proj": fused[expert, :rows], "up_proj": fused[expert, rows:],
                      "down_proj": fused[expert]}[projection]
        else:
            actual = np.asarray(params[key])
        np.testing.assert_array_equal(actual, expected, err_msg=key)
    expert_reads = [read for read in reads if read.key.startswith("model.layers.1.mlp.experts.0.down_proj.")]
    assert sorted(read.key.rsplit(".", 1)[1] for read in expert_reads) == ["weight", "weight_scale_inv"]  # once
    assert {read.request[2] for read in expert_reads} == {(0,)}  # expert 0: for device 0 only
    assert not any(read.key.startswith("model.layers.3.") for read in reads)  # the MTP layer is never read


def test_an_unknown_key_is_still_reported_beside_the_skipped_mtp_layer(fp8_checkpoint, tmp_path):
    directory, _ = fp8_checkpoint
    stray = write_fp8_checkpoint(SOURCE, tmp_path / "stray", RAGGED_BLOCK,
                                 extra={"model.layers.4.eh_proj.weight": np.zeros((2, 2), np.float32)})
    assert stray
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.4\.eh_proj\.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "stray", progress=False, devices=jax.devices()[:1])


def test_an_fp8_load_exports_the_plain_layout_without_quantization_config(fp8_checkpoint, tmp_path):
    directory, quantised = fp8_checkpoint
    model = AutoModelForCausalLM.from_pretrained(directory, progress=False, devices=jax.devices()[:1])
    model.save_pretrained(tmp_path / "plain", progress=False)
    exported = load_file(tmp_path / "plain" / "model.safetensors")
    assert not any(key.endswith("_scale_inv") for key in exported)
    for key, (weight, scales) in quantised.items():
        np.testing.assert_array_equal(exported[key], dequantize_fp8(weight, scales, RAGGED_BLOCK))
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


@pytest.mark.reference
def test_an_fp8_checkpoint_loads_to_transformers_dequantised_weights(tmp_path):
    """Transformers' own FP8 load (CPU: dequantised) and ours give the same parameters, bit for bit."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # Transformers' FP8 loading requires it
    import transformers

    write_fp8_checkpoint(SOURCE, tmp_path / "fp8", EVEN_BLOCK)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", progress=False, devices=jax.devices()[:1])
    ours = model.hf_params()
    state = {name: tensor.float().numpy() for name, tensor in theirs.state_dict().items()}
    chex.assert_trees_all_equal(jax.device_get(dict(ours)), state)
