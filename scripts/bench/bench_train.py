"""Training-step benchmark: tokens/s per layout, dispatch-buffer bytes, and what the overflow check costs.

    python scripts/bench/bench_train.py [--batch-size 16] [--seq-len 128] [--steps 5] [--repeats 3]
                                  [--layouts 1,fsdp8-ep8,tp2-fsdp4-ep4,tp2-ep2-fsdp4-all_reduce]
                                  [--check-layout fsdp8-ep8] [--hidden 128] [--no-first-rung]
    python scripts/bench/bench_train.py --lora-rank 8 [--layouts 1,fsdp8-ep8] ...   # LoRA against full fine-tuning

A layout is `1` (one device, no layout) or sizes and an optional EP implementation joined by `-`:
`tp2-fsdp4-ep4`, `tp2-ep2-fsdp4-all_reduce`. Layouts that `DistributedConfig` or the model reject, or that
need more devices than JAX has, are skipped with the reason (the default list ends with one the model
rejects, `tp2-fsdp4-ep4-all_reduce`: all_reduce needs ep_size == tp_size). Runs on 8 virtual CPU devices (set here
before JAX starts); on CPU they share the machine's cores, so ratios between layouts show overheads, not
speedups.

Model: a small Qwen3-MoE (4 layers, layer 0 dense, layers 1-3 sparse and scanned; 8 experts, top-2), fp32,
adamw, random tokens. Prints:

1. the train step (`make_train_step`, state donated) per layout: the first call (compile + one step) and
   the steady step time, median over `--repeats` loops of `--steps` steps with one `block_until_ready`
   at the end of each loop; tokens/s (batch x sequence per step) and the ratio to the one-device figure
   of the same run. EP layouts run at the capacity that never overflows (the ladder's largest) and, unless
   `--no-first-rung`, at the ladder's first rung; a step whose dispatch overflowed is computed but not
   applied (`metrics["applied"]` False, sticky), which is reported.
2. the dispatch buffer per MoE layer and device against the rows routed through it, as the EP
   implementation sizes it (`buffer_rows` of the implementation the train step uses, times its number of
   buffers: one per peer for all_to_all, one for all_reduce), next to the size one layer call reports
   (`DispatchStatistics.buffer_rows`) and the padding it carried on uniformly random routing.
3. the overflow check in steady state: the same layout and capacity compiled with `check_overflow=True`
   and `False`, timed in interleaved loops; ratio of medians and median of the paired ratios.

With `--lora-rank R` it prints instead, per layout, full fine-tuning against a LoRA adapter of rank R (alpha 2R)
on every attention projection and both fused expert weights (`moe_jax.lora`), at the largest capacity, their
loops interleaved: ms/step, tokens/s, and the train state one device holds (parameters plus AdamW moments: for
LoRA the adapter's; the frozen base weights it also holds are shown apart).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.distributed.capacity import buffer_rows as rows_of_one_buffer  # noqa: E402
from moe_jax.distributed.expert_parallel import AllReduceEP, tp_row_slice  # noqa: E402
from moe_jax.lora import LoraConfig  # noqa: E402
from moe_jax.training.memory import human_bytes, train_state_memory  # noqa: E402
from moe_jax.training.step import make_train_step  # noqa: E402

DEFAULT_LAYOUTS = "1,fsdp8-ep8,tp2-fsdp4-ep4,tp2-ep2-fsdp4-all_reduce,tp2-fsdp4-ep4-all_reduce"
LAYOUT_SIZES = {"tp": "tp_size", "fsdp": "fsdp_size", "ep": "ep_size", "dp_replicate": "dp_replicate_size"}
BATCHES = 4  # distinct device-resident batches the steps cycle through


def bench_config(hidden: int) -> dict:
    """A Qwen3-MoE twice the demo's width (moe_jax/cli/demo.py DEMO_CONFIG), sized for 10-200 ms CPU steps."""
    return dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )


# ---- layouts -----------------------------------------------------------------------------------------
def parse_layout(spec: str) -> dict | None:
    """`1` -> None (one device); `tp2-fsdp4-ep4[-all_reduce]` -> DistributedConfig keyword arguments."""
    if spec.strip() == "1":
        return None
    kwargs = {}
    for part in spec.strip().split("-"):
        match = re.fullmatch(r"(tp|fsdp|ep|dp_replicate)(\d+)", part)
        if match:
            kwargs[LAYOUT_SIZES[match.group(1)]] = int(match.group(2))
        else:
            kwargs["ep_implementation"] = part
    return kwargs


def build_model(spec: str, config: dict):
    """(model with random parameters, None) or (None, why the layout is skipped)."""
    kwargs = parse_layout(spec)
    try:
        distributed = None if kwargs is None else DistributedConfig(**kwargs)
        count = 1 if distributed is None else distributed.num_devices
        if count > jax.device_count():
            return None, f"needs {count} devices, JAX has {jax.device_count()}"
        model = Qwen3MoeForCausalLM(config, distributed, devices=jax.devices()[:count], scan_layers="auto")
    except (ValueError, NotImplementedError) as error:
        return None, f"{type(error).__name__}: {error}"
    model.init_params(0)
    return model, None


def implementation_of(model):
    """The EP implementation a training step uses in each sparse layer (None without dispatch)."""
    implementation = model.sharded_experts[model.sparse_layers()[0]].implementation
    if implementation is None:
        return None
    if hasattr(implementation, "choose"):  # "auto": all_to_all in training
        implementation = implementation.choose(inference=False)
    return implementation


def describe(spec: str, model) -> str:
    implementation = implementation_of(model)
    if implementation is None:
        return "1 device" if spec.strip() == "1" else spec
    name = "all_reduce" if isinstance(implementation, AllReduceEP) else "all_to_all"
    sizes = spec.split("-")
    return " ".join(part for part in sizes if re.fullmatch(r"[a-z_]+\d+", part)) + f" {name}"


def capacities(model, first_rung: bool) -> list:
    """The capacities to time: None without EP; the ladder's largest (and first rung) with it."""
    if model.layout.ep_size == 1:
        return [None]
    ladder = model.capacity_schedule.ladder
    return [ladder[-1]] + ([ladder[0]] if first_rung and ladder[0] != ladder[-1] else [])


# ---- timing ------------------------------------------------------------------------------------------
def device_batches(model, batch_size: int, seq_len: int) -> list[dict]:
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    return [{"input_ids": jax.device_put(rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int32),
                                         model.batch_sharding())} for _ in range(BATCHES)]


class StepRunner:
    """A train step and its donated state, stepping over device-resident batches; keeps every step's metrics."""

    def __init__(self, train_step, capacity, batches):
        self.train_step = train_step
        self.state = train_step.init_state(seed=0, capacity=capacity)
        self.batches = batches
        self.metrics: list[dict] = []

    def step(self) -> None:
        batch = self.batches[len(self.metrics) % len(self.batches)]
        self.state, metrics = self.train_step(self.state, batch)
        self.metrics.append(metrics)

    def first_step_seconds(self) -> float:
        """The first call: tracing, compilation and one step."""
        start = time.perf_counter()
        self.step()
        jax.block_until_ready((self.state, self.metrics[-1]))
        return time.perf_counter() - start

    def seconds_per_step(self, steps: int) -> float:
        """`steps` steps dispatched back to back, one block at the end."""
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        jax.block_until_ready((self.state, self.metrics[-1]))
        return (time.perf_counter() - start) / steps

    def applied_summary(self) -> str:
        values = jax.device_get(self.metrics)
        for index, metrics in enumerate(values):
            if not bool(metrics["applied"]):
                return (f"skipped from step {index + 1} of {len(values)} (dropped {int(metrics['dropped'])} pairs, "
                        f"required capacity {float(metrics['required_capacity'])})")
        return f"all {len(values)} applied"

    def last_loss(self) -> float:
        return float(self.metrics[-1]["loss"])


def warm_runner(train_step, capacity, batches) -> tuple[StepRunner, float]:
    """A runner past its compilation and one more step; returns it and its first call's seconds."""
    runner = StepRunner(train_step, capacity, batches)
    first = runner.first_step_seconds()
    runner.seconds_per_step(1)
    return runner, first


def time_steps(runner: StepRunner, steps: int, repeats: int) -> list[float]:
    return [runner.seconds_per_step(steps) for _ in range(repeats)]


def time_check_pair(train_step, model, capacity, batches, args) -> tuple[StepRunner, dict]:
    """check_overflow=True (`train_step`) vs False on the same layout and capacity, loops interleaved.
    Returns the checked runner (its loops are the layout's figure) and the comparison."""
    on, on_first = warm_runner(train_step, capacity, batches)
    off, off_first = warm_runner(make_train_step(model, optax.adamw(1e-3), check_overflow=False), capacity, batches)
    on_times, off_times = [], []
    for _ in range(args.repeats):
        on_times.append(on.seconds_per_step(args.steps))
        off_times.append(off.seconds_per_step(args.steps))
    return on, {"capacity": capacity, "on_first": on_first, "on_times": on_times, "on_applied": None,
                "off_first": off_first, "off_times": off_times, "off_applied": off.applied_summary()}


# ---- dispatch buffers --------------------------------------------------------------------------------
def buffer_plan(model, capacity, batch_size: int, seq_len: int) -> dict:
    """Rows per MoE layer and device as the implementation sizes its buffers, and the rows routed through them."""
    config = model.config
    tokens = batch_size // model.data_parallel_size * seq_len  # rows of the batch a device holds
    top_k = config.num_experts_per_tok
    implementation = implementation_of(model)
    plan = {"tokens": tokens, "token_pairs": tokens * top_k, "implementation": None, "buffer_rows": None}
    if implementation is None:
        plan["routed"] = tokens * top_k  # every pair runs on this device's experts, no buffer
        return plan
    groups = implementation.groups
    if isinstance(implementation, AllReduceEP):
        pairs = tokens * top_k  # the shared batch's pairs; this device keeps those of its own experts
        routed = pairs / groups.ep_size  # balanced share
        plan["implementation"] = "all_reduce"
    else:
        pairs = tp_row_slice(tokens, groups.tp_size) * top_k  # this tp rank's slice, all sent
        routed = pairs
        plan["implementation"] = "all_to_all"
    # The implementation is built once, at the largest capacity; a call's capacity sizes its buffers.
    rows = rows_of_one_buffer(model.capacity_schedule.largest if capacity is None else capacity, pairs,
                              groups.ep_size)
    plan.update(pairs=pairs, routed=routed, num_buffers=implementation.num_buffers, rows_per_buffer=rows,
                buffer_rows=implementation.num_buffers * rows)
    plan["bytes"] = plan["buffer_rows"] * config.hidden_size * np.dtype(model.dtype).itemsize
    return plan


def measured_dispatch(model, capacity, batch_size: int, seq_len: int) -> dict:
    """One sparse layer's expert call on uniformly random top-k routing: its `DispatchStatistics`."""
    config = model.config
    layer = model.sparse_layers()[0]
    experts = model.sharded_experts[layer]
    rows = batch_size * seq_len
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((rows, config.hidden_size), dtype=np.float32)
    index = np.argsort(rng.random((rows, config.num_experts)), axis=1)[:, :config.num_experts_per_tok]
    weights = np.full(index.shape, 1.0 / config.num_experts_per_tok, np.float32)
    hf = model.hf_params()
    prefix = f"model.layers.{layer}.mlp.experts."
    params = {name: hf[prefix + name] for name in ("gate_up_proj", "down_proj")}
    statistics = jax.jit(lambda h, i, w, p: experts(h, i, w, p, inference=False, capacity=capacity)[1])(
        hidden, index.astype(np.int32), weights, params)
    return {name: float(value) for name, value in jax.device_get(statistics.as_dict()).items()}


# ---- report ------------------------------------------------------------------------------------------
def header(args, config: dict) -> None:
    print(f"date: {time.strftime('%Y-%m-%d')}; python {platform.python_version()}, jax {jax.__version__}, "
          f"jaxlib {jaxlib.__version__}, optax {optax.__version__}, numpy {np.__version__}")
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, os.cpu_count() = {os.cpu_count()}; "
          f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"model: qwen3_moe hidden {config['hidden_size']}, {config['num_hidden_layers']} layers (layer 0 dense), "
          f"{config['num_experts']} experts top-{config['num_experts_per_tok']}, moe intermediate "
          f"{config['moe_intermediate_size']}, vocab {config['vocab_size']}, fp32, adamw")
    print(f"batch {args.batch_size} x {args.seq_len} = {args.batch_size * args.seq_len} tokens/step; "
          f"{args.repeats} loops of {args.steps} steps, medians\n")


def print_steps(rows: list[dict], baseline: float | None) -> None:
    print("\n== train step ==")
    print(f"{'layout':<28} {'capacity':>16} {'first call s':>12} {'compile~ s':>10} {'ms/step':>8} "
          f"{'tokens/s':>9} {'vs 1 dev':>8} {'loss':>7}  applied")
    for row in rows:
        ratio = f"{row['tokens_per_s'] / baseline:7.2f}x" if baseline else f"{'-':>8}"
        print(f"{row['layout']:<28} {row['capacity']:>16} {row['first']:12.1f} {row['first'] - row['step']:10.1f} "
              f"{row['step'] * 1e3:8.1f} {row['tokens_per_s']:9.0f} {ratio} {row['loss']:7.3f}  {row['applied']}")


def print_buffers(rows: list[dict]) -> None:
    print("\n== dispatch buffer per MoE layer and device (fp32 rows of hidden size) ==")
    print(f"{'layout':<28} {'capacity':>8} {'tokens':>6} {'T*K':>6} {'routed':>7} {'buffer rows':>18} "
          f"{'measured':>8} {'KiB':>7} {'buffer/routed':>13} {'filled (random)':>15} {'dropped':>7}")
    for row in rows:
        plan, stats = row["plan"], row["stats"]
        if plan["implementation"] is None:
            print(f"{row['layout']:<28} {'-':>8} {plan['tokens']:6d} {plan['token_pairs']:6d} {plan['routed']:7.0f} "
                  f"{'no dispatch buffer':>18}")
            continue
        layout_rows = f"{plan['num_buffers']} x {plan['rows_per_buffer']} = {plan['buffer_rows']}"
        measured = stats["buffer_rows"] * plan["num_buffers"]
        devices = row["devices"]
        filled = 1 - stats["padded"] / (devices * plan["buffer_rows"])
        print(f"{row['layout']:<28} {row['capacity']:8.2f} {plan['tokens']:6d} {plan['token_pairs']:6d} "
              f"{plan['routed']:7.0f} {layout_rows:>18} {measured:8.0f} {plan['bytes'] / 1024:7.1f} "
              f"{plan['buffer_rows'] / plan['routed']:12.2f}x {filled:14.1%} {stats['dropped']:7.0f}")
    print("routed: pairs through the device's buffers on balanced routing (all_to_all: its tp slice's T*K/tp, "
          "all sent; all_reduce: T*K/ep of the shared batch). measured: DispatchStatistics.buffer_rows x buffers "
          "of one layer call. all_to_all's forward holds 4 arrays of this size (sent, received, expert output, "
          "returned); all_reduce's 2 (gathered rows, expert output).")


def print_check(check: dict) -> None:
    on, off = np.median(check["on_times"]), np.median(check["off_times"])
    paired = np.median(np.asarray(check["on_times"]) / np.asarray(check["off_times"]))
    print(f"\n== overflow check in steady state: {check['layout']}, capacity {check['capacity']} ==")
    for flag, key in (("True ", "on"), ("False", "off")):
        times = check[f"{key}_times"]
        print(f"check_overflow={flag}: first call {check[f'{key}_first']:.1f} s, {np.median(times) * 1e3:.1f} ms/step "
              f"(loops: {', '.join(f'{t * 1e3:.1f}' for t in times)}); {check[f'{key}_applied']}")
    print(f"ratio with / without check: {on / off:.3f} (medians), {paired:.3f} (median of paired loops)")


# ---- LoRA against full fine-tuning ------------------------------------------------------------------------
def lora_config(rank: int) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def per_device_bytes(arrays) -> int:
    """Bytes the busiest device holds of `arrays` (a pytree of sharded arrays)."""
    from moe_jax.training.memory import leaf_bytes_by_device

    totals: dict = {}
    for leaf in jax.tree.leaves(arrays):
        for device, size in leaf_bytes_by_device(leaf).items():
            totals[device] = totals.get(device, 0) + size
    return max(totals.values(), default=0)


def bench_lora(spec: str, config: dict, args) -> list[dict]:
    """Full fine-tuning and LoRA on one layout, loops interleaved: one row each."""
    runners = {}
    for mode in ("full", f"lora r={args.lora_rank}"):
        model, reason = build_model(spec, config)
        if model is None:
            print(f"skip {spec}: {reason}", flush=True)
            return []
        if mode != "full":
            model.add_adapter(lora_config(args.lora_rank))
        train_step = make_train_step(model, optax.adamw(1e-3))
        capacity = capacities(model, False)[0]
        runner, first = warm_runner(train_step, capacity, device_batches(model, args.batch_size, args.seq_len))
        frozen = train_step.frozen() if not train_step.trainable.everything else {}
        runners[mode] = (runner, first, model, frozen)
    times = {mode: [] for mode in runners}
    for _ in range(args.repeats):
        for mode, (runner, *_) in runners.items():
            times[mode].append(runner.seconds_per_step(args.steps))
    rows = []
    for mode, (runner, first, model, frozen) in runners.items():
        seconds = float(np.median(times[mode]))
        memory = train_state_memory(runner.state)
        rows.append({"layout": describe(spec, model), "mode": mode, "first": first, "step": seconds,
                     "tokens_per_s": args.batch_size * args.seq_len / seconds, "state": memory.per_device,
                     "frozen": per_device_bytes(frozen), "trained": sum(leaf.size for leaf in
                                                                         jax.tree.leaves(runner.state.params)),
                     "applied": runner.applied_summary(), "loss": runner.last_loss()})
        print(f"{rows[-1]['layout']} {mode}: {seconds * 1e3:.1f} ms/step, {rows[-1]['applied']}", flush=True)
    return rows


def print_lora(rows: list[dict]) -> None:
    print("\n== LoRA against full fine-tuning (train state per device: parameters + AdamW moments) ==")
    print(f"{'layout':<22} {'mode':<10} {'first call s':>12} {'ms/step':>8} {'tokens/s':>9} {'vs full':>7} "
          f"{'trained':>9} {'state/device':>12} {'of which opt':>12} {'frozen/device':>13}")
    full = {row["layout"]: row for row in rows if row["mode"] == "full"}
    for row in rows:
        reference = full.get(row["layout"])
        ratio = f"{row['step'] / reference['step']:6.2f}x" if reference else f"{'-':>7}"
        state = row["state"]
        print(f"{row['layout']:<22} {row['mode']:<10} {row['first']:12.1f} {row['step'] * 1e3:8.1f} "
              f"{row['tokens_per_s']:9.0f} {ratio} {row['trained']:9d} {human_bytes(state['total']):>12} "
              f"{human_bytes(state['optimizer state']):>12} {human_bytes(row['frozen']):>13}")
    print("vs full: step time over full fine-tuning's on the same layout. frozen/device: the base weights a LoRA "
          "step reads but does not hold in its state (full fine-tuning's state holds them).")


# ---- main --------------------------------------------------------------------------------------------
def bench_layout(spec: str, config: dict, args, check_spec: str) -> tuple[list, list, dict | None]:
    """(step rows, buffer rows, overflow-check result) of one layout; prints its progress."""
    start = time.perf_counter()
    model, reason = build_model(spec, config)
    if model is None:
        print(f"skip {spec}: {reason}", flush=True)
        return [], [], None
    name = describe(spec, model)
    train_step = make_train_step(model, optax.adamw(1e-3))
    if (reason := train_step.batch_size_error(args.batch_size)) is not None:
        print(f"skip {spec}: {reason}", flush=True)
        return [], [], None
    batches = device_batches(model, args.batch_size, args.seq_len)
    tokens = args.batch_size * args.seq_len
    step_rows, buffer_rows, check = [], [], None
    for capacity in capacities(model, args.first_rung):
        if spec == check_spec and capacity == model.capacity_schedule.largest:
            runner, check = time_check_pair(train_step, model, capacity, batches, args)
            check.update(layout=name, on_applied=runner.applied_summary())
            first, times = check["on_first"], check["on_times"]
        else:
            runner, first = warm_runner(train_step, capacity, batches)
            times = time_steps(runner, args.steps, args.repeats)
        seconds = float(np.median(times))
        label = "-" if capacity is None else (
            f"{capacity} (largest)" if capacity == model.capacity_schedule.largest else f"{capacity} (1st rung)")
        step_rows.append({"layout": name, "capacity": label, "first": first, "step": seconds,
                          "tokens_per_s": tokens / seconds, "loss": runner.last_loss(),
                          "applied": runner.applied_summary(), "ep": model.layout.ep_size})
        plan = buffer_plan(model, capacity, args.batch_size, args.seq_len)
        stats = (measured_dispatch(model, capacity, args.batch_size, args.seq_len)
                 if plan["implementation"] is not None else None)
        buffer_rows.append({"layout": name, "capacity": capacity, "plan": plan, "stats": stats,
                            "devices": model.layout.num_devices})
        print(f"{name}, capacity {label}: first call {first:.1f} s, {seconds * 1e3:.1f} ms/step, "
              f"{step_rows[-1]['applied']}", flush=True)
        del runner
    print(f"({spec}: {time.perf_counter() - start:.0f} s in all)", flush=True)
    return step_rows, buffer_rows, check


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per figure (median)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                        help=f"comma-separated; `1` is one device (default {DEFAULT_LAYOUTS})")
    parser.add_argument("--check-layout", default="fsdp8-ep8",
                        help="layout on which check_overflow=True is timed against False ('' for none)")
    parser.add_argument("--no-first-rung", dest="first_rung", action="store_false",
                        help="time EP layouts at the largest capacity only")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="time a LoRA adapter of this rank against full fine-tuning instead (see above)")
    args = parser.parse_args(argv)

    config = bench_config(args.hidden)
    header(args, config)
    if args.lora_rank is not None:
        rows = [row for spec in args.layouts.split(",") for row in bench_lora(spec.strip(), config, args)]
        print_lora(rows)
        return 0
    step_rows, buffer_rows, checks = [], [], []
    for spec in args.layouts.split(","):
        steps, buffers, check = bench_layout(spec.strip(), config, args, args.check_layout.strip())
        step_rows += steps
        buffer_rows += buffers
        checks += [check] if check is not None else []
    baseline = next((row["tokens_per_s"] for row in step_rows if row["ep"] == 1 and row["layout"] == "1 device"),
                    None)
    print_steps(step_rows, baseline)
    print_buffers(buffer_rows)
    for check in checks:
        print_check(check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
