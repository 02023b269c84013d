"""Prefill and decode tokens/s per layout and ep_implementation, next to one device of the same run, and
Transformers' `generate` on the same checkpoint and prompts (one process, when torch is installed).

    python scripts/bench/bench_generate.py [--model DIR] [--batch 8] [--prompt-length 64] [--new-tokens 32]

Each configuration generates once to compile (compile time printed apart), then `--repeats` times; the
best wall time counts. Ratios are against the one-device figure measured in the same run (the machine
is shared and noisy). On the 8 virtual CPU devices of one host the layouts share the same cores, so the
ratios say what sharding costs here, not what it gains on accelerators.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.inference import GenerationConfig  # noqa: E402

LAYOUTS = [
    ("1 device", None),
    ("tp2 ep2 fsdp4 (auto: all_reduce)", dict(tp_size=2, ep_size=2, fsdp_size=4)),
    ("tp2 ep2 fsdp4 all_to_all", dict(tp_size=2, ep_size=2, fsdp_size=4, ep_implementation="all_to_all")),
    ("tp2 fsdp4 ep4 (auto: all_to_all)", dict(tp_size=2, fsdp_size=4, ep_size=4)),
    ("tp4 ep4 fsdp2 (auto: all_reduce)", dict(tp_size=4, ep_size=4, fsdp_size=2)),
    ("fsdp8 ep8", dict(fsdp_size=8, ep_size=8)),
    ("tp8", dict(tp_size=8)),
]


def prompts(vocab: int, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, (batch, length)).astype(np.int32)
    mask = np.ones_like(ids)
    for row in range(1, batch, 2):                      # every other row left-padded by a quarter
        mask[row, : length // 4] = 0
    ids[mask == 0] = 0
    return ids, mask


def bench_ours(model, ids, mask, new_tokens: int, repeats: int):
    config = GenerationConfig(max_new_tokens=new_tokens)
    first = model.generator.generate(ids, mask, config=config)
    best = None
    for _ in range(repeats):
        result = model.generator.generate(ids, mask, config=config)
        if best is None or result.timings.decode_s < best.timings.decode_s:
            best = result
    return first.timings.compile_s, best.timings, best.sequences


def bench_reference(model_dir, ids, mask, new_tokens: int, repeats: int):
    import torch
    from transformers import AutoModelForCausalLM as HF

    model = HF.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = dict(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask))
    with torch.no_grad():
        start = time.perf_counter()
        model(**inputs)
        prefill_s = time.perf_counter() - start
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            best = min(best, time.perf_counter() - start)
    return prefill_s, best, out.numpy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "models" / "qwen3_moe"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} x{len(jax.devices())}; model {args.model}; "
          f"batch {args.batch}, prompt {args.prompt_length}, {args.new_tokens} new tokens, best of {args.repeats}")
    baseline = None
    for name, layout in LAYOUTS:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, None if layout is None else DistributedConfig(**layout),
            devices=jax.devices()[:1] if layout is None else None, progress=False)
        ids, mask = prompts(model.config.vocab_size, args.batch, args.prompt_length)
        compile_s, timings, sequences = bench_ours(model, ids, mask, args.new_tokens, args.repeats)
        if baseline is None:
            baseline = (timings, sequences)
        same = np.array_equal(sequences, baseline[1])
        print(f"{name:36s} prefill {timings.prefill_tokens_per_s:9.0f} tok/s "
              f"({timings.prefill_tokens_per_s / baseline[0].prefill_tokens_per_s:5.2f}x)  decode "
              f"{timings.decode_tokens_per_s:8.0f} tok/s ({timings.decode_tokens_per_s / baseline[0].decode_tokens_per_s:5.2f}x)"
              f"  compile {compile_s:5.1f} s  tokens {'=' if same else '!='} 1 device")
        jax.clear_caches()
    try:
        prefill_s, generate_s, reference = bench_reference(args.model, *prompts(model.config.vocab_size, args.batch,
                                                                                args.prompt_length),
                                                           args.new_tokens, args.repeats)
    except ImportError:
        print("Transformers reference skipped: torch is not installed")
        return 0
    prompt_tokens = int(prompts(model.config.vocab_size, args.batch, args.prompt_length)[1].sum())
    decode_tokens = args.batch * args.new_tokens
    ours = baseline[0]
    print(f"{'Transformers generate (torch, 1 proc)':36s} prefill {prompt_tokens / prefill_s:9.0f} tok/s "
          f"({prompt_tokens / prefill_s / ours.prefill_tokens_per_s:5.2f}x)  whole generate {decode_tokens / generate_s:8.0f} "
          f"new tok/s (ours, 1 device: {ours.new_tokens / (ours.prefill_s + ours.decode_s):.0f})  tokens "
          f"{'=' if np.array_equal(reference, baseline[1]) else '!='} ours")
    return 0


if __name__ == "__main__":
    sys.exit(main())
