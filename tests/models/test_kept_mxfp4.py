"""gpt-oss with its MXFP4 expert weights kept quantised on the devices (`from_pretrained(..., dequantize=False)`):
the dequantise-at-load model's logits and tokens, the quantised bytes per device, and the hub files back
byte for byte."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.inference import ContinuousBatchingConfig
from moe_jax.training import make_train_step
from tests.converters.test_mxfp4 import CONFIG, PROJECTIONS
from tests.heavy import representative
from tests.models.mxfp4_checkpoints import QUANTIZATION_CONFIG, write_mxfp4_checkpoint

LAYOUTS = {"one_device": None, "fsdp8_ep8": dict(fsdp_size=8, ep_size=8),
           "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4)}
IDS = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (8, 12)).astype(np.int32)


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory):
    return write_mxfp4_checkpoint(tmp_path_factory.mktemp("kept_mxfp4") / "gpt_oss")


def load(directory, layout, **kwargs):
    config = None if layout is None else DistributedConfig(**layout)
    devices = jax.devices()[:1] if layout is None else None
    return AutoModelForCausalLM.from_pretrained(directory, config, progress=False, devices=devices, **kwargs)


# The suite runs one device and tp2/fsdp4/ep4; --heavy fsdp8/ep8 too (scripts/checks/check_kept_quantized.py: the grid).
@pytest.mark.parametrize("layout", representative(LAYOUTS, suite=("one_device", "tp2_fsdp4_ep4")))
def test_kept_weights_give_the_dequantised_models_logits(hub_checkpoint, layout):
    kept = load(hub_checkpoint, LAYOUTS[layout], dequantize=False)
    dequantised = load(hub_checkpoint, LAYOUTS[layout])
    np.testing.assert_allclose(np.asarray(kept(IDS)), np.asarray(dequantised(IDS)), rtol=0, atol=1e-5)


def test_each_device_holds_its_experts_blocks_and_scales_only(hub_checkpoint):
    kept = load(hub_checkpoint, LAYOUTS["fsdp8_ep8"], dequantize=False)
    hub = load_file(hub_checkpoint / "model.safetensors")
    params = kept.hf_params()
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in params)
    for layer in range(CONFIG["num_hidden_layers"]):
        for proj in PROJECTIONS:
            for part in ("blocks", "scales"):
                name = f"model.layers.{layer}.mlp.experts.{proj}_{part}"
                array = params[name]
                assert array.dtype == np.uint8
                shards = array.addressable_shards
                # One expert per device (8 experts over ep=8): its bytes, no more.
                assert {shard.data.nbytes for shard in shards} == {hub[name].nbytes // 8}
                for shard in shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), hub[name][shard.index])


def test_save_pretrained_writes_the_hub_files_back_byte_for_byte(hub_checkpoint, tmp_path):
    kept = load(hub_checkpoint, LAYOUTS["fsdp8_ep8"], dequantize=False)
    kept.save_pretrained(tmp_path / "export", progress=False)
    original, exported = load_file(hub_checkpoint / "model.safetensors"), load_file(tmp_path / "export" /
                                                                                    "model.safetensors")
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and exported[key].tobytes() == tensor.tobytes(), key
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    # ... and it loads kept again.
    again = load(tmp_path / "export", None, dequantize=False)
    np.testing.assert_array_equal(np.asarray(again(IDS)), np.asarray(load(hub_checkpoint, None,
                                                                         dequantize=False)(IDS)))


# heavy: quantised weights through generate and the serving engine run in the suite as test_weight_only.py's
# (the same stand-ins in the same grouped matmul); this MXFP4 pair with --heavy and in check_kept_quantized.py.
@pytest.mark.heavy
def test_generate_and_continuous_batching_give_the_dequantised_tokens(hub_checkpoint):
    kept = load(hub_checkpoint, LAYOUTS["fsdp8_ep8"], dequantize=False)
    dequantised = load(hub_checkpoint, LAYOUTS["fsdp8_ep8"])
    prompts = IDS[:2, :6]
    np.testing.assert_array_equal(kept.generate(prompts, max_new_tokens=6, do_sample=False),
                                  dequantised.generate(prompts, max_new_tokens=6, do_sample=False))
    batching = ContinuousBatchingConfig(max_slots=8, page_size=4, max_model_len=32)
    tokens = [[output.generated_tokens for output in model.generate_batch(
        [list(map(int, row)) for row in prompts], continuous_batching_config=batching, max_new_tokens=6).values()]
        for model in (kept, dequantised)]
    assert tokens[0] == tokens[1] and all(len(row) == 6 for row in tokens[0])


def test_kept_weights_are_refused_where_they_cannot_work(hub_checkpoint):
    kept = load(hub_checkpoint, None, dequantize=False)
    with pytest.raises(ValueError, match="cannot be trained: train a LoRA adapter on the frozen quantised base"):
        make_train_step(kept, optax.sgd(0.1))
    with pytest.raises(ValueError, match="gate_up_proj_blocks selected"):
        make_train_step(kept, optax.sgd(0.1), trainable="*.mlp.experts.*")
    from tests.models.test_fixture_parity import FIXTURES

    with pytest.raises(ValueError, match="has no quantization_config"):
        load(FIXTURES / "gpt_oss", None, dequantize=False)
    config = json.loads((FIXTURES / "llama4_text" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"llama4_text weights in 'fp8' cannot be kept quantised yet \(kept quantised: "
                                         r"deepseek_v3 \(fp8\), gpt_oss \(mxfp4\), and fp8 for families with SwiGLU"):
        AutoModelForCausalLM.from_config(config, devices=jax.devices()[:1], kept_quantization="fp8")


# ---- the command line ---------------------------------------------------------------------------------------------
def test_convert_keeps_the_hub_format_through_orbax(hub_checkpoint, tmp_path):
    from moe_jax.cli import main

    arguments = ["--no-dequantize", "--no-progress"]
    assert main(["convert", "--from", "hf", "--to", "orbax", str(hub_checkpoint), str(tmp_path / "orbax"),
                 *arguments]) == 0
    assert main(["convert", "--from", "orbax", "--to", "hf", str(tmp_path / "orbax"), str(tmp_path / "hf"),
                 *arguments]) == 0
    original, converted = load_file(hub_checkpoint / "model.safetensors"), load_file(tmp_path / "hf" /
                                                                                     "model.safetensors")
    assert converted.keys() == original.keys()
    assert all(converted[key].tobytes() == tensor.tobytes() for key, tensor in original.items())


def test_plan_counts_gpt_oss_120b_kept_mxfp4_within_one_80_gib_device(capsys):
    """The released gpt-oss-120b (config of the hub's checkpoint): MXFP4 experts fit one 80 GiB device, bf16 do
    not."""
    from moe_jax.cli import main
    from tests.models.test_fixture_parity import FIXTURES

    config = FIXTURES.parent / "configs" / "gpt_oss_120b.json"
    gib = {}
    for flag in ("--no-dequantize", "--dequantize"):
        assert main(["plan", "--model", str(config), "--dtype", "bfloat16", flag]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("parameter bytes"))
        gib[flag] = float(line.split(":")[1].split()[0])
    assert gib["--no-dequantize"] < 80 < gib["--dequantize"]
    # Hand count: 36 layers x 128 experts x (gate_up 5760 x 2880 + down 2880 x 2880) values at 4.25 bits (a byte
    # of scale per 32 values) plus the rest in bf16.
    values = 36 * 128 * (5760 * 2880 + 2880 * 2880)
    assert abs(gib["--no-dequantize"] - gib["--dequantize"] + values * (2 - 4.25 / 8) / 2**30) < 0.2
