"""The GPU check: correctness against the CPU, MoE-layer TFLOP/s and MFU at Qwen3-30B-A3B
shapes per grouped-matmul backend, and a reduced-depth Qwen3-30B-A3B train step's tokens/s and MFU.

    scripts/gpu_check.sh OUT_DIR                    # on the lent GPU machine (the device tool), ~5 minutes
    python scripts/gpu_check.py OUT_DIR --small     # the same code paths at toy shapes, on any machine

Writes OUT_DIR/gpu_check.json (every figure) and OUT_DIR/gpu_check.txt (the printed report). Nothing is
fetched: it uses the jax, flax, optax installed where it runs; tokamax is tried if importable.
  1. correctness: the MoE expert layer (each backend) and a 2-layer Qwen3-MoE forward on the default device
     against the same computation on the CPU backend (fp32, max |difference|);
  2. MoE layer at Qwen3-30B-A3B shapes (hidden 2048, 128 experts, top-8, moe intermediate 768, bf16; --tokens
     routed tokens): forward and forward+backward per backend, TFLOP/s of the expert matmuls and MFU against
     --peak-tflops (H200 bf16 dense: 989), and the tiled scan at tiles 128, 512 and 1024 besides its default;
  3. attention: causal GQA at Qwen3-30B-A3B's head shapes (32 heads over 4, head dim 128,
     bf16, batch --batch x --seq): jax.nn.dot_product_attention with implementation "cudnn" and "xla" (on a CPU:
     "xla" and moe_jax's query blocks), forward and forward+backward, against torch's scaled_dot_product_attention
     on the same inputs where torch is importable;
  4. train step: Qwen3-30B-A3B at --layers layers (full width and vocab), mixed precision (fp32 masters, bf16
     compute), AdamW, batch --batch x --seq, tokens/s and MFU (6 x active parameters x tokens per second);
  5. offload: the train step with its state in host memory between steps (none, optimizer, all): the device's
     and the host's bytes at the step's peak (XLA's memory analysis) and the step's time;
  6. serving: continuous batching (`ServingEngine`, 32 slots, 96 requests of 32-512 prompt and 32-256
     new tokens, bf16, --layers layers) against static `generate` batches of the same requests, tokens/s;
  7. speculation: the same engine with n-gram speculation (4 drafts) and without, on 8 slots of prompts that
     repeat a segment (so prompt lookup finds drafts): tokens/s of each, the acceptance, whether the greedy
     tokens agree, and the time of a verification step against a decode step: on a GPU, where a decode step is
     bound by its weights' bytes, a verification of 5 tokens a row should cost little more than one decode
     (on this project's 2-core CPU it costs about 2x, which caps what speculation can win there);
  8. rebalance_probe: the forward pass a re-placement in training runs on each measured batch
     (`training.load_probe`, what `--rebalance-lookahead` costs per batch) against the train step of `train_step`.
`--small` runs on any machine: on this project's CPU
machine it completed under jax 0.10.2 and, in a Python 3.12 venv with the GPU image's jax 0.11.2 plus the wheels
of scripts/fetch_gpu_wheels.sh, with tokamax importable (device and CPU results agreed exactly both times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.ops.experts import swiglu_experts  # noqa: E402
from moe_jax.ops.grouped_matmul import (  # noqa: E402
    GROUPED_MATMUL_BACKENDS,
    default_backend,
    register_grouped_matmul_backend,
)
from moe_jax.ops.grouped_matmul_backends.tiled_scan import tiled_grouped_matmul  # noqa: E402
from moe_jax.ops.grouped_matmul_backends.tokamax_kernel import tokamax_available  # noqa: E402
from moe_jax.ops.routing import softmax_top_k  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from moe_jax.training.load_probe import NextLoadProbe  # noqa: E402
from moe_jax.training.throughput import train_flops_per_token  # noqa: E402
from scripts.bench.timing import median_seconds  # noqa: E402

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                     tie_word_embeddings=False)
TOY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
           max_position_embeddings=256, tie_word_embeddings=False)




SECTIONS = ("correctness", "moe_layer", "attention", "train_step", "offload", "serving", "speculation",
            "rebalance_probe")


def backends() -> list[str]:
    return [name for name in GROUPED_MATMUL_BACKENDS if name != "tokamax" or tokamax_available()]


# The tiled scan at other tiles than its default (256 at these shapes), to choose the GPU's tile from the run: on a
# GPU each visit's loop overhead is large against one 256-row dot, so larger tiles are likely better there.
TILE_SWEEP = (128, 512, 1024)


def tile_sweep_backends() -> list[str]:
    """Registers `tiled_R<rows>` for each TILE_SWEEP tile (once) and returns their names."""
    names = []
    for rows in TILE_SWEEP:
        name = f"tiled_R{rows}"
        if name not in GROUPED_MATMUL_BACKENDS:
            register_grouped_matmul_backend(name, partial(tiled_grouped_matmul, tile_rows=rows))
        names.append(name)
    return names


def expert_inputs(rng, tokens: int, config: dict, dtype):
    hidden, experts, inter = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32), dtype)
    weights, index = softmax_top_k(jnp.asarray(rng.standard_normal((tokens, experts), np.float32)),
                                   config["num_experts_per_tok"], normalize=True)
    gate_up = jnp.asarray(rng.standard_normal((experts, 2 * inter, hidden), np.float32) * 0.02, dtype)
    down = jnp.asarray(rng.standard_normal((experts, hidden, inter), np.float32) * 0.02, dtype)
    return x, index, weights.astype(dtype), gate_up, down


def correctness(config: dict, report) -> dict:
    """Max |device - CPU| of the expert layer per backend and of a 2-layer model's logits (fp32)."""
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    inputs = expert_inputs(rng, 256, config, jnp.float32)
    results = {}
    on_cpu = np.asarray(jax.jit(partial(swiglu_experts, backend="tiled"))(*jax.device_put(inputs, cpu)))
    for backend in backends():
        try:
            on_device = np.asarray(jax.jit(partial(swiglu_experts, backend=backend))(*inputs))
        except Exception as error:  # reported, not hidden; the other backends still run
            results[f"experts_{backend}_error"] = f"{type(error).__name__}: {error}"[:300]
            continue
        results[f"experts_{backend}_max_abs_diff"] = float(np.abs(on_device - on_cpu).max())
    small = {**config, "num_hidden_layers": 2}
    ids = rng.integers(0, config["vocab_size"], (2, 64))
    device_model = Qwen3MoeForCausalLM(small, devices=jax.devices()[:1])
    device_model.init_params(seed=0)
    cpu_model = Qwen3MoeForCausalLM(small, devices=[cpu])
    cpu_model.set_params({k: np.asarray(v) for k, v in device_model.hf_params().items()})
    on_cpu = np.asarray(cpu_model(ids))
    results["model_2_layers_max_abs_logits"] = float(np.abs(on_cpu).max())
    results["model_2_layers_max_abs_logits_diff"] = float(np.abs(np.asarray(device_model(ids)) - on_cpu).max())
    # A GPU's fp32 matmuls default to TF32 (10 mantissa bits): the same forward at "highest" precision tells that
    # rounding from a wrong result.
    with jax.default_matmul_precision("highest"):
        highest = Qwen3MoeForCausalLM(small, devices=jax.devices()[:1])
        highest.set_params({k: np.asarray(v) for k, v in device_model.hf_params().items()})
        results["model_2_layers_max_abs_logits_diff_highest"] = float(np.abs(np.asarray(highest(ids)) - on_cpu).max())
    for name, value in results.items():
        report(f"  {name}: {value:.3e}" if isinstance(value, float) else f"  {name}: {value}")
    return results


def moe_layer(config: dict, tokens: int, peak: float, repeats: int, report) -> dict:
    """Expert matmul TFLOP/s and MFU per backend, bf16, forward and forward+backward."""
    rng = np.random.default_rng(1)
    x, index, weights, gate_up, down = expert_inputs(rng, tokens, config, jnp.bfloat16)
    flops = 2 * tokens * config["num_experts_per_tok"] * 3 * config["hidden_size"] * config["moe_intermediate_size"]
    results = {}
    for backend in backends() + tile_sweep_backends():
        forward = jax.jit(partial(swiglu_experts, backend=backend))
        grad = jax.jit(jax.grad(lambda x, g, d, b=backend: jnp.sum(
            swiglu_experts(x, index, weights, g, d, backend=b).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
        try:
            fwd = median_seconds(forward, x, index, weights, gate_up, down, repeats=repeats)
            both = median_seconds(grad, x, gate_up, down, repeats=repeats)
        except Exception as error:  # a backend that does not lower here is reported, not hidden
            results[backend] = {"error": f"{type(error).__name__}: {error}"[:300]}
            report(f"  {backend}: failed: {results[backend]['error']}")
            continue
        results[backend] = {"forward_ms": fwd * 1e3, "forward_tflops": flops / fwd / 1e12,
                            "forward_mfu": flops / fwd / peak, "fwd_bwd_ms": both * 1e3,
                            "fwd_bwd_tflops": 3 * flops / both / 1e12, "fwd_bwd_mfu": 3 * flops / both / peak}
        report(f"  {backend}: forward {fwd * 1e3:.2f} ms {flops / fwd / 1e12:.1f} TFLOP/s (MFU "
               f"{flops / fwd / peak:.1%}); fwd+bwd {both * 1e3:.2f} ms {3 * flops / both / 1e12:.1f} TFLOP/s "
               f"(MFU {3 * flops / both / peak:.1%})")
    return results


def attention(config: dict, batch: int, seq: int, peak: float, repeats: int, report) -> dict:
    """Causal grouped-query attention at the model's head shapes, bf16: jax.nn.dot_product_attention per
    implementation (cuDNN's fused kernel and XLA's on a GPU; XLA's and moe_jax's query blocks on a CPU) and, where
    torch is importable, torch's scaled_dot_product_attention on the same shapes and device kind. FLOPs: the
    forward's two matmuls over the causal half, 4 B N S^2 D / 2; forward + backward 3.5x that (the backward's five
    matmuls, FlashAttention's convention)."""
    from moe_jax.nn.query_blocks import causal_block_attention

    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(batch, seq, n, dim)), jnp.bfloat16) for n in (heads, kv_heads, kv_heads))
    flops = 4 * batch * heads * seq * seq * dim / 2
    implementations = {"xla": partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")}
    if jax.default_backend() == "gpu":
        implementations["cudnn"] = partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    else:
        implementations["query_blocks"] = partial(causal_block_attention, scale=dim ** -0.5)
    results, outputs = {}, {}
    for name, attend in implementations.items():
        forward = jax.jit(attend)
        grad = jax.jit(jax.grad(lambda q, k, v, f=attend: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2),
                                argnums=(0, 1, 2)))
        try:
            outputs[name] = np.asarray(forward(q, k, v).astype(jnp.float32))
            fwd = median_seconds(forward, q, k, v, repeats=repeats)
            both = median_seconds(grad, q, k, v, repeats=repeats)
        except Exception as error:  # an implementation this device lacks is reported, not hidden
            results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            report(f"  {name}: failed: {results[name]['error']}")
            continue
        results[name] = {"forward_ms": fwd * 1e3, "forward_tflops": flops / fwd / 1e12,
                         "fwd_bwd_ms": both * 1e3, "fwd_bwd_tflops": 3.5 * flops / both / 1e12,
                         "fwd_bwd_mfu": 3.5 * flops / both / peak}
        report(f"  {name}: forward {fwd * 1e3:.2f} ms {flops / fwd / 1e12:.1f} TFLOP/s; fwd+bwd {both * 1e3:.2f} ms "
               f"{3.5 * flops / both / 1e12:.1f} TFLOP/s (MFU {3.5 * flops / both / peak:.1%})")
    for name, output in outputs.items():
        if name != "xla" and "xla" in outputs:
            results[name]["max_abs_diff_vs_xla"] = float(np.abs(output - outputs["xla"]).max())
            report(f"  {name}: max |output - xla's| {results[name]['max_abs_diff_vs_xla']:.3e}")
    results["torch_sdpa"] = torch_sdpa(q, k, v, flops, repeats, report)
    return results


def torch_sdpa(q, k, v, flops: float, repeats: int, report) -> dict:
    """torch's scaled_dot_product_attention (causal, GQA) on the same inputs, on CUDA when JAX runs on a GPU."""
    try:
        import torch
    except ImportError:
        report("  torch_sdpa: torch is not importable here")
        return {"error": "torch not importable"}
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not torch.cuda.is_available():
        report("  torch_sdpa: torch has no CUDA here")
        return {"error": "torch without CUDA"}
    device = "cuda" if on_gpu else "cpu"
    tq, tk, tv = (torch.from_numpy(np.array(a.astype(jnp.float32))).to(device, torch.bfloat16).transpose(1, 2)
                  .contiguous().requires_grad_() for a in (q, k, v))

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)

    def forward():
        with torch.no_grad():
            sdpa()

    def forward_backward():
        (sdpa().float() ** 2).sum().backward()

    def seconds(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    fwd, both = seconds(forward), seconds(forward_backward)
    report(f"  torch_sdpa ({device}): forward {fwd * 1e3:.2f} ms {flops / fwd / 1e12:.1f} TFLOP/s; fwd+bwd "
           f"{both * 1e3:.2f} ms {3.5 * flops / both / 1e12:.1f} TFLOP/s")
    return {"device": device, "forward_ms": fwd * 1e3, "forward_tflops": flops / fwd / 1e12,
            "fwd_bwd_ms": both * 1e3, "fwd_bwd_tflops": 3.5 * flops / both / 1e12}


def train_step(config: dict, layers: int, batch: int, seq: int, peak: float, repeats: int, report) -> dict:
    """The default backend's train step, then the same step with attention on jax's XLA path (the default takes
    cuDNN's fused kernel on a GPU: `nn.attention_core.fused_kernel`); if the default fails, the failure is
    reported and the tiled scan's step is measured instead."""
    try:
        result = train_step_with(None, config, layers, batch, seq, peak, repeats, report)
    except Exception as error:
        report(f"  default backend failed: {type(error).__name__}: {str(error)[:300]}; measuring backend 'tiled'")
        return {"default_backend_error": f"{type(error).__name__}: {error}"[:300],
                **train_step_with("tiled", config, layers, batch, seq, peak, repeats, report)}
    if jax.default_backend() == "gpu":
        with xla_attention():
            result["xla_attention"] = train_step_with(None, config, layers, batch, seq, peak, repeats, report,
                                                      label="attention on XLA's path, ")
    return result


@contextmanager
def xla_attention():
    """Traces inside take jax's XLA attention where the default would take cuDNN's."""
    from moe_jax.nn import attention_core

    chooser = attention_core.fused_kernel
    attention_core.fused_kernel = lambda *args, **kwargs: "xla"
    try:
        yield
    finally:
        attention_core.fused_kernel = chooser


def train_step_with(backend: str | None, config: dict, layers: int, batch: int, seq: int, peak: float, repeats: int,
                    report, label: str = "") -> dict:
    model = Qwen3MoeForCausalLM({**config, "num_hidden_layers": layers}, devices=jax.devices()[:1],
                                experts_backend=backend)
    model.init_params(seed=0)
    step = make_train_step(model, optax.adamw(1e-5), mixed_precision=True)
    state = step.init_state(params=model.params)
    ids = np.random.default_rng(2).integers(0, config["vocab_size"], (batch, seq))
    seconds, metrics = median_step_seconds(step, state, {"input_ids": ids}, repeats)
    tokens_per_s = batch * seq / seconds
    # The model FLOPs `moe-jax train --peak-tflops` reports MFU with (6 x active parameters + causal attention).
    mfu = train_flops_per_token(model, seq) * tokens_per_s / peak
    result = {"backend": backend or default_backend(jax.default_backend()), "layers": layers, "batch": batch,
              "seq": seq, "step_ms": seconds * 1e3, "tokens_per_s": tokens_per_s, "mfu": mfu,
              "loss": float(metrics["loss"])}
    report(f"  {label}backend {result['backend']}, {layers} layers, batch {batch} x {seq}: {seconds * 1e3:.1f} ms/step, "
           f"{tokens_per_s:.0f} tokens/s, MFU {mfu:.1%} (loss {result['loss']:.3f})")
    return result


def median_step_seconds(run, state, batch: dict, repeats: int) -> tuple[float, dict]:
    """(the median seconds of `repeats` steps of `run(state, batch) -> (state, metrics)` after a first, untimed one
    (its compilation), the last step's metrics); the state is donated, each step takes the one before's."""
    state, metrics = run(state, batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = run(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return statistics.median(times), metrics


def offload(config: dict, layers: int, batch: int, seq: int, repeats: int, report) -> dict:
    """The train step of `train_step` with its state kept in host memory between steps (`make_train_step(offload=)`:
    none, the optimizer state, all): XLA's memory analysis of the compiled step (the device's bytes at the step's
    peak, and the host's) and the step's time. What offload saves at the peak depends on when XLA brings the state
    back: only a GPU's analysis separates the two memories (XLA:CPU's does not)."""
    model = Qwen3MoeForCausalLM({**config, "num_hidden_layers": layers}, devices=jax.devices()[:1])
    model.init_params(seed=0)
    ids = np.random.default_rng(2).integers(0, config["vocab_size"], (batch, seq))
    results = {}
    for choice in (None, "optimizer", "all"):
        step = make_train_step(model, optax.adamw(1e-5), mixed_precision=True, offload=choice)
        state = step.init_state(params=model.params)
        compiled = step.lower(state, {"input_ids": ids}).compile()   # every parameter trained: no frozen arguments
        analysis = compiled.memory_analysis()
        device = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
                  + analysis.temp_size_in_bytes)
        host = (analysis.host_argument_size_in_bytes + analysis.host_output_size_in_bytes
                - analysis.host_alias_size_in_bytes + analysis.host_temp_size_in_bytes)
        seconds, _ = median_step_seconds(compiled, state, {"input_ids": ids}, repeats)   # the program analysed
        name = choice or "none"
        results[name] = {"device_bytes": device, "host_bytes": host, "step_ms": seconds * 1e3}
        report(f"  offload {name}: device {device / 2**20:.1f} MiB, host {host / 2**20:.1f} MiB at the step's peak; "
               f"{seconds * 1e3:.1f} ms/step")
    return results


def rebalance_probe(config: dict, layers: int, batch: int, seq: int, repeats: int, report) -> dict:
    """The next batch's forward pass a re-placement runs (`NextLoadProbe`) against the train step on the same batch
    (mixed precision, AdamW, one device): the median of `repeats` each after a first, untimed call."""
    model = Qwen3MoeForCausalLM({**config, "num_hidden_layers": layers}, devices=jax.devices()[:1])
    model.init_params(seed=0)
    step = make_train_step(model, optax.adamw(1e-5), mixed_precision=True)
    state = step.init_state(params=model.params)
    inputs = {"input_ids": np.random.default_rng(2).integers(0, config["vocab_size"], (batch, seq))}
    probe = NextLoadProbe(step)
    probe(state, inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        probe(state, inputs)                    # returns host numpy: waited for
        times.append(time.perf_counter() - start)
    probe_seconds = statistics.median(times)
    step_seconds, _ = median_step_seconds(step, state, inputs, repeats)   # donates the state: after the probe
    result = {"probe_ms": probe_seconds * 1e3, "step_ms": step_seconds * 1e3, "ratio": probe_seconds / step_seconds}
    report(f"  next batch's load {probe_seconds * 1e3:.1f} ms against a train step's {step_seconds * 1e3:.1f} ms "
           f"({result['ratio']:.2f}x), {layers} layers, batch {batch} x {seq}")
    return result


def serving(config: dict, layers: int, requests: int, slots: int, small: bool, report) -> dict:
    """Continuous batching (`ServingEngine`, no HTTP) against static `generate` batches of the same requests, bf16:
    generated tokens per second of each, over one pass (every program compiled before it)."""
    from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings, ServingEngine

    model = Qwen3MoeForCausalLM({**config, "num_hidden_layers": layers}, devices=jax.devices()[:1],
                                dtype=jnp.bfloat16)
    model.init_params(seed=0)
    rng = np.random.default_rng(5)
    prompts, outputs = (8, 48) if small else (32, 512), (4, 24) if small else (32, 256)
    work = [([int(t) for t in rng.integers(3, config["vocab_size"], int(rng.integers(*prompts)))],
             int(rng.integers(*outputs))) for _ in range(requests)]
    length = prompts[1] + outputs[1] + 1
    # Pages of 128 tokens: 4 page-table widths, so 8 programs to compile within the check's time.
    engine = ServingEngine(model, ContinuousBatchingConfig(max_slots=slots, page_size=16 if small else 128,
                                                           max_model_len=length, prefill_chunk=min(256, length)))
    engine.compile_all()

    def run(tag: str) -> float:
        start = time.perf_counter()
        for i, (prompt, new) in enumerate(work):
            engine.add(Request(f"{tag}{i}", prompt, RequestSettings(max_new_tokens=new)))
        while engine.has_work():
            engine.step()
        return time.perf_counter() - start

    run("warm")
    engine_s = run("timed")
    tokens = sum(new for _, new in work)

    def static_pass() -> float:
        start = time.perf_counter()
        for first in range(0, len(work), slots):
            batch = work[first:first + slots]
            width = max(len(prompt) for prompt, _ in batch)
            ids, mask = np.zeros((len(batch), width), np.int32), np.zeros((len(batch), width), np.int32)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
            model.generate(ids, mask, max_new_tokens=max(new for _, new in batch), eos_token_id=-1, pad_token_id=0)
        return time.perf_counter() - start

    static_pass()
    static_s = static_pass()
    result = {"requests": requests, "slots": slots, "layers": layers, "generated_tokens": tokens,
              "engine_tokens_per_s": tokens / engine_s, "static_tokens_per_s": tokens / static_s,
              "ratio": static_s / engine_s, "programs": len(engine.compiled_shapes)}
    report(f"  {requests} requests, {slots} slots, {layers} layers (bf16): continuous batching "
           f"{result['engine_tokens_per_s']:.0f} tokens/s, static generate {result['static_tokens_per_s']:.0f} "
           f"({result['ratio']:.2f}x)")
    return result


def speculation(config: dict, layers: int, requests: int, small: bool, report) -> dict:
    """`ServingEngine` with n-gram speculation (4 drafts) and without, bf16, 8 slots: tokens/s, acceptance, greedy
    agreement, and the mean time of each kind of step (decode, verify), timed one step at a time."""
    from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings, ServingEngine

    model = Qwen3MoeForCausalLM({**config, "num_hidden_layers": layers}, devices=jax.devices()[:1],
                                dtype=jnp.bfloat16)
    model.init_params(seed=0)
    rng = np.random.default_rng(7)
    segment, repeats, new = (8, 3, 16) if small else (48, 4, 128)
    work = [(np.tile(rng.integers(3, config["vocab_size"], segment), repeats).tolist(), new) for _ in range(requests)]
    length = segment * repeats + new + 8
    results, tokens_by_mode = {}, {}
    for mode in (None, "ngram"):
        engine = ServingEngine(model, ContinuousBatchingConfig(
            max_slots=8, page_size=16 if small else 64, max_model_len=length, prefill_chunk=min(256, length),
            speculative=mode, num_speculative_tokens=4))
        engine.compile_all()

        def run(tag: str) -> tuple[float, dict, dict]:
            for i, (prompt, count) in enumerate(work):
                engine.add(Request(f"{tag}{i}", prompt, RequestSettings(max_new_tokens=count)))
            times, tokens, start = {}, {}, time.perf_counter()
            while engine.has_work():
                before, began = dict(engine.steps), time.perf_counter()
                for event in engine.step():
                    tokens.setdefault(event.request.request_id, []).extend(event.new_tokens)
                kinds = [kind for kind, count in engine.steps.items() if count > before.get(kind, 0)]
                times.setdefault("+".join(sorted(kinds)), []).append(time.perf_counter() - began)
            return time.perf_counter() - start, times, tokens

        run("warm")
        seconds, times, tokens = run("timed")
        generated = sum(len(ids) for ids in tokens.values())
        name = mode or "off"
        tokens_by_mode[name] = [tokens[f"timed{i}"] for i in range(len(work))]
        results[name] = {"tokens_per_s": generated / seconds, "acceptance": getattr(engine, "acceptance_rate", None),
                         "step_ms": {kind: 1e3 * statistics.median(values) for kind, values in times.items()},
                         "steps": {kind: len(values) for kind, values in times.items()}}
        report(f"  speculative {name}: {results[name]['tokens_per_s']:.0f} tokens/s; median ms per step "
               + ", ".join(f"{kind} {ms:.2f} (x{results[name]['steps'][kind]})"
                           for kind, ms in results[name]["step_ms"].items())
               + (f"; acceptance {results[name]['acceptance']:.2f}" if mode else ""))
    verify, decode = results["ngram"]["step_ms"].get("verify"), results["off"]["step_ms"].get("decode")
    results["speedup"] = results["ngram"]["tokens_per_s"] / results["off"]["tokens_per_s"]
    results["verify_over_decode"] = None if verify is None or decode is None else verify / decode
    results["greedy_tokens_equal"] = tokens_by_mode["ngram"] == tokens_by_mode["off"]
    report(f"  ngram / off {results['speedup']:.2f}x; a verify step costs "
           + ("-" if results["verify_over_decode"] is None else f"{results['verify_over_decode']:.2f}x")
           + f" a decode step; greedy tokens equal: {results['greedy_tokens_equal']}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for gpu_check.json and gpu_check.txt")
    parser.add_argument("--small", action="store_true", help="toy shapes (checks the code paths on any machine)")
    parser.add_argument("--tokens", type=int, default=16384, help="routed tokens of the MoE-layer benchmark")
    # 2 layers at batch 2 fit an H100's 80 GB (4 full-width layers at batch 8 x 2048 ran out of its memory).
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the train-step benchmark")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 / H200 SXM: 989)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    args = parser.parse_args()
    only = args.only.split(",")
    if unknown := sorted(set(only) - set(SECTIONS)):
        parser.error(f"--only {args.only}: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.small:
        args.tokens, args.layers, args.batch, args.seq, args.repeats = 256, 2, 2, 32, 2
    config = TOY if args.small else QWEN3_30B_A3B
    peak = args.peak_tflops * 1e12
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    device = jax.devices()[0]
    results = {"jax": jax.__version__, "device": str(device), "platform": device.platform,
               "device_kind": getattr(device, "device_kind", ""), "small": args.small, "backends": backends()}
    report(f"jax {jax.__version__} on {device.platform} ({results['device_kind']}); backends {results['backends']}")
    sections = [("correctness", lambda: correctness(config, report)),
                      ("moe_layer", lambda: moe_layer(config, args.tokens, peak, args.repeats, report)),
                      ("attention", lambda: attention(config, args.batch, args.seq, peak, args.repeats, report)),
                      ("train_step", lambda: train_step(config, args.layers, args.batch, args.seq, peak, args.repeats,
                                                        report)),
                      ("offload", lambda: offload(config, args.layers, args.batch, args.seq, args.repeats, report)),
                      ("serving", lambda: serving(config, args.layers, 16 if args.small else 96,
                                                  4 if args.small else 32, args.small, report)),
                      ("speculation", lambda: speculation(config, args.layers, 8 if args.small else 32, args.small,
                                                          report)),
                      ("rebalance_probe", lambda: rebalance_probe(config, args.layers, args.batch, args.seq,
                                                                  args.repeats, report))]
    failed = False
    for name, run in sections:
        if name not in only:
            continue
        report(f"{name}:")
        start = time.perf_counter()
        try:
            results[name] = run()
        except Exception as error:  # reported; the sections after it still run
            failed = True
            results[name] = {"error": f"{type(error).__name__}: {error}"[:600]}
            report(f"  failed: {results[name]['error']}")
        report(f"  ({time.perf_counter() - start:.0f} s)")
        # What finished survives a timeout.
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
        (out / "gpu_check.txt").write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
