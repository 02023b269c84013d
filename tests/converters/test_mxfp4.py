"""gpt-oss's MXFP4 hub tensors: dequantised as Transformers does, read expert by expert, exported in the
plain layout."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from converters.mxfp4 import dequantize_mxfp4
from converters.safetensors_io import record_reads
from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.causal_lm import GptOssForCausalLM

# Expert projections need rows of whole 32-value blocks: hidden 64 (2 blocks), intermediate 32 (1 block).
CONFIG = dict(model_type="gpt_oss", vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              sliding_window=4, max_position_embeddings=128, tie_word_embeddings=False, dtype="float32")
PROJECTIONS = {"gate_up_proj": (2 * 32, 64), "down_proj": (64, 32)}  # (rows R, values per row)


def random_mxfp4(rng, experts: int, rows: int, values: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = rng.integers(0, 256, (experts, rows, values // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 132, (experts, rows, values // 32), dtype=np.uint8)  # 2**-9 .. 2**4
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny gpt-oss checkpoint whose expert weights are MXFP4 blocks + scales, and those tensors."""
    directory = tmp_path_factory.mktemp("mxfp4") / "gpt_oss"
    model = GptOssForCausalLM(CONFIG, devices=jax.devices()[:1])
    model.init_params(seed=0)
    model.save_pretrained(directory, progress=False)
    tensors = load_file(directory / "model.safetensors")
    rng = np.random.default_rng(0)
    quantised = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for proj, (rows, values) in PROJECTIONS.items():
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[key]
            blocks, scales = random_mxfp4(rng, CONFIG["num_local_experts"], rows, values)
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
            quantised[key] = (blocks, scales)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory, quantised


def test_values_follow_the_fp4_table_and_the_block_scale():
    blocks = np.asarray([[[0x21, 0xF7] + [0] * 14]], np.uint8)  # codes 1, 2, 7, 15 then zeros
    scales = np.asarray([[128]], np.uint8)                      # 2 ** 1
    values = dequantize_mxfp4(blocks, scales)
    assert values.shape == (1, 32) and values.dtype == np.float32
    assert values[0, :4].tolist() == [1.0, 2.0, 12.0, -12.0]


@pytest.mark.reference
def test_dequantisation_equals_transformers():
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4(np.random.default_rng(1), 3, 5, 64)
    theirs = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32)
    ours = dequantize_mxfp4(blocks, scales).transpose(0, 2, 1)
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_loading_dequantises_each_devices_experts_only(mxfp4_checkpoint):
    directory, quantised = mxfp4_checkpoint
    with record_reads() as reads:
        model = AutoModelForCausalLM.from_pretrained(directory, DistributedConfig(fsdp_size=8, ep_size=8),
                                                     progress=False)
    params = model.hf_params()
    for key, (blocks, scales) in quantised.items():
        np.testing.assert_array_equal(np.asarray(params[key]), dequantize_mxfp4(blocks, scales).transpose(0, 2, 1))
        block_reads = [read for read in reads if read.key == f"{key}_blocks"]
        assert len(block_reads) == 8 and all(read.index[0][1] - read.index[0][0] == 1 for read in block_reads)
        assert sum(read.nbytes for read in block_reads) == blocks.nbytes  # each expert's bytes read once


def test_an_mxfp4_load_exports_the_plain_layout(mxfp4_checkpoint, tmp_path):
    directory, quantised = mxfp4_checkpoint
    model = AutoModelForCausalLM.from_pretrained(directory, progress=False, devices=jax.devices()[:1])
    model.save_pretrained(tmp_path / "plain", progress=False)
    exported = load_file(tmp_path / "plain" / "model.safetensors")
    for key, (blocks, scales) in quantised.items():
        assert f"{key}_blocks" not in exported
        np.testing.assert_array_equal(exported[key], dequantize_mxfp4(blocks, scales).transpose(0, 2, 1))


def test_a_plain_gpt_oss_checkpoint_round_trips_bit_for_bit(tmp_path):
    from tests.models.test_fixture_parity import FIXTURES

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "gpt_oss", DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False)
    model.save_pretrained(tmp_path / "export", progress=False)
    original, exported = load_file(FIXTURES / "gpt_oss" / "model.safetensors"), load_file(tmp_path / "export" /
                                                                                          "model.safetensors")
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
