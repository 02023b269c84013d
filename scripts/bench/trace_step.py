"""Where a train step spends its time, op by op, from XLA's own profiler (CPU).

    python scripts/bench/trace_step.py [--forward] [--size default|large] [--batch 8] [--seq 128] [--steps 3] [--scan-layers auto|true|false] [--top 25]
                                 [--ops-of decoder.py] [--tp 2 --fsdp 2 --ep 4 --ep-implementation all_to_all] [--capacity 1.5]

With a layout (--tp / --fsdp / --ep) the step runs on that many virtual CPU devices and the op times are
summed over the devices' threads (thread time, not wall time).

bench_vs_reference's Qwen3-MoE (--size default: hidden 256, 4 layers, 16 experts top-4, vocab 4096), fp32, AdamW, one
device. The compiled step runs `--steps` times under `jax.profiler.trace`; every executed HLO op of the trace
(XLA:CPU's thunk events) gets its *self* time (its duration less the ops nested in it: the bodies of loops
and conditionals), and is attributed through the compiled HLO's metadata to the source line that emitted it
and to forward or backward (a `transpose(` in its JAX op name). Prints, per step:

    the time per source file and direction (moe_jax/ops/grouped_matmul_backends/tiled_scan.py backward, ...)
    the time per op kind (matmul: XLA's dot fusions; copy; select; dynamic slice/update; other fusions)
    the FLOPs of the model's matmuls against the dense-matmul rate measured in the same run: the
    hardware-limited step time, next to the measured one
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def _layout_devices(argv: list[str]) -> int:
    """Devices the command line's layout needs (read before JAX starts, to size the virtual CPU devices)."""
    sizes = {flag: 1 for flag in ("--tp", "--fsdp")}
    for flag in sizes:
        if flag in argv:
            sizes[flag] = int(argv[argv.index(flag) + 1])
    return sizes["--tp"] * sizes["--fsdp"]


from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(_layout_devices(sys.argv))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from scripts.bench.bench_vs_reference import SIZES  # noqa: E402
from scripts.bench.timing import matmul_flops_per_token, model_dense_rate  # noqa: E402

OP_METADATA = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}")
OP_KINDS = (("matmul", ("ynn_fusion", "dot", "dot_general", "convolution")), ("copy", ("copy", "transpose")),
            ("select", ("select", "add_select")), ("dynamic slice / update", ("dynamic",)))


def _tables(hlo_text: str) -> dict[str, dict[int, str]]:
    """The module's FileNames / FunctionNames / FileLocations / StackFrames tables: id -> text."""
    tables, current = {}, None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and re.match(r"^\d+ ", line):
            number, text = line.split(" ", 1)
            current[int(number)] = text
        elif not line.strip():
            current = None
    return tables


def op_sources(hlo_text: str) -> dict[str, tuple[str, bool]]:
    """HLO op name -> (the innermost moe_jax frame that emitted it, "file:line function", and whether the op
    is in the backward pass)."""
    tables = _tables(hlo_text)
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {k: dict((a, int(b)) for a, b in re.findall(r"(\w+)=(\d+)", v))
                 for k, v in tables.get("FileLocations", {}).items()}
    frames = {k: dict((a, int(b)) for a, b in re.findall(r"(\w+)=(\d+)", v))
              for k, v in tables.get("StackFrames", {}).items()}

    def describe(frame_id: int) -> str:
        seen = set()
        while frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            location = locations[frames[frame_id]["file_location_id"]]
            name = files.get(location["file_name_id"], "?")
            if "moe_jax/" in name:
                return f"{name.split('moe_jax/', 1)[1]}:{location['line']} {functions.get(location['function_name_id'], '?')}"
            frame_id = frames[frame_id].get("parent_frame_id", 0)
        return "(outside moe_jax)"

    sources = {}
    for line in hlo_text.splitlines():
        match = OP_METADATA.match(line)
        if not match:
            continue
        fields = dict(re.findall(r'(\w+)="?([^" ]*)"?', match.group(2)))
        frame = int(fields["stack_frame_id"]) if "stack_frame_id" in fields else None
        sources[match.group(1)] = ("(no frame)" if frame is None else describe(frame),
                                   "transpose(" in fields.get("op_name", ""))
    return sources


def op_signatures(hlo_text: str) -> dict[str, str]:
    """HLO op name -> its result and operand shapes as the compiled module prints them (what a fusion or dot
    multiplies, for the --ops-of listing)."""
    signatures = {}
    for line in hlo_text.splitlines():
        match = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\((.*?)\)", line)
        if match:
            operands = re.findall(r"\w+\[[\d,]*\]", match.group(4))
            signatures[match.group(1)] = f"{match.group(2).split('{')[0]} = {match.group(3)}({', '.join(operands)})"
    return signatures


def self_times(trace_dir: str) -> collections.Counter:
    """HLO op name -> summed self time (microseconds) over the trace's thunk events."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    events = [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    by_thread = collections.defaultdict(list)
    for event in events:
        by_thread[(event["pid"], event["tid"])].append(event)
    totals = collections.Counter()
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, children = [], collections.Counter()
        for index, event in enumerate(thread_events):
            while stack and thread_events[stack[-1]]["ts"] + thread_events[stack[-1]]["dur"] <= event["ts"]:
                stack.pop()
            if stack:
                children[stack[-1]] += event["dur"]
            stack.append(index)
        for index, event in enumerate(thread_events):
            totals[event["args"]["hlo_op"]] += event["dur"] - children[index]
    return totals


def kind_of(op: str) -> str:
    base = re.sub(r"(\.\d+)*(\.clone)?$", "", op)
    for kind, prefixes in OP_KINDS:
        if base.startswith(prefixes):
            return kind
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--forward", action="store_true", help="trace the forward (logits, as bench_vs_reference's "
                        "forward row) instead of the train step")
    parser.add_argument("--scan-layers", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--ops-of", default=None, help="also list the ops attributed to sources containing this text ('': every op)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--ep-implementation", default="auto")
    parser.add_argument("--size", choices=sorted(SIZES), default="default", help="bench_vs_reference's model sizes")
    parser.add_argument("--capacity", type=float, default=None,
                        help="with --ep: the dispatch capacity (default the ladder's largest, which never drops; "
                             "a training run settles lower, e.g. 1.5)")
    args = parser.parse_args()
    config = SIZES[args.size]
    scan = {"auto": "auto", "true": True, "false": False}[args.scan_layers]
    devices = args.tp * args.fsdp
    layout = (None if devices == 1 and args.ep == 1 else
              DistributedConfig(tp_size=args.tp, fsdp_size=args.fsdp, ep_size=args.ep,
                                ep_implementation=args.ep_implementation))
    model = Qwen3MoeForCausalLM(config, layout, devices=jax.devices()[:devices], scan_layers=scan)
    model.init_params(seed=0)
    train_step = make_train_step(model, optax.adamw(1e-4))
    batch = {"input_ids": np.random.default_rng(0).integers(0, config["vocab_size"], (args.batch, args.seq), dtype=np.int32)}
    capacity = (None if model.layout.ep_size == 1 else
                model.capacity_schedule.largest if args.capacity is None else args.capacity)
    if args.forward:   # what bench_vs_reference's forward row times: the logits of one jitted apply
        forward = jax.jit(lambda params, ids: model.apply(params, ids, capacity=capacity).logits)
        state = model.params
        hlo_text = forward.lower(state, batch["input_ids"]).compile().as_text()

        def run(params, steps):
            for _ in range(steps):
                logits = forward(params, batch["input_ids"])
            jax.block_until_ready(logits)
            return params
    else:
        state = train_step.init_state(capacity=capacity)
        hlo_text = train_step.lower(state, batch).compile().as_text()

        def run(state, steps):
            for _ in range(steps):
                state, metrics = train_step(state, batch)
            jax.block_until_ready(metrics)
            return state
    sources, signatures = op_sources(hlo_text), op_signatures(hlo_text)

    state = run(state, 2)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            state = run(state, args.steps)
        times = self_times(trace_dir)
    start = time.perf_counter()
    state = run(state, args.steps)
    step_seconds = (time.perf_counter() - start) / args.steps

    per_step = {op: us / args.steps / 1e3 for op, us in times.items()}   # ms
    traced = sum(per_step.values())
    by_source, by_kind = collections.Counter(), collections.Counter()
    for op, ms in per_step.items():
        source, backward = sources.get(op, ("(no metadata)", False))
        by_source[(source, "bwd" if backward else "fwd")] += ms
        by_kind[kind_of(op)] += ms
    tokens = args.batch * args.seq
    flops = (1 if args.forward else 3) * matmul_flops_per_token(config, args.seq) * tokens
    rate = model_dense_rate(config, tokens)  # the practical limit, measured now
    where = "one device" if layout is None else f"tp{args.tp} fsdp{args.fsdp} ep{args.ep} {args.ep_implementation}"
    what = "forward" if args.forward else "step"
    print(f"{where}, batch {args.batch} x {args.seq}, scan_layers={args.scan_layers}: {what} {step_seconds * 1e3:.0f} ms "
          f"({tokens / step_seconds:.0f} tokens/s), ops in the trace {traced:.0f} ms of thread time per step")
    print(f"matmul FLOPs ({'fwd' if args.forward else 'fwd + bwd = 3x fwd'}) {flops / 1e9:.1f} GFLOP; dense matmul "
          f"rate of this run {rate / 1e9:.0f} GFLOP/s -> hardware-limited {what} {flops / rate * 1e3:.0f} ms ({tokens / (flops / rate):.0f} tokens/s); "
          f"measured {what} = {step_seconds / (flops / rate):.2f}x that\n")
    print("by op kind (ms per step, self time):")
    for kind, ms in by_kind.most_common():
        print(f"  {ms:8.1f}  {100 * ms / traced:5.1f}%  {kind}")
    print(f"\nby source line and pass (top {args.top}):")
    for (source, direction), ms in by_source.most_common(args.top):
        print(f"  {ms:8.1f}  {100 * ms / traced:5.1f}%  {direction}  {source}")
    if args.ops_of is not None:
        print(f"\nops of sources containing {args.ops_of!r} (top {args.top}):")
        source_of = {op: sources.get(op, ("(no metadata)", False)) for op in per_step}
        ops = [(ms, op) for op, ms in per_step.items() if args.ops_of in source_of[op][0]]
        for ms, op in sorted(ops, reverse=True)[: args.top]:
            direction = "bwd" if source_of[op][1] else "fwd"
            print(f"  {ms:8.1f}  {kind_of(op):<24} {direction}  {op}  {signatures.get(op, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
