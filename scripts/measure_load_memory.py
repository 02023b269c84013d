"""Peak host memory while loading a sharded checkpoint, and bytes read per device.

    python scripts/measure_load_memory.py [--layers 16] [--experts 32] [--hidden 512] [--moe-intermediate 256]

1. Writes a Qwen3-MoE HF checkpoint of a few hundred MB (random weights, fp32, 1 GB shards) to a temp dir.
2. In a fresh process: loads it onto 8 virtual CPU devices with DistributedConfig(fsdp_size=8, ep_size=8),
   recording
   - tracemalloc's peak of host (numpy) buffers alive at once during the load: the transient memory the
     loader needs on top of the devices' own memory (on a CPU "device", the loaded shards themselves live
     in host RAM too; those are XLA buffers, not counted by tracemalloc);
   - bytes read from the checkpoint per device, for expert tensors and in total.
Prints the figures; docs/benchmarks.md records them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    model.save_pretrained(directory, max_shard_bytes=2**30, progress=False)
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def measure(directory: Path) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, str(ROOT))
    import tracemalloc

    import jax

    from converters import record_reads
    from moe_jax import AutoModelForCausalLM, DistributedConfig

    jax.devices()
    tracemalloc.start()
    with record_reads() as reads:
        model = AutoModelForCausalLM.from_pretrained(directory, DistributedConfig(fsdp_size=8, ep_size=8),
                                                     progress=False)
        jax.block_until_ready(model.params)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    expert_bytes = sum(r.nbytes for r in reads if ".mlp.experts." in r.key)
    total_read = sum(r.nbytes for r in reads)
    experts_per_device = {}
    for r in reads:
        if ".mlp.experts." in r.key:
            expert = int(r.key.split(".mlp.experts.")[1].split(".")[0])
            device = expert // (model.config.num_experts // 8)
            experts_per_device[device] = experts_per_device.get(device, 0) + r.nbytes
    param_bytes = sum(x.nbytes for x in model.params.values())
    return {"peak_host_buffers": peak, "bytes_read": total_read, "expert_bytes_read": expert_bytes,
            "expert_bytes_per_device": experts_per_device, "param_bytes": param_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
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
    mb = 2**20
    print(f"checkpoint: {size / mb:.1f} MiB in safetensors ({args.layers} layers, {args.experts} experts)")
    print(f"loaded parameters (all devices): {figures['param_bytes'] / mb:.1f} MiB")
    print(f"peak host buffers alive during the load (tracemalloc): {figures['peak_host_buffers'] / mb:.1f} MiB "
          f"= {figures['peak_host_buffers'] / size:.3f} x checkpoint")
    print(f"bytes read: {figures['bytes_read'] / mb:.1f} MiB = {figures['bytes_read'] / figures['param_bytes']:.3f} x "
          "the parameters' bytes (replicated parameters are read once per distinct block)")
    per_device = figures["expert_bytes_per_device"]
    print("expert bytes read per owning device (MiB): " + ", ".join(
        f"{int(d)}: {b / mb:.1f}" for d, b in sorted(per_device.items(), key=lambda item: int(item[0]))))
    print(f"  = {min(per_device.values()) / figures['expert_bytes_read']:.4f} .. "
          f"{max(per_device.values()) / figures['expert_bytes_read']:.4f} of all expert bytes (ideal 1/8 = 0.125)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
