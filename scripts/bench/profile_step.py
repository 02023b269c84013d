"""Where one device's train step spends its time (CPU), against the dense-matmul rate of the same run.

    python scripts/bench/profile_step.py [--batch 8] [--seq 128] [--repeats 5] [--backend tiled]

The model is scripts/bench/bench_vs_reference.py's Qwen3-MoE (hidden 256, 4 layers, 16 experts top-4, vocab 4096;
random weights), on one device, fp32. Each part is jitted alone and timed as the median of `--repeats`
calls after a warm-up:

    train step       make_train_step(adamw) on the batch (what bench_vs_reference times)
    loss + grad      jax.value_and_grad of the step's loss (no optimizer)
    forward          model.apply
    ..., stubbed     the same with every experts call replaced by a stand-in (their share is the difference)
    experts          one layer's experts (sort, grouped matmuls, unsort) on its routed tokens, fwd and fwd+bwd
    attention        one layer's attention, fwd and fwd+bwd
    head + loss      lm_head and the chunked cross entropy, fwd+bwd
    dense matmul     [N*K, H] x [H, 2I] and [N*K, I] x [I, H] as plain dots: the FLOPs of the experts

and prints milliseconds, the share of the train step (layer parts times the number of layers), and the
achieved GFLOP/s of the experts against the dense matmul's. Figures are ratios within one run (shared
machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.module_tree import unflatten  # noqa: E402
from moe_jax.nn.attention import attention  # noqa: E402
from moe_jax.nn.linear import linear  # noqa: E402
from moe_jax.nn.rotary import rope_inverse_frequencies, rope_parameters_from_config, rotary_cos_sin  # noqa: E402
from moe_jax.ops.experts import swiglu_experts  # noqa: E402
from moe_jax.ops.routing import softmax_top_k  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from moe_jax.training.loss import chunked_cross_entropy  # noqa: E402
from scripts.bench.bench_vs_reference import CONFIG  # noqa: E402
from scripts.bench.timing import median_seconds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default=None, help="grouped-matmul backend (default: the platform's)")
    parser.add_argument("--scan-layers", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--remat", default="none", help="the model's remat policy")
    args = parser.parse_args()

    scan = {"auto": "auto", "true": True, "false": False}[args.scan_layers]
    model = Qwen3MoeForCausalLM(CONFIG, devices=jax.devices()[:1], experts_backend=args.backend, scan_layers=scan,
                                remat=args.remat)
    model.init_params(seed=0)
    c, layers = model.config, model.config.num_hidden_layers
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, c.vocab_size, (args.batch, args.seq)), jnp.int32)
    tokens = args.batch * args.seq
    results: dict[str, float] = {}

    step = make_train_step(model, optax.adamw(1e-4))
    state = step.init_state(params=model.params)
    batch = {"input_ids": np.asarray(ids)}

    def one_step(state):
        return step(state, batch)[0]

    jax.block_until_ready(one_step(state))  # compile (and the first, donated state)
    state = step.init_state(params=model.params)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        state = jax.block_until_ready(one_step(state))
        times.append(time.perf_counter() - start)
    results["train step"] = statistics.median(times)

    def loss(params):
        logits = model.apply(params, ids, inference=False).logits[:, :-1]
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, ids[:, 1:, None], axis=-1))

    results["loss + grad"] = median_seconds(jax.jit(jax.value_and_grad(loss)), model.params, repeats=args.repeats)
    results["forward"] = median_seconds(jax.jit(lambda p: model.apply(p, ids).logits), model.params, repeats=args.repeats)
    # The model without its experts' work: a stand-in keeps their inputs and weights in the graph.
    stubbed = Qwen3MoeForCausalLM(CONFIG, devices=jax.devices()[:1], scan_layers=scan, remat=args.remat)
    for experts in stubbed.sharded_experts.values():
        experts.experts_forward = lambda hidden, ids, w, gate_up_proj, down_proj: (
            hidden * w.sum(-1, keepdims=True) + 0 * (gate_up_proj.sum() + down_proj.sum()))

    def stubbed_loss(params):
        logits = stubbed.apply(params, ids, inference=False).logits[:, :-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), ids[:, 1:, None], axis=-1))

    results["loss + grad, experts stubbed"] = median_seconds(jax.jit(jax.value_and_grad(stubbed_loss)),
                                                             model.params, repeats=args.repeats)
    results["forward, experts stubbed"] = median_seconds(jax.jit(lambda p: stubbed.apply(p, ids).logits),
                                                         model.params, repeats=args.repeats)

    # One layer's parts, on inputs of the model's shapes.
    weights = unflatten(model.params)["model"]["layers"]
    layer = weights[next(iter(weights))]
    layer = jax.tree.map(lambda a: a[0] if a.ndim and a.shape[0] == layers and model.layer_stack.runs[0].scanned
                         else a, layer)
    hidden = jnp.asarray(rng.normal(size=(tokens, c.hidden_size)), jnp.float32)
    logits = linear(layer["mlp"]["gate"], hidden)
    top_w, top_i = softmax_top_k(logits, c.num_experts_per_tok, normalize=True)
    experts = layer["mlp"]["experts"]

    def experts_fwd(x, gate_up, down):
        return swiglu_experts(x, top_i, top_w, gate_up, down, backend=args.backend)

    def experts_fwd_bwd(x, gate_up, down):
        return jax.grad(lambda *a: jnp.sum(experts_fwd(*a) ** 2), argnums=(0, 1, 2))(x, gate_up, down)

    results["experts fwd"] = median_seconds(jax.jit(experts_fwd), hidden, experts["gate_up_proj"], experts["down_proj"],
                                   repeats=args.repeats)
    results["experts fwd+bwd"] = median_seconds(jax.jit(experts_fwd_bwd), hidden, experts["gate_up_proj"],
                                       experts["down_proj"], repeats=args.repeats)

    rows = tokens * c.num_experts_per_tok
    x_rows = jnp.asarray(rng.normal(size=(rows, c.hidden_size)), jnp.float32)
    w_up = jnp.asarray(rng.normal(size=(c.hidden_size, 2 * c.moe_intermediate_size)), jnp.float32)
    w_down = jnp.asarray(rng.normal(size=(c.moe_intermediate_size, c.hidden_size)), jnp.float32)

    def dense(x, w_up, w_down):
        h = x @ w_up
        return (jax.nn.silu(h[:, :c.moe_intermediate_size]) * h[:, c.moe_intermediate_size:]) @ w_down

    results["dense matmul fwd"] = median_seconds(jax.jit(dense), x_rows, w_up, w_down, repeats=args.repeats)

    inv_freq, scaling = rope_inverse_frequencies(rope_parameters_from_config(c.to_dict()))
    positions = jnp.broadcast_to(jnp.arange(args.seq)[None], (args.batch, args.seq))
    cos, sin = rotary_cos_sin(positions, inv_freq, scaling)
    h3 = hidden.reshape(args.batch, args.seq, -1)
    options = dict(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                   qk_norm_kind="per_head", rms_norm_eps=c.rms_norm_eps)

    def attention_fwd(attn, h):
        return attention(attn, h, cos, sin, **options)

    results["attention fwd"] = median_seconds(jax.jit(attention_fwd), layer["self_attn"], h3, repeats=args.repeats)
    results["attention fwd+bwd"] = median_seconds(
        jax.jit(jax.grad(lambda a, h: jnp.sum(attention_fwd(a, h) ** 2), argnums=(0, 1))), layer["self_attn"], h3,
        repeats=args.repeats)

    head = unflatten(model.params)["lm_head"]
    targets = jnp.roll(ids, -1, axis=1)

    def head_loss(head, h):
        total, count = chunked_cross_entropy(h, targets, lambda x: linear(head, x), chunk=1024)
        return total / count

    results["head + loss fwd+bwd"] = median_seconds(jax.jit(jax.grad(head_loss, argnums=(0, 1))), head, h3,
                                           repeats=args.repeats)

    step_time = results["train step"]
    per_layer = {"experts fwd", "experts fwd+bwd", "attention fwd", "attention fwd+bwd"}
    print(f"one device, batch {args.batch} x {args.seq} = {tokens} tokens, {layers} layers (scan_layers="
          f"{args.scan_layers}, remat={args.remat}), backend {args.backend or 'default'}; train step "
          f"{tokens / step_time:.0f} tokens/s")
    print(f"{'part':<32}{'ms':>10}{'x layers':>10}{'% of step':>11}")
    for name, seconds in results.items():
        scaled = seconds * (layers if name in per_layer else 1)
        print(f"{name:<32}{seconds * 1e3:>10.2f}{scaled * 1e3:>10.2f}{100 * scaled / step_time:>10.0f}%")
    flops = 2 * rows * c.hidden_size * 3 * c.moe_intermediate_size
    print(f"experts fwd: {flops / results['experts fwd'] / 1e9:.1f} GFLOP/s; dense matmul of the same FLOPs: "
          f"{flops / results['dense matmul fwd'] / 1e9:.1f} GFLOP/s "
          f"({results['dense matmul fwd'] / results['experts fwd']:.0%} of dense)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
