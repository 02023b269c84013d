"""Pipeline stages on 8 virtual CPU devices: step time against microbatches, compile time, memory, collectives.

    python scripts/bench/bench_pipeline.py [--layers 8] [--batch 32] [--seq 64] [--steps 3]

A Qwen3-MoE (hidden 128, 16 experts top-4, vocab 2048, `--layers` layers, random weights), AdamW train steps at
the largest dispatch capacity on the same global batch, for each row:

- layout pp=1 (fsdp8 / ep8) and pp = 2 and 4 with fsdp (and ep) making up the 8 devices, M microbatches, gpipe
  and circular (2 repeats);
- ms per step (median of `--steps` after a compiling call), and that time relative to the pp=1 row next to
  what the bubble predicts, (R*M + P - 1) / (R*M): every stage computes every iteration (bubbles on zeros), so
  the work of a step grows with the iterations, T = R*M + P - 1, against the R*M that carry a microbatch;
- compile seconds (the iteration loop is one scan: flat in M);
- the train state bytes one device holds, and the compiled step's temporary bytes (activations) per device;
- the collectives of the compiled step, each tagged by whether its device groups cross stages;
then, with fsdp 2 and pp = 1, 2, 4: the train state one device holds, and the checkpoint bytes the busiest device
reads when the model is loaded (each stage's devices read only their layers).

Every row is a fresh model in this process; the machine's 2 cores run all 8 virtual devices, so the figures
are ratios of total work, not of a real pipeline's wall time (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import moe_jax  # noqa: E402
from converters import record_reads  # noqa: E402
from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.reporting.collectives_report import compile_with_collectives  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from moe_jax.training.memory import human_bytes, train_state_memory  # noqa: E402
from moe_jax.training.state import abstract_train_state  # noqa: E402

CONFIG = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
              norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False)


def rows(layers: int) -> list[tuple[str, dict, dict]]:
    """(label, DistributedConfig kwargs, model options) of every measured row."""
    cases = [("pp1 fsdp8 ep8", dict(fsdp_size=8, ep_size=8), {})]
    for stages, fsdp in ((2, 4), (4, 2)):
        for microbatches in (stages, 2 * stages, 4 * stages):
            cases.append((f"pp{stages} fsdp{fsdp} ep{fsdp} gpipe M={microbatches}",
                          dict(pp_size=stages, fsdp_size=fsdp, ep_size=fsdp), dict(pipeline_microbatches=microbatches)))
        if layers % (2 * stages) == 0:
            cases.append((f"pp{stages} fsdp{fsdp} ep{fsdp} circular R=2 M={2 * stages}",
                          dict(pp_size=stages, fsdp_size=fsdp, ep_size=fsdp),
                          dict(pipeline_microbatches=2 * stages, pipeline_schedule="circular", pipeline_repeats=2)))
    return cases


def crossing_collectives(hlo: str, stage_size: int) -> tuple[dict[str, list[int]], list[str]]:
    """(op -> [within one stage, across stages] counts, "op shape" of each crossing one but the permutes), from
    the device groups in the compiled HLO text."""
    counts: dict[str, list[int]] = {}
    crossing: list[str] = []
    for line in hlo.splitlines():
        match = re.search(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line)
        if not match:
            continue
        groups = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
        if groups is None:
            continue
        sets = [[int(d) for d in group.split(",") if d] for group in re.findall(r"\{([\d,]*)\}", groups.group(1))]
        crosses = any(len({device // stage_size for device in group}) > 1 for group in sets)
        counts.setdefault(match.group(1), [0, 0])[int(crosses)] += 1
        if crosses and match.group(1) != "collective-permute":
            shape = re.search(r"=\s+(\S+?)(?:\{[^}]*\})?\s+" + match.group(1), line)
            crossing.append(f"{match.group(1)} {shape.group(1) if shape else '?'}")
    return counts, crossing


def measure(label: str, layout: dict, options: dict, args) -> dict:
    config = dict(CONFIG, num_hidden_layers=args.layers)
    distributed = DistributedConfig(**layout)
    model = Qwen3MoeForCausalLM(config, distributed, devices=jax.devices()[:distributed.num_devices], **options)
    model.init_params(seed=0)
    train_step = make_train_step(model, optax.adamw(1e-4))
    capacity = model.capacity_schedule.largest if model.layout.ep_size > 1 else None
    state = train_step.init_state(capacity=capacity)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (args.batch, args.seq)).astype(np.int32)
    batch = {"input_ids": ids}
    began = time.perf_counter()
    lowered = train_step.lower(state, {"input_ids": jax.device_put(ids, model.batch_sharding())})
    compiled, _ = compile_with_collectives(lowered)
    compile_s = time.perf_counter() - began
    stage_size = distributed.num_devices // distributed.pp_size
    crossing, crossing_shapes = (crossing_collectives(compiled.as_text(), stage_size) if distributed.pp_size > 1
                                 else ({}, []))
    temp = compiled.memory_analysis().temp_size_in_bytes
    state_bytes = train_state_memory(abstract_train_state(model, train_step.optimizer, capacity)).per_device["total"]
    state, _ = train_step(state, batch)  # compiles the cached program __call__ uses, then warm
    jax.block_until_ready(state.params)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    layout_p = model.layer_stack.pipeline
    predicted = 1.0
    if layout_p is not None:
        work = model.pipeline_microbatches * layout_p.repeats
        predicted = (work + layout_p.stages - 1) / work
    return dict(label=label, ms=1e3 * float(np.median(times)), compile_s=compile_s, state=state_bytes, temp=temp,
                predicted=predicted, crossing=crossing, crossing_shapes=crossing_shapes, loss=float(metrics["loss"]))


def state_bytes_at_fixed_fsdp(layers: int) -> list[tuple[int, int]]:
    """(pp, train-state bytes on the busiest device) with fsdp 2 and pp = 1, 2, 4 (no compilation)."""
    config = dict(CONFIG, num_hidden_layers=layers)
    out = []
    for stages in (1, 2, 4):
        distributed = DistributedConfig(pp_size=stages, fsdp_size=2)
        model = Qwen3MoeForCausalLM(config, distributed, devices=jax.devices()[:distributed.num_devices])
        state = abstract_train_state(model, optax.adamw(1e-4))
        out.append((stages, train_state_memory(state).per_device["total"]))
    return out


def loading_bytes(layers: int, directory: Path) -> list[tuple[int, int, int]]:
    """(pp, bytes of the busiest device's reads, bytes of the whole checkpoint) loading a saved checkpoint onto
    pp x fsdp2: each stage's devices read only their layers."""
    config = dict(CONFIG, num_hidden_layers=layers)
    source = Qwen3MoeForCausalLM(config, devices=jax.devices()[:1])
    source.init_params(seed=0)
    source.save_pretrained(directory, progress=False)
    total = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    out = []
    for stages in (1, 2, 4):
        per_device: dict[int, int] = {}
        with record_reads() as reads:
            moe_jax.AutoModelForCausalLM.from_pretrained(
                directory, DistributedConfig(pp_size=stages, fsdp_size=2), progress=False,
                devices=jax.devices()[:2 * stages])
        for read in reads:
            for device in read.request[2]:
                per_device[device] = per_device.get(device, 0) + read.nbytes
        out.append((stages, max(per_device.values()), total))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = []
    for label, layout, options in rows(args.layers):
        results.append(measure(label, layout, options, args))
        print(f"done: {label} ({results[-1]['ms']:.0f} ms)", file=sys.stderr, flush=True)
    base = results[0]["ms"]
    print(f"Qwen3-MoE hidden {CONFIG['hidden_size']}, {args.layers} layers, {CONFIG['num_experts']} experts top-"
          f"{CONFIG['num_experts_per_tok']}, batch {args.batch} x {args.seq}, AdamW, 8 virtual CPU devices, jax "
          f"{jax.__version__}")
    header = (f"{'layout':<36}{'ms/step':>9}{'vs pp1':>8}{'bubble':>8}{'compile s':>11}{'state/dev':>11}"
              f"{'temp/dev':>10}  collectives within / across stages")
    print(header)
    for row in results:
        crossing = ", ".join(f"{op} {within}/{across}" for op, (within, across) in sorted(row["crossing"].items()))
        print(f"{row['label']:<36}{row['ms']:>9.0f}{row['ms'] / base:>7.2f}x{row['predicted']:>7.2f}x"
              f"{row['compile_s']:>11.1f}{human_bytes(row['state']):>11}{human_bytes(row['temp']):>10}  {crossing}")
    shapes = sorted({shape for row in results for shape in row["crossing_shapes"]})
    print(f"collectives other than permutes that cross stages, by shape: {', '.join(shapes) or 'none'}")
    print("train state on the busiest device with fsdp 2: " + ", ".join(
        f"pp{stages} {human_bytes(size)}" for stages, size in state_bytes_at_fixed_fsdp(args.layers)))
    with tempfile.TemporaryDirectory() as directory:
        print("checkpoint bytes read for the busiest device, pp x fsdp2: " + ", ".join(
            f"pp{stages} {human_bytes(size)} of {human_bytes(total)}"
            for stages, size, total in loading_bytes(args.layers, Path(directory))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
