"""Multi-token-prediction layers (`moe_jax.models.mtp`) on a tiny DeepSeek-V3 checkpoint holding two of them:
loaded under HF's names and sharded by the decoder layers' plans, their logits equal a PyTorch reference built
around Transformers' decoder layer, and `moe-jax convert` writes them back bit for bit; a checkpoint without them
(Transformers' own, whose config still says num_nextn_predict_layers=2) loads without them. The loss:
tests/training/test_mtp_loss.py."""

import json

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.checkpoint_files import read_config
from moe_jax.cli import main
from moe_jax.cli.convert import convert
from moe_jax.pretrained import checkpoint_mtp_layers
from tests.converters.tiny_checkpoints import read_checkpoint, same_bits

from .hf_reference import hf_logits
from .mtp_checkpoints import MTP_LAYERS, TINY_MTP, reference_mtp_logits, write_mtp_checkpoint

LAYOUT = dict(tp_size=2, fsdp_size=4, ep_size=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp("mtp") / "deepseek_v3"
    hf_model, layers = write_mtp_checkpoint(directory)
    return directory, hf_model, layers


def test_the_mtp_logits_equal_the_reference_and_the_main_logits_are_unchanged(checkpoint):
    directory, hf_model, layers = checkpoint
    model = AutoModelForCausalLM.from_pretrained(directory, progress=False, devices=jax.devices()[:1])
    assert model.mtp_layers == MTP_LAYERS
    assert "model.layers.4.shared_head.head.weight" in model.params   # stored under its HF name, never stacked
    ids = np.random.default_rng(0).integers(0, TINY_MTP["vocab_size"], (2, 9))
    output = model.apply(model.params, ids, return_mtp_logits=True)
    assert output.mtp_logits.shape == (MTP_LAYERS, 2, 9, TINY_MTP["vocab_size"])
    np.testing.assert_allclose(np.asarray(output.mtp_logits), reference_mtp_logits(hf_model, layers, ids), atol=1e-5)
    np.testing.assert_allclose(np.asarray(output.logits), hf_logits(hf_model, ids), atol=1e-5)


def test_a_checkpoint_without_mtp_tensors_loads_without_mtp_layers(checkpoint, tmp_path):
    _, hf_model, _ = checkpoint
    hf_model.save_pretrained(tmp_path / "plain")                     # Transformers writes no MTP layer
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["num_nextn_predict_layers"] == MTP_LAYERS
    assert checkpoint_mtp_layers(read_config(tmp_path / "plain"), tmp_path / "plain") == 0
    assert checkpoint_mtp_layers(read_config(checkpoint[0]), checkpoint[0]) == MTP_LAYERS   # as `moe-jax train` counts
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", progress=False, devices=jax.devices()[:1])
    assert model.mtp_layers == 0 and not any(name.startswith("model.layers.3.") for name in model.params)
    with pytest.raises(ValueError, match="return_mtp_logits=True needs multi-token-prediction layers, which this "
                                         "model does not hold"):
        model.apply(model.params, np.zeros((1, 4), np.int32), return_mtp_logits=True)
    with pytest.raises(ValueError, match=r"mtp_layers=3: a deepseek_v3 model with this config holds 0 to 2"):
        type(model)(TINY_MTP, mtp_layers=3, abstract=True)


def test_the_mtp_layers_are_sharded_by_the_decoder_layers_plans(checkpoint):
    directory, _, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(directory, DistributedConfig(**LAYOUT), progress=False)
    specs = {name: layout.spec for name, layout in model.param_layouts.items()}
    for name, spec in specs.items():
        if name.startswith("model.layers.1."):                           # a sparse decoder layer
            assert specs[name.replace(".1.", ".3.", 1)] == spec == specs[name.replace(".1.", ".4.", 1)], name
    assert model.sharded_experts.keys() == {1, 2, 3, 4}


def test_convert_writes_the_mtp_layers_back_bit_for_bit(checkpoint, tmp_path, capsys):
    directory, _, _ = checkpoint
    original = read_checkpoint(directory)
    assert "model.layers.3.embed_tokens.weight" in original and "model.layers.4.mlp.experts.7.up_proj.weight" in original
    convert("hf", "hf", directory, tmp_path / "hf", DistributedConfig(**LAYOUT), progress=False)
    layout = ["--tp", "2", "--fsdp", "4", "--ep", "4", "--no-progress"]
    assert main(["convert", "--from", "hf", "--to", "orbax", str(directory), str(tmp_path / "orbax"), *layout]) == 0
    assert main(["convert", "--from", "orbax", "--to", "hf", str(tmp_path / "orbax"), str(tmp_path / "back"),
                 *layout]) == 0
    capsys.readouterr()
    for exported in (tmp_path / "hf", tmp_path / "back"):
        written = read_checkpoint(exported)
        assert written.keys() == original.keys()
        assert not [key for key in original if not same_bits(written[key], original[key])]


def test_an_fp8_checkpoint_keeps_its_mtp_layers_quantised_and_writes_them_back_bit_for_bit(checkpoint, tmp_path):
    """The MTP blocks' linears are quantised as a decoder layer's; eh_proj, the embedding and the head stay as
    stored (DeepSeek-V3's release keeps them in bf16)."""
    from converters import SafetensorsCheckpoint
    from tests.converters.fp8_checkpoints import write_fp8_checkpoint

    directory, _, _ = checkpoint
    quantised = write_fp8_checkpoint(directory, tmp_path / "fp8", (16, 16))
    assert "model.layers.3.self_attn.o_proj.weight" in quantised
    kept = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", progress=False, devices=jax.devices()[:1],
                                                dequantize=False)
    assert kept.mtp_layers == MTP_LAYERS
    assert kept.params["model.layers.3.self_attn.o_proj.weight"].dtype == "float8_e4m3fn"
    assert kept.params["model.layers.3.eh_proj.weight"].dtype == "float32"
    kept.save_pretrained(tmp_path / "out", progress=False)

    def stored(path):   # float8 tensors read as bytes (safetensors' numpy backend cannot build them)
        with SafetensorsCheckpoint(path) as files:
            return {key: (str(info.dtype), files.read(key).tobytes()) for key, info in files.tensors.items()}

    assert stored(tmp_path / "out") == stored(tmp_path / "fp8")
