"""DeepSeek-V3 with its FP8 block-quantised weights kept on the devices (`from_pretrained(..., dequantize=False)`):
every quantised linear (latent attention, dense and shared MLPs) and the routed experts as float8 codes plus
block scales, decoded inside the step. The dequantise-at-load model's logits and tokens, a byte per code on each
device, and the hub tensors back byte for byte."""

from __future__ import annotations

import json
import struct

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.inference import ContinuousBatchingConfig
from moe_jax.lora import LoraConfig
from moe_jax.training import make_train_step
from tests.converters.fp8_checkpoints import write_fp8_checkpoint
from tests.heavy import representative
from tests.models.test_fixture_parity import FIXTURES

BLOCK = (8, 8)   # the fixture's intermediate sizes are multiples of 8: gate and up keep whole blocks
LAYOUTS = {"one_device": None, "fsdp8_ep8": dict(fsdp_size=8, ep_size=8),
           "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4), "pp2_fsdp4_ep4": dict(pp_size=2, fsdp_size=4,
                                                                                            ep_size=4)}
IDS = np.random.default_rng(1).integers(0, 64, (8, 12)).astype(np.int32)


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kept_fp8") / "deepseek_v3"
    write_fp8_checkpoint(FIXTURES / "deepseek_v3", directory, BLOCK)
    return directory


def load(directory, layout, **kwargs):
    config = None if layout is None else DistributedConfig(**layout)
    devices = jax.devices()[:1] if layout is None else None
    return AutoModelForCausalLM.from_pretrained(directory, config, progress=False, devices=devices, **kwargs)


def raw_tensors(path) -> dict[str, tuple[str, list[int], bytes]]:
    """A safetensors file's tensors as (dtype name, shape, bytes), read without a framework (float8 included)."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    body = data[8 + size:]
    return {key: (entry["dtype"], entry["shape"], body[entry["data_offsets"][0]:entry["data_offsets"][1]])
            for key, entry in header.items() if key != "__metadata__"}


# The suite runs one device, --heavy tp2/fsdp4/ep4 (the linears split over tp there); the pipeline layout is
# exercised by scripts/checks/check_kept_quantized.py with the rest of the grid.
@pytest.mark.parametrize("layout", representative(["one_device", "tp2_fsdp4_ep4"], suite=("one_device",)))
def test_kept_weights_give_the_dequantised_models_logits(hub_checkpoint, layout):
    kept = load(hub_checkpoint, LAYOUTS[layout], dequantize=False)
    dequantised = load(hub_checkpoint, LAYOUTS[layout])
    np.testing.assert_allclose(np.asarray(kept(IDS)), np.asarray(dequantised(IDS)), rtol=0, atol=1e-5)


def test_codes_stay_a_byte_each_with_their_block_scales(hub_checkpoint):
    kept = load(hub_checkpoint, LAYOUTS["fsdp8_ep8"], dequantize=False)
    params = kept.hf_params()
    for name in ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"):
        assert params[name].dtype == ml_dtypes.float8_e4m3fn, name
        assert params[f"{name}_scale_inv"].dtype == np.float32
    assert params["model.layers.1.mlp.gate.weight"].dtype == np.float32            # the router is not quantised
    experts = params["model.layers.1.mlp.experts.gate_up_proj"]
    assert {shard.data.shape[0] for shard in experts.addressable_shards} == {1}    # one expert per device
    assert experts.addressable_shards[0].data.nbytes == experts.nbytes // 8


def test_save_pretrained_writes_the_hub_files_back_byte_for_byte(hub_checkpoint, tmp_path):
    kept = load(hub_checkpoint, LAYOUTS["fsdp8_ep8"], dequantize=False)
    kept.save_pretrained(tmp_path / "export", progress=False)
    assert raw_tensors(tmp_path / "export" / "model.safetensors") == raw_tensors(hub_checkpoint / "model.safetensors")
    saved = json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "fp8" and saved["weight_block_size"] == list(BLOCK)


# heavy: the suite's kept-quantised decoding runs on MXFP4 (test_kept_mxfp4.py) and quantised-on-load FP8
# (test_weight_only.py); the check script runs this one too.
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
    assert tokens[0] == tokens[1]


def test_tensor_parallel_experts_are_refused_with_the_way_out(hub_checkpoint):
    with pytest.raises(ValueError, match="set ep_size .* or load with dequantize=True"):
        load(hub_checkpoint, dict(tp_size=2, fsdp_size=4), dequantize=False)


@pytest.mark.heavy   # the suite's kept-FP8 experts take several adapters' factors (tests/lora/test_many_adapters.py)
def test_a_lora_adapter_trains_on_the_frozen_fp8_base(hub_checkpoint):
    """QLoRA's way: the adapter on the latent attention's kept FP8 projections trains; the codes and scales stay
    bit-identical, and the trained adapter's logits equal the dequantised model's with the same adapter."""
    kept = load(hub_checkpoint, LAYOUTS["fsdp8_ep8"], dequantize=False)
    kept.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj"]))
    base = {name: np.asarray(value) for name, value in kept.params.items()}
    train_step = make_train_step(kept, optax.sgd(0.5))
    state = train_step.init_state(capacity=kept.capacity_schedule.largest)
    losses = []
    for _ in range(3):
        state, metrics = train_step(state, {"input_ids": IDS})
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert all(np.asarray(value).tobytes() == base[name].tobytes() for name, value in kept.params.items())
    kept.set_adapter_params(state.params)
    dequantised = load(hub_checkpoint, LAYOUTS["fsdp8_ep8"])
    dequantised.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj"]))
    dequantised.set_adapter_params(state.params)
    np.testing.assert_allclose(np.asarray(kept(IDS)), np.asarray(dequantised(IDS)), rtol=0, atol=1e-5)


def test_plan_counts_deepseek_v3_kept_fp8_within_an_h200_on_fsdp8_ep8(capsys):
    """The released DeepSeek-V3 (its public config, FP8 in 128 x 128 blocks) in bf16 on 8 devices: kept, its
    parameters fit a 141 GiB H200; dequantised they do not."""
    from moe_jax.cli import main

    config = FIXTURES.parent / "configs" / "deepseek_v3.json"
    gib = {}
    for flag in ("--no-dequantize", "--dequantize"):
        assert main(["plan", "--model", str(config), "--fsdp", "8", "--ep", "8", "--dtype", "bfloat16", flag]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("parameter bytes"))
        gib[flag] = float(line.split(":")[1].split()[0])
    assert gib["--no-dequantize"] < 141 < gib["--dequantize"]


def test_routing_replay_on_a_kept_fp8_base_gives_the_dequantised_models_forced_logits(hub_checkpoint):
    """The sampler's routing recorded on kept FP8 weights replays on them (RL on a quantised base), and forcing
    other experts gives what the dequantised model gives under the same forcing."""
    kept = load(hub_checkpoint, None, dequantize=False)
    dequantised = load(hub_checkpoint, None)
    recorded = np.asarray(kept.apply(kept.params, IDS, return_routing=True).routing)
    np.testing.assert_allclose(np.asarray(kept.apply(kept.params, IDS, routing=recorded).logits),
                               np.asarray(kept(IDS)), rtol=0, atol=1e-6)
    forced = (recorded + 1) % kept.config.n_routed_experts       # each token's next experts (still distinct)
    np.testing.assert_allclose(np.asarray(kept.apply(kept.params, IDS, routing=forced).logits),
                               np.asarray(dequantised.apply(dequantised.params, IDS, routing=forced).logits),
                               rtol=0, atol=1e-5)
