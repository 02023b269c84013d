"""from_pretrained / save_pretrained: dtypes refused before anything is read; every family's export loads in
transformers and gives our logits."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import moe_jax
from converters import CheckpointMismatchError
from moe_jax import DistributedConfig
from moe_jax.parameter_dtypes import parameter_dtype

from .models.hf_reference import LOGITS_ATOL, hf_logits
from .models.test_fixture_parity import FIXTURES

SUPPORTED = "use one of 'float32', 'bfloat16', 'float16'."


def test_an_integer_dtype_is_refused_before_loading():
    """int8 used to load as all-zero weights and fail later with a TypeError."""
    with pytest.raises(ValueError) as caught:
        moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3_moe", dtype="int8", progress=False)
    assert str(caught.value) == f"dtype 'int8' is not a supported parameter dtype; {SUPPORTED}"
    with pytest.raises(ValueError, match="dtype 'nonsense' is not a supported parameter dtype"):
        parameter_dtype("nonsense")


def test_float64_needs_64_bit_jax_and_is_honoured_with_it():
    """float64 used to become float32 silently."""
    with pytest.raises(ValueError, match=r"dtype 'float64' needs 64-bit JAX: call jax.config.update\('jax_enable_x64'"):
        moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3_moe", dtype=np.float64, progress=False)
    with jax.enable_x64(True):
        model = moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3_moe", dtype="float64", progress=False)
        assert {array.dtype for array in model.params.values()} == {jnp.dtype("float64")}


def test_config_json_dtype_is_checked_too(tmp_path):
    checkpoint = shutil.copytree(FIXTURES / "qwen3_moe", tmp_path / "qwen3_moe")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "dtype": "int8"}))
    with pytest.raises(ValueError) as caught:
        moe_jax.AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    assert str(caught.value) == f"config.json dtype 'int8' is not a supported parameter dtype; {SUPPORTED}"


def test_a_missing_local_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere does not exist. Pass a local checkpoint directory"):
        moe_jax.AutoModelForCausalLM.from_pretrained(tmp_path / "nowhere", progress=False)


@pytest.mark.reference
# One family per key map: Qwen2-MoE's rules (OLMoE's are the same ones) and Mixtral's renamings. Qwen3-MoE's
# export is checked the same way in test_qwen3_moe.py; gpt-oss's (its key map is the identity, plus load-only
# MXFP4 rules) in tests/converters/test_mxfp4.py.
@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_transformers_loads_our_export_and_gives_our_logits(model_type, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    reference = np.load(FIXTURES / model_type / "reference.npz")
    model = moe_jax.AutoModelForCausalLM.from_pretrained(
        FIXTURES / model_type, DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4), progress=False
    )
    ours = np.asarray(model(reference["input_ids"], reference["attention_mask"]))
    model.save_pretrained(tmp_path / "export", progress=False)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    theirs = hf_logits(reloaded, reference["input_ids"], reference["attention_mask"])
    real = reference["attention_mask"].astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=LOGITS_ATOL, rtol=0)
    exported, original = checkpoint_tensors(tmp_path / "export"), checkpoint_tensors(FIXTURES / model_type)
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key


def checkpoint_tensors(directory) -> dict[str, np.ndarray]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_a_config_without_num_experts_gives_a_short_error_that_starts_with_the_shapes(tmp_path):
    """config.json without `num_experts` builds the default 128 experts against 8 stored ones (was: a
    1,087-line error listing every missing expert key)."""
    checkpoint = shutil.copytree(FIXTURES / "qwen3_moe", tmp_path / "qwen3_moe")
    config = json.loads((checkpoint / "config.json").read_text())
    del config["num_local_experts"]    # (transformers 5 writes num_experts under this alias)
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatchError) as caught:
        moe_jax.AutoModelForCausalLM.from_pretrained(checkpoint, devices=jax.devices()[:1], progress=False)
    lines = str(caught.value).splitlines()
    assert len(lines) < 30 and len(caught.value.missing) > 100
    assert lines[1].startswith("  shape mismatch (2;") and "the model declares [128, 32]" in lines[2]
    assert lines[-2].startswith("    ... and ") and "more (all of them: the error's `missing` list)" in lines[-2]


def test_too_few_devices_for_the_layout_says_how_to_get_virtual_ones():
    """(was: the mesh's world-size error alone; the commands gave the XLA_FLAGS hint, the Python API did not)"""
    with pytest.raises(RuntimeError) as caught:
        moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3_moe", DistributedConfig(fsdp_size=16),
                                                     progress=False)
    assert "requires 16 devices, but world_size is 8" in str(caught.value)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16 is set before it starts" in str(caught.value)


def test_a_smaller_layout_takes_the_first_devices_by_default():
    """devices=None on more devices than the layout needs: the first N (as jax.devices()[:N]), not an error."""
    model = moe_jax.AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3_moe", DistributedConfig(fsdp_size=2),
                                                         progress=False)
    assert list(model.mesh.devices.flat) == jax.devices()[:2]
    unset = moe_jax.AutoModelForCausalLM.from_config(FIXTURES / "qwen3_moe", DistributedConfig(fsdp_size=4))
    assert list(unset.mesh.devices.flat) == jax.devices()[:4]


def test_save_pretrained_of_a_quantised_model_carries_the_tokenizer(tmp_path):
    """fp8 on load, then saved: the tokenizer and generation config come along, so `generate --prompt` reads text."""
    from moe_jax.tokenization import write_byte_tokenizer

    source = tmp_path / "source"
    shutil.copytree(FIXTURES / "qwen3_moe", source)
    write_byte_tokenizer(source)
    model = moe_jax.AutoModelForCausalLM.from_pretrained(source, devices=jax.devices()[:1], quantize="fp8",
                                                         progress=False)
    out = model.save_pretrained(tmp_path / "fp8", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
