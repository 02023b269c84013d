"""Weight-only quantisation on load (`from_pretrained(..., quantize="int8" | "fp8")`): logits equal Transformers run
on weights quantised and dequantised by the same scheme in numpy, each device holds codes and scales only, FP8
exports in the format Transformers reads, and every misuse is one clear error."""

from __future__ import annotations

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from moe_jax import AutoModelForCausalLM, DistributedConfig
from tests.converters.fp8_checkpoints import write_fp8_checkpoint
from tests.models.test_fixture_parity import FIXTURES
from tests.models.test_kept_fp8 import raw_tensors

IDS = np.random.default_rng(3).integers(0, 128, (4, 10)).astype(np.int32)
LAYOUTS = {"one_device": None, "fsdp8_ep8": dict(fsdp_size=8, ep_size=8),
           "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4)}
# Hub names of the routed experts' matrices and of the linear modules quantize_modules picks below.
EXPERT_KEYS = {"qwen3_moe": r".mlp.experts.", "mixtral": r".block_sparse_moe.experts."}


def load(directory, layout, **kwargs):
    """`layout`: a LAYOUTS name, None for one device."""
    sizes = LAYOUTS[layout] if layout is not None else None
    config = None if sizes is None else DistributedConfig(**sizes)
    devices = jax.devices()[:1] if sizes is None else None
    return AutoModelForCausalLM.from_pretrained(directory, config, progress=False, devices=devices, **kwargs)


def int8_roundtrip(weight: np.ndarray) -> np.ndarray:
    """Symmetric int8 with one scale per output row, dequantised."""
    scale = np.abs(weight).max(axis=1) / np.float32(127)
    codes = np.clip(np.round(weight / scale[:, None]), -127, 127)
    return (codes * scale[:, None]).astype(np.float32)


def fp8_roundtrip(weight: np.ndarray, block: int = 128) -> np.ndarray:
    """e4m3 codes with one scale per block x block tile (amax / 448), dequantised."""
    out = np.empty_like(weight)
    for i in range(0, weight.shape[0], block):
        for j in range(0, weight.shape[1], block):
            tile = weight[i:i + block, j:j + block]
            scale = np.float32(np.abs(tile).max() / np.float32(448))
            codes = (tile / scale).astype(ml_dtypes.float8_e4m3fn)
            out[i:i + block, j:j + block] = codes.astype(np.float32) * scale
    return out


def reference_checkpoint(model_type: str, scheme: str, linears: tuple[str, ...], directory):
    """The fixture with each routed expert matrix and each `linears` weight quantised and dequantised in numpy."""
    shutil.copytree(FIXTURES / model_type, directory)
    tensors = load_file(directory / "model.safetensors")
    roundtrip = int8_roundtrip if scheme == "int8" else fp8_roundtrip
    for key in tensors:
        if key.endswith(".weight") and (EXPERT_KEYS[model_type] in key or any(
                key.endswith(f".{module}.weight") for module in linears)):
            tensors[key] = roundtrip(tensors[key])
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def transformers_logits(directory, **kwargs) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(torch.as_tensor(IDS, dtype=torch.long)).logits.numpy()


CASES = [("qwen3_moe", "int8", (), "one_device"),
         ("mixtral", "fp8", ("o_proj",), "one_device"),
         ("qwen3_moe", "int8", ("q_proj", "o_proj"), "tp2_fsdp4_ep4"),
         ("mixtral", "fp8", (), "fsdp8_ep8")]


@pytest.mark.reference
@pytest.mark.parametrize("model_type, scheme, linears, layout", CASES)
def test_logits_equal_transformers_on_the_same_scheme_in_numpy(model_type, scheme, linears, layout, tmp_path):
    model = load(FIXTURES / model_type, layout, quantize=scheme, quantize_modules=("experts", *linears))
    expected = transformers_logits(reference_checkpoint(model_type, scheme, linears, tmp_path / "reference"))
    np.testing.assert_allclose(np.asarray(model(IDS)), expected, rtol=0, atol=1e-5)


def test_each_device_holds_its_experts_codes_and_scales():
    model = load(FIXTURES / "qwen3_moe", "fsdp8_ep8", quantize="int8", quantize_modules=["experts", "o_proj"])
    experts = "model.layers.1.mlp.experts."
    codes, scale = model.params[experts + "gate_up_proj"], model.params[experts + "gate_up_proj_scale"]
    assert codes.dtype == np.int8 and scale.dtype == np.float32
    assert codes.shape == (8, 32, 32) and scale.shape == (8, 32)
    assert {shard.data.shape for shard in codes.addressable_shards} == {(1, 32, 32)}   # one expert a device
    assert {shard.data.shape[0] for shard in scale.addressable_shards} == {1}
    assert model.params["model.layers.1.self_attn.o_proj.weight"].dtype == np.int8
    assert model.params["model.layers.1.self_attn.q_proj.weight"].dtype == np.float32   # not chosen
    plain = load(FIXTURES / "qwen3_moe", "fsdp8_ep8")
    quantised_bytes = codes.nbytes + scale.nbytes
    assert quantised_bytes == plain.params[experts + "gate_up_proj"].nbytes // 4 + 8 * 32 * 4


@pytest.mark.reference
def test_fp8_export_is_read_by_transformers(tmp_path):
    import transformers

    model = load(FIXTURES / "mixtral", None, quantize="fp8", quantize_modules=["experts", "o_proj"])
    out = model.save_pretrained(tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert "self_attn.q_proj" in config["quantization_config"]["modules_to_not_convert"]
    tensors = raw_tensors(out / "model.safetensors")   # (dtype, shape, bytes)
    w1 = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    assert tensors[w1][:2] == ("F8_E4M3", [16, 32]) and tensors[w1 + "_scale_inv"][:2] == ("F32", [1, 1])
    assert tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"][:2] == ("F32", [1, 1])
    assert tensors["model.layers.0.self_attn.q_proj.weight"][0] == "F32"
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in tensors
    dequantize = transformers.FineGrainedFP8Config(dequantize=True)
    np.testing.assert_allclose(transformers_logits(out, quantization_config=dequantize), np.asarray(model(IDS)),
                               rtol=0, atol=1e-5)


def test_an_fp8_export_loads_back_kept_or_dequantised_and_writes_the_same_bytes(tmp_path):
    model = load(FIXTURES / "mixtral", None, quantize="fp8", quantize_modules=["experts", "o_proj"])
    out = model.save_pretrained(tmp_path / "fp8")
    kept = load(out, "fsdp8_ep8", dequantize=False)
    assert kept.params["model.layers.1.self_attn.o_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert kept.params["model.layers.1.self_attn.q_proj.weight"].dtype == np.float32
    np.testing.assert_allclose(np.asarray(kept(IDS)), np.asarray(model(IDS)), rtol=0, atol=1e-5)
    again = kept.save_pretrained(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert json.loads((again / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    dequantised = load(out, None)
    assert dequantised.params["model.layers.1.self_attn.o_proj.weight"].dtype == np.float32
    np.testing.assert_allclose(np.asarray(dequantised(IDS)), np.asarray(model(IDS)), rtol=0, atol=1e-5)


# heavy: quantised logits are the suite's; the engines agree on plain weights in tests/inference
@pytest.mark.heavy
def test_generate_and_continuous_batching_agree_on_quantised_weights():
    from moe_jax.inference import ContinuousBatchingConfig

    model = load(FIXTURES / "qwen3_moe", None, quantize="fp8")
    prompts = IDS[:2, :6]
    generated = np.asarray(model.generate(prompts, max_new_tokens=6, do_sample=False))[:, prompts.shape[1]:]
    batching = ContinuousBatchingConfig(max_slots=8, page_size=4, max_model_len=32)
    served = [output.generated_tokens for output in model.generate_batch(
        [list(map(int, row)) for row in prompts], continuous_batching_config=batching, max_new_tokens=6).values()]
    assert [list(map(int, row)) for row in generated] == [list(tokens) for tokens in served]


def test_misuse_is_one_clear_error_each(tmp_path):
    int8 = load(FIXTURES / "qwen3_moe", None, quantize="int8")
    with pytest.raises(ValueError, match="quantize='int8' weights have no checkpoint format Transformers reads"):
        int8.save_pretrained(tmp_path / "int8")
    assert not (tmp_path / "int8").exists()
    with pytest.raises(ValueError, match=r"quantize='int4' is not a weight-only scheme; use one of \['fp8', 'int8'\]"):
        load(FIXTURES / "qwen3_moe", None, quantize="int4")
    with pytest.raises(ValueError, match="quantize_modules names what quantize= quantises"):
        load(FIXTURES / "qwen3_moe", None, quantize_modules=["experts"])
    with pytest.raises(ValueError, match="names 'qkv', which matches no quantisable module; use 'experts' or linear modules"):
        load(FIXTURES / "qwen3_moe", None, quantize="int8", quantize_modules=["qkv"])
    with pytest.raises(ValueError, match="gpt_oss's are not"):
        load(FIXTURES / "gpt_oss", None, quantize="fp8")
    with pytest.raises(ValueError, match=r"set ep_size .* or load without quantize="):
        type(int8)(int8.config, DistributedConfig(tp_size=2), devices=jax.devices()[:2],
                   weight_quantization=int8.weight_quantization)
    with pytest.raises(ValueError, match=r"over tp_size=2 .* would cut a scale block; keep the weight unquantised"):
        load(FIXTURES / "mixtral", "tp2_fsdp4_ep4", quantize="fp8", quantize_modules=["experts", "o_proj"])
    write_fp8_checkpoint(FIXTURES / "deepseek_v3", tmp_path / "hub_fp8", (8, 8))
    with pytest.raises(ValueError, match=r"is already quantised \(fp8\); quantize='int8' quantises unquantised"):
        load(tmp_path / "hub_fp8", None, quantize="int8")


def test_training_the_codes_is_refused():
    import optax

    from moe_jax.training import make_train_step

    model = load(FIXTURES / "qwen3_moe", None, quantize="int8")
    with pytest.raises(ValueError, match="cannot be trained: train a LoRA adapter on the frozen quantised base"):
        make_train_step(model, optax.sgd(0.1))


def test_plan_counts_qwen3_30b_experts_quantised_on_load(capsys):
    """Qwen3-30B-A3B (the hub's config) in bf16: quantising the experts on load takes each expert value from two
    bytes to one (int8: plus a float32 scale per row; fp8: per 128 x 128 block), as `moe-jax plan` counts."""
    from moe_jax.cli import main

    config = FIXTURES.parent / "configs" / "qwen3_30b_a3b.json"
    gib = {}
    for flags in ([], ["--quantize", "int8"], ["--quantize", "fp8"]):
        assert main(["plan", "--model", str(config), "--dtype", "bfloat16", *flags]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("parameter bytes"))
        gib[tuple(flags)] = float(line.split(":")[1].split()[0])
        if flags:
            assert f"{flags[1]} codes and scales, quantised on load" in line
    layers, experts, hidden, intermediate = 48, 128, 2048, 768
    values = layers * experts * 3 * intermediate * hidden
    rows = layers * experts * (2 * intermediate + hidden)
    blocks = layers * experts * (2 * (intermediate // 128) * (hidden // 128) + (hidden // 128) * (intermediate // 128))
    assert abs(gib[()] - gib[("--quantize", "int8")] - (values - 4 * rows) / 2**30) < 0.05
    assert abs(gib[()] - gib[("--quantize", "fp8")] - (values - 4 * blocks) / 2**30) < 0.05
