"""Where one device's time goes, moe_jax against the reference: the same model whole and with its experts removed,
forward and train step, on all cores and on one (CPU).

    pip install torch==2.13.0 transformers==5.23.0   # the reference; needed by this script only
    python scripts/bench/bench_breakdown.py [--size default|large] [--seq 128] [--rounds 6] [--steps 3] [--cores all,1]

bench_vs_reference's one-device row, taken apart in place. Each side (Transformers, moe_jax) runs in a resident
worker process pinned to the first N cores (`--cores`: `all` and/or numbers; torch gets N threads, XLA:CPU sizes
its pool from the affinity); both are alive together and their timed blocks alternate, `--rounds` times (one
untimed call, then `--steps` timed calls a block), so the machine's drift moves both sides alike. Timed: the forward
(logits) and the AdamW train step (fp32, lr 1e-4, weight decay 0.01, no clipping), each of the whole model and of
the model with its experts' computation removed: the routed experts return zeros (Transformers'
`Qwen3MoeExperts.forward`; moe_jax's `swiglu_experts`, patched while that variant is traced), while the router, its
top-k and every other layer stay, and the expert weights still get (zero) gradients and their optimizer update, so
the two variants differ by the experts' work alone (sort, gathers, matmuls, SwiGLU, combine; forward and backward).

Printed: each part's milliseconds per call on both sides (medians of the rounds), the speed ratio reference /
moe_jax (the median of the rounds' ratios; above 1: moe_jax faster, as bench_vs_reference's), and each side's
speed-up from one core to all. Removing a part is a measurement device only (the outputs are wrong); the differences place the time
where a profiler's per-op times do not: a trace inflates small ops and cannot show two threads' idle time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.bench_vs_reference import SIZES, build  # noqa: E402

LEARNING_RATE, WEIGHT_DECAY = 1e-4, 0.01
VARIANTS = ("whole", "no_experts")
MODES = ("forward", "train")


def reference_calls(workdir: Path, threads: int) -> dict:
    import torch
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", dtype=torch.float32)
    ids = torch.as_tensor(np.load(workdir / "ids.npy"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    experts_forward = modeling_qwen3_moe.Qwen3MoeExperts.forward

    def no_experts(self, hidden, top_k_index, top_k_weights):
        # zeros that still reach the expert weights and routing weights: their (zero) gradients and updates stay
        return torch.zeros_like(hidden) + 0 * (self.gate_up_proj.sum() + self.down_proj.sum() + top_k_weights.sum())

    def forward():
        with torch.no_grad():
            model(ids)

    def train():
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def variant(fn, experts):
        def run():
            modeling_qwen3_moe.Qwen3MoeExperts.forward = experts
            try:
                fn()
            finally:
                modeling_qwen3_moe.Qwen3MoeExperts.forward = experts_forward
        return run

    return {(variant_name, mode): variant(fn, experts)
            for variant_name, experts in (("whole", experts_forward), ("no_experts", no_experts))
            for mode, fn in (("forward", forward), ("train", train))}


def ours_calls(workdir: Path) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import moe_jax.models.family as family
    from moe_jax import AutoModelForCausalLM
    from moe_jax.training import make_train_step

    ids = np.load(workdir / "ids.npy").astype(np.int32)

    def no_experts(hidden, expert_ids, weights, gate_up_proj=None, down_proj=None, act=None, backend=None):
        return jnp.zeros_like(hidden) + 0 * weights.sum().astype(hidden.dtype)

    variants = {"whole": {}, "no_experts": {(family, "swiglu_experts"): no_experts}}
    calls = {}
    for variant_name, patches in variants.items():
        saved = {key: getattr(*key) for key in patches}
        for (module, name), value in patches.items():   # read while the model is built and its programs traced
            setattr(module, name, value)
        try:
            model = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", None, progress=False,
                                                         devices=jax.devices()[:1])
            batch = jax.device_put(ids)
            forward = jax.jit(lambda params, ids, model=model: model.apply(params, ids).logits)
            forward = forward.lower(model.params, batch).compile()
            step = make_train_step(model, optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY), grad_clip=None)
            state = step.init_state(capacity=None)
            train_batch = {"input_ids": ids}
            compiled_step = step.lower(state, train_batch).compile()
        finally:
            for (module, name), value in saved.items():
                setattr(module, name, value)
        holder = {"state": state}

        def run_forward(forward=forward, params=model.params, batch=batch):
            forward(params, batch).block_until_ready()

        def run_train(compiled_step=compiled_step, holder=holder, train_batch=train_batch):
            holder["state"], metrics = compiled_step(holder["state"], train_batch)
            jax.block_until_ready(holder["state"])

        calls[(variant_name, "forward")] = run_forward
        calls[(variant_name, "train")] = run_train
    return calls


def worker(args) -> int:
    """One side on the first --worker-cores cores, serving the parent: after "READY" on its protocol stream, each
    line KEY read from stdin runs that variant/mode once untimed, then times --steps calls and answers with ms per
    call. (Without the untimed call, the large size's train step, alternated with three other programs, ran 5.9 s
    where bench_vs_reference's steady steps take 4.2 s.)"""
    protocol = os.fdopen(os.dup(1), "w")   # libraries' prints go to stderr, not into the protocol
    os.dup2(2, 1)
    cores = sorted(os.sched_getaffinity(0))[:args.worker_cores]
    os.sched_setaffinity(0, cores)   # before XLA or torch size their thread pools
    workdir = Path(args.workdir)
    calls = (reference_calls(workdir, len(cores)) if args.worker == "reference"
             else ours_calls(workdir))
    calls = {f"{variant}/{mode}": fn for (variant, mode), fn in calls.items()}
    for fn in calls.values():   # warm-up: compiled, caches and allocator settled
        fn()
        fn()
    print("READY", flush=True, file=protocol)
    for line in sys.stdin:
        key = line.strip()
        if key == "quit":
            break
        calls[key]()   # untimed: the first call after another program's re-faults its buffers
        start = time.perf_counter()
        for _ in range(args.steps):
            calls[key]()
        print(f"{(time.perf_counter() - start) / args.steps * 1e3:.3f}", flush=True, file=protocol)
    return 0


class Worker:
    """A side's worker process (`worker`), alive until `stop`."""

    def __init__(self, side: str, workdir: Path, cores: int, args, log):
        command = [sys.executable, __file__, "--worker", side, "--worker-cores", str(cores), "--workdir",
                   str(workdir), "--steps", str(args.steps)]
        env = dict(os.environ)
        if args.huge_pages == "on":
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        self.name = f"{side} on {cores} core(s)"
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=log, text=True)

    def _answer(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"{self.name} ended (exit code {self.process.wait()}); its log is printed above")
        return line.strip()

    def ready(self) -> None:
        while self._answer() != "READY":
            pass

    def time(self, key: str) -> float:
        self.process.stdin.write(key + "\n")
        self.process.stdin.flush()
        return float(self._answer())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
        self.process.wait()


def measure(workdir: Path, cores: int, args, keys: list[str]) -> dict:
    """Both sides' workers on `cores` cores, their timed blocks alternated --rounds times -> (side, key) -> [ms per
    call, one per round]."""
    times = {}
    with tempfile.TemporaryFile("w+") as log:
        workers = {side: Worker(side, workdir, cores, args, log) for side in ("reference", "ours")}
        try:
            for worker_process in workers.values():
                worker_process.ready()
            for _ in range(args.rounds):
                for key in keys:
                    for side, worker_process in workers.items():
                        if side == "reference" and key.split("/")[0] not in VARIANTS:
                            continue
                        time.sleep(0.2)   # the other side's threads stop spinning
                        times.setdefault((side, key), []).append(worker_process.time(key))
        except SystemExit:
            log.seek(0)
            print(log.read()[-6000:], file=sys.stderr)
            raise
        finally:
            for worker_process in workers.values():
                worker_process.stop()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cores", default="all,1", help="comma-separated: 'all' and/or core counts")
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on")
    parser.add_argument("--worker", choices=("reference", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-cores", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        sys.exit(f"bench_breakdown needs the reference ({error.name} is missing): "
                 "pip install torch==2.13.0 transformers==5.23.0")
    available = len(os.sched_getaffinity(0))
    core_counts = []
    for item in args.cores.split(","):
        count = available if item == "all" else int(item) if item.isdigit() else 0
        if not 1 <= count <= available:
            sys.exit(f"--cores {item}: this process may use {available} cores; pass 'all' or 1..{available}")
        core_counts.append(count)
    keys = [f"{variant}/{mode}" for variant in VARIANTS for mode in MODES]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        build(workdir, args.batch, args.seq, SIZES[args.size])
        for cores in core_counts:
            start = time.perf_counter()
            results[cores] = measure(workdir, cores, args, keys)
            print(f"  {cores} core(s): {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    print(f"one device, size {args.size}, batch {args.batch} x {args.seq}, fp32; ms per call, medians of {args.rounds} "
          f"interleaved rounds of {args.steps} calls; 'speed' = reference ms / moe_jax ms (above 1: moe_jax faster), "
          "the median of the rounds' ratios")
    header = f"{'part':<34}"
    for cores in core_counts:
        header += f"{f'ref {cores}c':>9}{f'ours {cores}c':>9}{'speed':>7}"
    if len(core_counts) > 1:
        header += f"   scaling {core_counts[-1]}c -> {core_counts[0]}c: ref / ours"
    print(header)

    def rounds(cores: int, side: str, key: str) -> np.ndarray:
        return np.asarray(results[cores][(side, key)])

    labels = {"forward": "forward", "train": "train step"}
    for mode in MODES:
        rows = {
            labels[mode]: lambda get, mode=mode: get(f"whole/{mode}"),
            f"{labels[mode]} without experts": lambda get, mode=mode: get(f"no_experts/{mode}"),
            f"{labels[mode]}: experts (difference)":
                lambda get, mode=mode: get(f"whole/{mode}") - get(f"no_experts/{mode}"),
        }
        for label, value in rows.items():
            line, medians = f"{label:<34}", {}
            for cores in core_counts:
                ref = value(lambda key, cores=cores: rounds(cores, "reference", key))
                ours = value(lambda key, cores=cores: rounds(cores, "ours", key))
                medians[cores] = float(np.median(ref)), float(np.median(ours))
                line += f"{medians[cores][0]:9.1f}{medians[cores][1]:9.1f}{float(np.median(ref / ours)):6.2f}x"
            if len(core_counts) > 1:
                first, last = core_counts[0], core_counts[-1]
                line += (f"   {medians[last][0] / medians[first][0]:.2f}x / "
                         f"{medians[last][1] / medians[first][1]:.2f}x")
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
