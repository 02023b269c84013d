"""Decode tokens/s and expert bytes per device of quantised experts against unquantised ones, alternated A/B.

    python scripts/bench/bench_kept_quantized.py [--quantize int8|fp8] [--layout one_device|fsdp4_ep4]
        [--rounds 6] [--batch 8] [--prompt-length 32] [--new-tokens 32] [--hidden 512] [--experts 16] [--layers 4]

Without --quantize: a gpt-oss checkpoint whose experts are random MXFP4 blocks + scales (hub layout,
quantization_config mxfp4), loaded kept quantised (`dequantize=False`) and dequantised at load; the two must give
the same greedy tokens. With --quantize: a Qwen3-MoE checkpoint of the same sizes in float32, loaded quantised
on load (`quantize=`) and as it is; the share of equal greedy tokens is printed (quantisation changes the
weights). Both sides compile first, then `generate` rounds alternate (the side that goes first alternates too).
Prints each side's median tokens/s, the median of the rounds' ratios, and the experts' bytes one device holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(4)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.causal_lm import GptOssForCausalLM  # noqa: E402

LAYOUTS = {"one_device": None, "fsdp4_ep4": dict(fsdp_size=4, ep_size=4)}
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def build(directory: Path, args) -> None:
    """A gpt-oss checkpoint with MXFP4 experts (random codes, scales around 2**-6)."""
    config = dict(model_type="gpt_oss", vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  num_local_experts=args.experts, num_experts_per_tok=4, sliding_window=64,
                  max_position_embeddings=1024, tie_word_embeddings=False, dtype="float32")
    model = GptOssForCausalLM(config, devices=jax.devices()[:1])
    model.init_params(seed=0)
    model.save_pretrained(directory, progress=False)
    tensors = load_file(directory / "model.safetensors")
    rng = np.random.default_rng(0)
    shapes = {"gate_up_proj": (2 * args.hidden, args.hidden), "down_proj": (args.hidden, args.hidden)}
    for layer in range(args.layers):
        for proj, (rows, values) in shapes.items():
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[key]
            tensors[f"{key}_blocks"] = rng.integers(0, 256, (args.experts, rows, values // 32, 16), dtype=np.uint8)
            tensors[f"{key}_scales"] = rng.integers(118, 124, (args.experts, rows, values // 32), dtype=np.uint8)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**saved, "quantization_config": QUANTIZATION_CONFIG}))


def build_plain(directory: Path, args) -> None:
    """A float32 Qwen3-MoE checkpoint of the same sizes (random weights)."""
    config = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden,
                  moe_intermediate_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, num_experts=args.experts, num_experts_per_tok=4,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=1024,
                  tie_word_embeddings=False, dtype="float32")
    model = AutoModelForCausalLM.from_config(config, devices=jax.devices()[:1])
    model.init_params(seed=0)
    model.save_pretrained(directory, progress=False)


def expert_bytes_per_device(model) -> int:
    device = jax.devices()[0]
    return sum(shard.data.nbytes for name, array in model.hf_params().items() if ".mlp.experts." in name
               for shard in array.addressable_shards if shard.device == device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", choices=("int8", "fp8"), default=None,
                        help="a plain Qwen3-MoE quantised on load against itself unquantised (default: kept MXFP4)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="one_device")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512, help="hidden and expert intermediate size (x32)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="moe_jax_kept_quantized_")) / "checkpoint"
    (build if args.quantize is None else build_plain)(directory, args)
    layout = LAYOUTS[args.layout]
    config = None if layout is None else DistributedConfig(**layout)
    devices = jax.devices()[:1] if layout is None else None
    quantised = {"dequantize": False} if args.quantize is None else {"quantize": args.quantize}
    models = {side: AutoModelForCausalLM.from_pretrained(directory, config, devices=devices, progress=False,
                                                         **(quantised if side == "kept" else {}))
              for side in ("kept", "dequantised")}
    prompts = np.random.default_rng(1).integers(0, 1024, (args.batch, args.prompt_length)).astype(np.int32)

    def run(side: str) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        tokens = models[side].generate(prompts, max_new_tokens=args.new_tokens, do_sample=False)
        return time.perf_counter() - start, tokens

    outputs = {side: np.asarray(run(side)[1]) for side in models}                 # compiles both
    agreement = float(np.mean(outputs["kept"] == outputs["dequantised"]))
    if args.quantize is None and agreement < 1:
        sys.exit("kept and dequantised weights gave different greedy tokens")
    seconds = {side: [] for side in models}
    for round_index in range(args.rounds):
        order = ("kept", "dequantised") if round_index % 2 == 0 else ("dequantised", "kept")
        for side in order:
            seconds[side].append(run(side)[0])
        print(f"  round {round_index + 1}: kept / dequantised tokens/s "
              f"{seconds['dequantised'][-1] / seconds['kept'][-1]:.2f}x", file=sys.stderr, flush=True)
    tokens = args.batch * args.new_tokens
    ratio = float(np.median(np.array(seconds["dequantised"]) / np.array(seconds["kept"])))
    what = "gpt-oss, MXFP4 kept vs dequantised" if args.quantize is None else (
        f"qwen3_moe, quantize={args.quantize!r} vs float32")
    print(f"{what}: hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-4, {args.layout}; "
          f"generate {args.batch} x ({args.prompt_length} prompt + {args.new_tokens} new), greedy, "
          f"{args.rounds} alternated rounds; {agreement:.1%} of the tokens equal")
    for side in models:
        print(f"{side:<12} {tokens / float(np.median(seconds[side])):>8.0f} tokens/s (prefill + decode)   experts "
              f"{expert_bytes_per_device(models[side]) / 2**20:.2f} MiB on device 0")
    print(f"{'kept' if args.quantize is None else 'quantised'} / unquantised tokens/s: {ratio:.2f}x (median of the "
          "rounds' ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
