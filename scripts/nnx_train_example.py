"""Fine-tune a tiny Qwen3-MoE checkpoint with an ordinary Flax NNX training loop, on fsdp4/ep4.

    python scripts/nnx_train_example.py                       # builds the tiny checkpoint, 5 steps on 8 devices
    python scripts/nnx_train_example.py --model CKPT/ --steps 20 --fsdp 8 --ep 8 --output-dir out/

Everything below the model line is a plain NNX loop (nnx.Optimizer, nnx.value_and_grad, nnx.jit, orbax on
nnx.state); moe_jax supplies the module and two helpers: `commit_to_mesh` (the optimizer's scalars on
the mesh, so the step compiles once) and `update_unless_dropped` + `update_capacity` (dispatch buffers
sized for balanced routing, a step that overflowed them undone and replayed at the capacity it needed).
On a CPU-only machine the devices are virtual CPU devices.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_jax.cli.demo import DEMO_CONFIG  # noqa: E402  (imports no JAX)
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402

import moe_jax  # noqa: E402
import moe_jax.nnx  # noqa: E402
from moe_jax import DistributedConfig  # noqa: E402


def tiny_checkpoint(directory: Path) -> Path:
    """The demo's tiny random Qwen3-MoE (4 layers, 8 experts top-2), saved as an HF checkpoint."""
    model = moe_jax.AutoModelForCausalLM.from_config(DEMO_CONFIG, devices=jax.devices()[:1])
    model.init_params(seed=0)
    return model.save_pretrained(directory / "tiny-qwen3-moe", progress=False)


def train_step(model, optimizer, batch):
    (loss, metrics), grads = nnx.value_and_grad(lambda m: m.loss(**batch), has_aux=True)(model)
    metrics["applied"] = moe_jax.nnx.update_unless_dropped(optimizer, model, grads)
    return metrics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF checkpoint directory (default: build the tiny Qwen3-MoE)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fsdp", type=int, default=4)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--output-dir", help="write the NNX state (orbax) and an HF checkpoint here")
    args = parser.parse_args(argv)
    if args.output_dir and Path(args.output_dir).exists() and any(Path(args.output_dir).iterdir()):
        parser.error(f"--output-dir {args.output_dir} is not empty; pass a new directory.")

    checkpoint = Path(args.model) if args.model else tiny_checkpoint(Path(tempfile.mkdtemp(prefix="moe_jax_nnx_")))
    layout = DistributedConfig(fsdp_size=args.fsdp, ep_size=args.ep)
    devices = jax.devices()[:args.fsdp]           # the layout's world: fsdp_size devices (ep splits the fsdp ones)
    model = moe_jax.nnx.AutoModelForCausalLM.from_pretrained(checkpoint, layout, devices=devices, progress=False)
    if model.capacity is not None:
        model.set_capacity(model.engine.capacity_schedule.ladder[0])   # buffers for balanced routing
    model.train()
    optimizer = moe_jax.nnx.commit_to_mesh(nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param), model)
    step = nnx.jit(train_step)
    print(f"{checkpoint} on {len(devices)} {devices[0].platform} devices "
          f"(fsdp {args.fsdp}, ep {args.ep}); {sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))} "
          "parameters")

    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    for index in range(args.steps):
        batch = {"input_ids": rng.integers(0, min(vocab, 64), (args.batch_size, args.seq_len), dtype=np.int32)}
        start = time.perf_counter()
        metrics = step(model, optimizer, batch)
        replays = 0
        while model.update_capacity():          # one host read: the step dropped pairs, so run it again
            metrics = step(model, optimizer, batch)
            replays += 1
        seconds = time.perf_counter() - start
        print(f"step {index + 1}: loss {float(metrics['loss']):.4f}  capacity {model.capacity}  replays {replays}  "
              f"{args.batch_size * args.seq_len / seconds:,.0f} tokens/s")

    if args.output_dir:
        out = Path(args.output_dir).absolute()
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(out / "nnx_state", nnx.state(model))
        checkpointer.save(out / "optimizer_state", nnx.state(optimizer))
        checkpointer.wait_until_finished()
        model.save_pretrained(out / "hf", progress=False)
        print(f"wrote {out / 'nnx_state'}, {out / 'optimizer_state'} and the HF checkpoint {out / 'hf'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
