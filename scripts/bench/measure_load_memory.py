"""Peak host memory while loading a sharded checkpoint, and the bytes each device's read requests pulled.

    python scripts/bench/measure_load_memory.py [--layers 16] [--experts 32] [--hidden 512] [--moe-intermediate 256]
                                          [--shard-mb 256]

1. Writes a Qwen3-MoE HF checkpoint of a few hundred MB (random weights, fp32, `--shard-mb` shards) to a
   temp dir.
2. In a fresh process: loads it onto 8 virtual CPU devices with DistributedConfig(fsdp_size=8, ep_size=8),
   recording
   - tracemalloc's peak of host (numpy) buffers alive at once during the load: the transient memory the
     loader needs on top of the devices' own memory (on a CPU "device", the loaded shards themselves live
     in host RAM too; those are XLA buffers, not counted by tracemalloc), and the same with every stacked
     block read whole (`converters.load.LAYERWISE_READ_BYTES` set to infinity), with both load times;
   - every read the loader makes, attributed to the device(s) the loader read the block for
     (`reads_by_device`), per file: bytes read from the checkpoint, and bytes of the blocks delivered.
Prints the figures; docs/benchmarks.md records them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPERTS = ".mlp.experts."
REPLICATED = "replicated"  # a block several devices receive (read once for all of them)


def write_checkpoint(directory: Path, args) -> int:
    sys.path.insert(0, str(ROOT))
    import jax

    from moe_jax import AutoModelForCausalLM

    config = dict(
        model_type="qwen3_moe", vocab_size=8192, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=args.hidden // 8, num_experts=args.experts, num_experts_per_tok=2,
        mlp_only_layers=[], max_position_embeddings=512,
    )
    model = AutoModelForCausalLM.from_config(config, devices=jax.devices()[:1])
    model.init_params(0)
    model.save_pretrained(directory, max_shard_bytes=args.shard_mb * 2**20, progress=False)
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


@contextlib.contextmanager
def reads_by_device():
    """Attribute every checkpoint read made inside the block to the devices that requested it.

    Yields `{"read": {(device, file, kind): bytes}, "delivered": {(device, kind): bytes}}`: kind is "experts"
    or "other", device a device id or REPLICATED.

    The loader reads each distinct block of a parameter once and tags its reads with
    `(parameter name, block bounds, ids of the devices that receive the block)`: a block for one device is
    counted as that device's read; a block several devices share (replicated dims) as REPLICATED. Each
    receiving device is "delivered" the block's bytes.
    """
    from converters import record_reads

    read: dict = defaultdict(int)
    delivered: dict = defaultdict(int)
    counts = {"read": read, "delivered": delivered}
    with record_reads() as reads:
        yield counts
    for record in reads:
        _, _, devices = record.request
        kind = "experts" if EXPERTS in record.key else "other"
        reader = devices[0] if len(devices) == 1 else REPLICATED
        read[reader, record.path.name, kind] += record.nbytes
        for device in devices:
            delivered[device, kind] += record.nbytes


def measure(directory: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from moe_jax.host_devices import use_cpu_devices

    use_cpu_devices(8, override=True)
    import tracemalloc

    import jax

    import converters.load
    from moe_jax import AutoModelForCausalLM, DistributedConfig

    def load():
        model = AutoModelForCausalLM.from_pretrained(directory, DistributedConfig(fsdp_size=8, ep_size=8),
                                                     progress=False)
        jax.block_until_ready(model.params)
        return model

    jax.devices()
    tracemalloc.start()
    with reads_by_device() as counts:
        model = load()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # The same load with every stacked block read whole (the loader before layer-by-layer reading), for its
    # peak and, alternating with the default, its wall time.
    layerwise_bytes = converters.load.LAYERWISE_READ_BYTES
    converters.load.LAYERWISE_READ_BYTES = float("inf")
    tracemalloc.start()
    load()
    _, peak_whole = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    seconds = {"layerwise": [], "whole": []}
    for _ in range(3):
        for mode, threshold in (("layerwise", layerwise_bytes), ("whole", float("inf"))):
            converters.load.LAYERWISE_READ_BYTES = threshold
            start = time.perf_counter()
            load()
            seconds[mode].append(time.perf_counter() - start)
    converters.load.LAYERWISE_READ_BYTES = layerwise_bytes
    return {
        "peak_host_buffers": peak,
        "peak_host_buffers_whole_blocks": peak_whole,
        "load_seconds": {mode: statistics.median(times) for mode, times in seconds.items()},
        "param_bytes": sum(x.nbytes for x in model.params.values()),
        "read": [[str(device), file, kind, nbytes] for (device, file, kind), nbytes in sorted(
            counts["read"].items(), key=lambda item: str(item[0]))],
        "delivered": [[str(device), kind, nbytes] for (device, kind), nbytes in sorted(
            counts["delivered"].items(), key=lambda item: str(item[0]))],
    }


def report(figures: dict, size: int, args) -> None:
    mb = 2**20
    read, devices = defaultdict(int), sorted({row[0] for row in figures["read"]}, key=lambda d: (len(d), d))
    files = sorted({row[1] for row in figures["read"]})
    for device, file, kind, nbytes in figures["read"]:
        read[device, file, kind] += nbytes
    total = sum(row[3] for row in figures["read"])
    experts_total = sum(row[3] for row in figures["read"] if row[2] == "experts")
    print(f"checkpoint: {size / mb:.1f} MiB in {len(files)} safetensors files ({args.layers} layers, "
          f"{args.experts} experts, {args.shard_mb} MiB shards)")
    print(f"loaded parameters (all devices): {figures['param_bytes'] / mb:.1f} MiB")
    print(f"peak host buffers alive during the load (tracemalloc): {figures['peak_host_buffers'] / mb:.1f} MiB "
          f"= {figures['peak_host_buffers'] / size:.3f} x checkpoint; reading every stacked block whole: "
          f"{figures['peak_host_buffers_whole_blocks'] / mb:.1f} MiB = "
          f"{figures['peak_host_buffers_whole_blocks'] / size:.3f} x")
    seconds = figures["load_seconds"]
    print(f"load time (median of 3, alternating): {seconds['layerwise']:.2f} s layer by layer, {seconds['whole']:.2f} s "
          f"whole blocks = {seconds['layerwise'] / seconds['whole']:.2f} x")
    print(f"bytes read: {total / mb:.1f} MiB = {total / figures['param_bytes']:.3f} x the parameters' bytes")
    print("\nbytes read on each device's requests (MiB), expert tensors / other tensors, per file "
          f"(file k = model-0000k-of-{len(files):05d}.safetensors):")
    print("| device | " + " | ".join(f"file {k}" for k in range(1, len(files) + 1))
          + " | experts total | share of all expert bytes | other total |")
    print("|---" * (len(files) + 4) + "|")
    for device in devices:
        cells = [f"{read[device, file, 'experts'] / mb:.1f} / {read[device, file, 'other'] / mb:.1f}" for file in files]
        experts = sum(read[device, file, "experts"] for file in files)
        other = sum(read[device, file, "other"] for file in files)
        print(f"| {device} | " + " | ".join(cells) + f" | {experts / mb:.2f} | {experts / experts_total:.4f} | "
              f"{other / mb:.2f} |")
    delivered = defaultdict(int)
    for device, kind, nbytes in figures["delivered"]:
        delivered[device, kind] += nbytes
    print("\nbytes delivered to each device (MiB), expert / other blocks: " + ", ".join(
        f"{device}: {delivered[device, 'experts'] / mb:.2f} / {delivered[device, 'other'] / mb:.2f}"
        for device in devices))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--shard-mb", type=int, default=256, help="largest safetensors file (MiB)")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return 0
    with tempfile.TemporaryDirectory(prefix="moe_jax_load_") as tmp:
        directory = Path(tmp) / "checkpoint"
        size = write_checkpoint(directory, args)
        result = subprocess.run([sys.executable, __file__, "--measure", str(directory)], capture_output=True,
                                text=True, check=True)
        figures = json.loads(result.stdout.strip().splitlines()[-1])
    report(figures, size, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
