"""moe_jax against Transformers' own distributed MoE support, side by side in one run (CPU).

    pip install torch==2.13.0 transformers==5.23.0 accelerate   # the reference (its distributed loading needs
                                                              # accelerate); needed by this script only
    python scripts/bench/bench_vs_reference.py [--batch 8] [--seq 128] [--steps 4] [--layouts tp4_ep4,fsdp4_ep4]
                                         [--size default|large|copy] [--huge-pages on|off] [--warm-up N] [--repeats 1]
                                         [--interleave ROUNDS] [--baseline-tree DIR]

Builds one Qwen3-MoE checkpoint (hidden 256, 4 layers, 16 experts top-4, vocab 4096), then measures for
each layout the forward tokens/s and the train-step tokens/s (AdamW, fp32, same global batch) of
- the reference: Transformers on one process, and under `torchrun --nproc-per-node 4` (gloo) with
  `DistributedConfig(...)` for tp4/ep4, fsdp4/ep4, tp2/fsdp2/ep4, each ep_implementation that applies;
  with data parallelism each rank feeds its rows of the global batch, as the reference's docs say;
- moe_jax on 1 and on 4 virtual CPU devices with the same layouts, at the dispatch capacity its `forward` and
  `TrainLoop` settle at for the batch (what a call at the largest capacity required), the train steps run by
  `TrainLoop` as users run them (overflowed steps replayed at a larger capacity, replays included in the time;
  every rung's program compiled before the clock starts, `TrainStep.precompile`: a run compiles each once),
and prints one table: tokens/s of both and the ratio moe_jax / reference per row, with the largest
|logits - one-process reference| of both on the same batch. Every run is a fresh process; runs are
sequential (the machine is shared: read the ratios, not the absolute figures). `--repeats N` runs each row's two
sides N times, alternating, and reports each side's median (per-repeat figures on stderr). `--interleave N` keeps
both sides' processes alive instead and alternates their timed blocks of `--steps` calls N times, seconds apart,
so the machine's drift moves both sides alike; the ratios are the medians of the rounds' ratios (per-round
figures on stderr).

`--size large`: hidden 512, 8 layers, 32 experts top-4 (run it with `--seq 256`); `--size copy`: the default
with a vocabulary of 512 and 2 layers (bench_serve's copying checkpoint). `--huge-pages on` (default)
runs both sides with glibc's `glibc.malloc.hugetlb=1` tunable where it applies, as the `moe-jax` command
does (moe_jax/host_memory.py); `off` runs both without it. The header says which.

`--baseline-tree DIR` (with `--interleave`): an A/B of two moe_jax checkouts instead, e.g. before and after a
refactor (`git worktree add /tmp/base COMMIT`): the "ref" columns are this script's moe_jax side run from DIR (its
own script and package), alternated with this tree's; the ratio is this tree / DIR, and no logits are compared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16,
              num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False)
SIZES = {
    "default": CONFIG,
    "large": {**CONFIG, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 512,
              "num_hidden_layers": 8, "head_dim": 64, "num_experts": 32},
    # what a 2-core CPU trains to copy in a minute (bench_serve --copy-steps: copy_model.py)
    "copy": {**CONFIG, "vocab_size": 512, "num_hidden_layers": 2},
}
# name -> DistributedConfig kwargs (None: one process / one device)
LAYOUTS = {
    "single": None,
    "tp4_ep4": dict(tp_size=4, ep_size=4),
    "fsdp4_ep4": dict(fsdp_size=4, ep_size=4),
    "tp2_fsdp2_ep4": dict(tp_size=2, fsdp_size=2, ep_size=4),
}
LEARNING_RATE = 1e-4


def implementations(layout: dict | None) -> list[str]:
    """The ep_implementations that apply to `layout` (all_reduce needs ep_size == tp_size)."""
    if layout is None:
        return ["-"]
    names = ["all_to_all"]
    if layout.get("ep_size") == layout.get("tp_size", 1):
        names.append("all_reduce")
    return names


def build(workdir: Path, batch: int, seq: int, config: dict) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**config), dtype=torch.float32)
    with torch.no_grad():  # a sharper router: top-k choices far from ties, so both sides route alike
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.mul_(20.0)
    model.save_pretrained(workdir / "checkpoint")
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (batch, seq)).astype(np.int64)
    np.save(workdir / "ids.npy", ids)


def timed(fn, steps: int) -> float:
    """Seconds per call, after one untimed call (compilation / warm-up)."""
    fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


class Blocks(NamedTuple):
    """One side's timed work, set up and warmed up: forward(n) / train(n) -> seconds for n calls."""

    forward: Callable[[int], float]
    train: Callable[[int], float]


# ---- the reference (one process, or one rank of a torchrun job) --------------------------------------
def reference_setup(workdir: Path, layout_name: str, implementation: str) -> tuple[Blocks, int]:
    """-> (the reference's blocks, this rank); rank 0 has saved its logits."""
    import torch
    import torch.distributed as dist
    import transformers

    layout = LAYOUTS[layout_name]
    kwargs = {"dtype": torch.float32}
    rank, world = 0, 1
    if layout is not None:
        from transformers.distributed.configuration_utils import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**layout, ep_implementation=implementation)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", **kwargs)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.as_tensor(np.load(workdir / "ids.npy"))
    tp = 1 if layout is None else layout.get("tp_size", 1)
    data_parallel = world // tp
    rows = ids.shape[0] // data_parallel
    local = ids[(rank // tp) * rows:(rank // tp + 1) * rows]

    model.eval()
    with torch.no_grad():
        logits = model(local).logits
    if data_parallel > 1:  # gather every data-parallel rank's logits on rank 0
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits.contiguous())
        logits = torch.cat(gathered[::tp])
    if rank == 0:
        np.save(workdir / f"logits_reference_{layout_name}_{implementation}.npy", logits.float().numpy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)

    def train_step():
        loss = model(local, labels=local).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def forward(n: int) -> float:
        model.eval()
        with torch.no_grad():
            return timed(lambda: model(local), n)

    def train(n: int) -> float:
        model.train()
        return timed(train_step, n)

    return Blocks(forward, train), rank


def reference_worker(workdir: Path, layout_name: str, implementation: str, steps: int, serve: bool) -> None:
    import torch.distributed as dist

    blocks, rank = reference_setup(workdir, layout_name, implementation)
    if not serve:
        forward_s, train_s = blocks.forward(steps), blocks.train(steps)
        if rank == 0:
            print(json.dumps({"forward_s": forward_s, "train_s": train_s}))
        return
    blocks.forward(1), blocks.train(1)   # each kind warmed up before the first timed block

    def next_command(command: str | None) -> str:
        """Rank 0's command, read from the driver, on every rank."""
        if not dist.is_initialized():
            return command
        message = [command]
        dist.broadcast_object_list(message, src=0)
        return message[0]

    serve_blocks(blocks, workdir / "commands_reference", rank == 0, next_command)


# ---- moe_jax (one process, on as many virtual devices as the layout needs) ---------------------------
def settled_capacity(model, batch, inference: bool) -> float | None:
    """The dispatch capacity `forward` / `TrainLoop` settle at for this batch (what a call at the largest capacity
    required, a rung of the model's ladder); None without dispatch (ep 1)."""
    if model.layout.ep_size == 1:
        return None
    probe = model.apply(model.params, batch, capacity=model.capacity_schedule.largest, inference=inference)
    return model.capacity_schedule.check(float(probe.statistics.required_capacity))


def ours_setup(workdir: Path, layout_name: str, implementation: str, warm_up: int | None) -> Blocks:
    """-> our blocks, after saving the logits, compiling every rung's train step and TrainLoop's warm-up steps."""
    import jax
    import optax

    sys.path.insert(0, str(ROOT))
    from moe_jax import AutoModelForCausalLM, DistributedConfig
    from moe_jax.training import TrainLoop, make_train_step

    layout = LAYOUTS[layout_name]
    config = None if layout is None else DistributedConfig(**layout, ep_implementation=implementation)
    model = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", config, progress=False,
                                                 devices=jax.devices()[:1] if layout is None else None)
    ids = np.load(workdir / "ids.npy").astype(np.int32)
    batch = jax.device_put(ids, model.batch_sharding())
    forward_capacity, train_capacity = settled_capacity(model, batch, True), settled_capacity(model, batch, False)
    print(f"capacity: forward {forward_capacity}, training starts at {train_capacity}", file=sys.stderr)
    forward = jax.jit(lambda params, ids: model.apply(params, ids, capacity=forward_capacity).logits)
    output = model.apply(model.params, batch, capacity=forward_capacity)
    if forward_capacity is not None and int(output.statistics.dropped):
        sys.exit(f"the forward dropped pairs at capacity {forward_capacity}")
    np.save(workdir / f"logits_ours_{layout_name}_{implementation}.npy", np.asarray(forward(model.params, batch)))

    # Training as users run it: TrainLoop (one step in flight, overflowed steps replayed at a larger capacity,
    # the capacity moved by the model's CapacitySchedule), on the same batch every step.
    train_step = make_train_step(model, optax.adamw(LEARNING_RATE, weight_decay=0.01), grad_clip=None)

    class SameBatch:
        def batch(self, index: int) -> dict:
            return {"input_ids": ids}

    loop = TrainLoop(train_step, SameBatch())
    state = train_step.init_state(capacity=train_capacity)
    # Every rung's program compiled before the clock starts: a capacity move inside the timed steps would
    # otherwise time a one-off compilation (a large fsdp4/ep4 step-down cost 15 s in a 17-step window).
    compiled = train_step.precompile(state, SameBatch().batch(0), progress=False)
    print(f"compiled the train step for capacities {list(compiled)} in {sum(compiled.values()):.0f} s",
          file=sys.stderr)
    # Warm-up: long enough for the capacity to climb and step down (patience) once.
    if warm_up is None:
        warm_up = 2 + 3 * model.capacity_schedule.patience
    training = {"state": None, "capacity_state": None, "step": warm_up}
    training["state"], training["capacity_state"] = loop.run(state, until_step=warm_up)

    def train(n: int) -> float:
        # One untimed step first, as `timed` gives the reference's blocks.
        training["step"] += 1
        training["state"], training["capacity_state"] = loop.run(
            training["state"], until_step=training["step"], capacity_state=training["capacity_state"])
        replays = loop.replays
        start = time.perf_counter()
        training["state"], training["capacity_state"] = loop.run(
            training["state"], until_step=training["step"] + n, capacity_state=training["capacity_state"])
        seconds = (time.perf_counter() - start) / n
        training["step"] += n
        capacity_state = training["capacity_state"]
        print(f"{n} timed steps: {loop.replays - replays} replays, capacity "
              f"{None if capacity_state is None else capacity_state.capacity}", file=sys.stderr)
        return seconds

    return Blocks(lambda n: timed(lambda: jax.block_until_ready(forward(model.params, batch)), n), train)


def ours_worker(workdir: Path, layout_name: str, implementation: str, steps: int, warm_up: int | None,
                serve: bool) -> None:
    blocks = ours_setup(workdir, layout_name, implementation, warm_up)
    if not serve:
        print(json.dumps({"forward_s": blocks.forward(steps), "train_s": blocks.train(steps)}))
        return
    serve_blocks(blocks, workdir / "commands_ours", True, lambda command: command)


def serve_blocks(blocks: Blocks, commands: Path, reads: bool, share: Callable[[str | None], str]) -> None:
    """Run the driver's commands ("forward N", "train N", "stop"), read from the FIFO `commands` by the one
    process that `reads` and passed to the others by `share`; the reader prints each block's seconds per call."""
    if reads:
        print(json.dumps({"ready": True}), flush=True)
    with open(commands) if reads else contextlib.nullcontext() as source:
        while True:
            command = share(source.readline().strip() if reads else None)
            if command in ("stop", ""):
                return
            kind, count = command.split()
            seconds = getattr(blocks, kind)(int(count))
            if reads:
                print(json.dumps({"seconds": seconds}), flush=True)


def rate_worker(workdir: Path) -> None:
    """The dense-matmul rate of this machine at the model's shapes (one device), for the ceiling column."""
    sys.path.insert(0, str(ROOT))
    from scripts.bench.timing import model_dense_rate

    config = json.loads((workdir / "checkpoint" / "config.json").read_text())
    tokens = int(np.load(workdir / "ids.npy").size)
    print(json.dumps({"rate": model_dense_rate(config, tokens)}))


# ---- driver -------------------------------------------------------------------------------------------
def host_memory_environ(environ: dict, huge_pages: bool) -> tuple[dict, str]:
    """`environ` with glibc's hugetlb tunable added (where it applies) or removed, and a line saying which."""
    from moe_jax.host_memory import TUNABLE, huge_page_tunables

    kept = [item for item in environ.get("GLIBC_TUNABLES", "").split(":") if item and not item.startswith(TUNABLE)]
    environ = {key: value for key, value in environ.items() if key != "GLIBC_TUNABLES"}
    if kept:
        environ["GLIBC_TUNABLES"] = ":".join(kept)
    if huge_pages and (tunables := huge_page_tunables(environ)) is not None:
        environ["GLIBC_TUNABLES"] = tunables
    value = environ.get("GLIBC_TUNABLES")
    return environ, f"GLIBC_TUNABLES={value}" if value else "GLIBC_TUNABLES unset"


def baseline_workdir(workdir: Path) -> Path:
    """The work directory of the baseline checkout's worker (`--baseline-tree`): the same checkpoint and batch, its
    own command FIFO and logits (it runs as the "ours" side of its script)."""
    own = workdir / "baseline"
    own.mkdir(exist_ok=True)
    for name in ("checkpoint", "ids.npy"):
        if not (own / name).exists():
            (own / name).symlink_to(workdir / name)
    return own


def worker_command(side: str, workdir: Path, layout_name: str, implementation: str, steps: int,
                   base_environ: dict | None, warm_up: int | None, serve: bool,
                   baseline_tree: Path | None = None) -> tuple[list[str], dict]:
    """-> (the command line, its environment) of one side's worker process. With `baseline_tree`, the reference
    side is our side run from that checkout, in `baseline_workdir`."""
    script = __file__
    if side == "reference" and baseline_tree is not None:
        side, script = "ours", str(baseline_tree / "scripts" / "bench" / Path(__file__).name)
        workdir = baseline_workdir(workdir)
    arguments = [script, f"--{side}-worker", str(workdir), "--layout", layout_name, "--implementation",
                 implementation, "--steps", str(steps)]
    if side == "ours" and warm_up is not None:
        arguments += ["--warm-up", str(warm_up)]
    if serve:
        arguments.append("--serve")
    environ = dict(base_environ or os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    environ["PYTHONPATH"] = str(Path(script).resolve().parents[2])   # that checkout's moe_jax, not the installed one
    layout = LAYOUTS[layout_name]
    devices = 1 if layout is None else layout.get("tp_size", 1) * layout.get("fsdp_size", 1)
    if side == "reference" and layout is not None:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(devices), *arguments]
    else:
        command = [sys.executable, *arguments]
        environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return command, environ


def run_worker(side: str, workdir: Path, layout_name: str, implementation: str, steps: int,
               base_environ: dict | None = None, warm_up: int | None = None) -> dict:
    command, environ = worker_command(side, workdir, layout_name, implementation, steps, base_environ, warm_up,
                                      serve=False)
    result = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        sys.exit(f"{side} {layout_name} {implementation} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(lines[-1])


class ServingWorker:
    """One side's worker kept alive between timed blocks (`--interleave`): commands through a FIFO, each block's
    seconds per call back on its stdout (stderr to a log file in the work directory)."""

    def __init__(self, side: str, workdir: Path, layout_name: str, implementation: str, steps: int,
                 environ: dict, warm_up: int | None, baseline_tree: Path | None = None):
        self.side = side
        fifo = workdir / f"commands_{side}"
        if side == "reference" and baseline_tree is not None:
            fifo = baseline_workdir(workdir) / "commands_ours"
        if fifo.exists():
            fifo.unlink()
        os.mkfifo(fifo)
        command, environ = worker_command(side, workdir, layout_name, implementation, steps, environ, warm_up,
                                          serve=True, baseline_tree=baseline_tree)
        self.log = workdir / f"{side}_{layout_name}_{implementation}.log"
        self.process = subprocess.Popen(command, cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                                        stderr=self.log.open("w"), text=True)
        self._reply()                       # {"ready": true}: set up and warmed up
        self.commands = fifo.open("w")

    def _reply(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        sys.exit(f"{self.side} worker ended ({self.process.wait()}):\n{self.log.read_text()[-4000:]}")

    def block(self, kind: str, calls: int) -> float:
        self.commands.write(f"{kind} {calls}\n")
        self.commands.flush()
        return self._reply()["seconds"]

    def stop(self) -> None:
        """Ends the worker; one that already ended (its failure being reported) is only waited for."""
        try:
            if self.process.poll() is None:
                self.commands.write("stop\n")
            self.commands.close()
        except BrokenPipeError:   # it ended between the poll and the write
            pass
        self.process.wait()


# Between two blocks: the side that just ran lets its threads go idle (OpenMP and Eigen workers spin a while
# after their last task) before the other side's clock starts.
PAUSE_S = 0.5


def interleaved_row(workdir: Path, layout_name: str, implementation: str, steps: int, environ: dict,
                    warm_up: int | None, rounds: int, tokens: int,
                    baseline_tree: Path | None = None) -> tuple[dict, dict, dict]:
    """Both sides alive at once, their timed blocks alternating (the side that goes first alternates too) ->
    (reference, ours: {kind: median seconds per call}, {kind: median over rounds of ours / reference})."""
    workers = {side: ServingWorker(side, workdir, layout_name, implementation, steps, environ, warm_up,
                                   baseline_tree)
               for side in ("reference", "ours")}
    times = {side: {"forward": [], "train": []} for side in workers}
    try:
        for round_index in range(rounds):
            order = ("reference", "ours") if round_index % 2 == 0 else ("ours", "reference")
            for kind in ("forward", "train"):
                for side in order:
                    time.sleep(PAUSE_S)
                    times[side][kind].append(workers[side].block(kind, steps))
            print(f"  round {round_index + 1}: " + ", ".join(
                f"{kind} ours / reference {times['reference'][kind][-1] / times['ours'][kind][-1]:.2f}x "
                f"({tokens / times['ours'][kind][-1]:.0f} / {tokens / times['reference'][kind][-1]:.0f} tokens/s)"
                for kind in ("forward", "train")), file=sys.stderr, flush=True)
    finally:
        for worker in workers.values():
            worker.stop()
    medians = ({kind: float(np.median(values)) for kind, values in times[side].items()} for side in workers)
    ratios = {kind: float(np.median(np.array(times["reference"][kind]) / np.array(times["ours"][kind])))
              for kind in ("forward", "train")}
    return *medians, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8,
                        help="timed calls per figure (after one warm-up call; ours: after TrainLoop's warm-up steps)")
    parser.add_argument("--warm-up", type=int, default=None,
                        help="ours: TrainLoop steps before the timed ones (default 2 + 3 x the schedule's patience: "
                             "the capacity climbs and steps down once); at --size large, "
                             "patience + 4 with --steps patience + 1 keeps the run in minutes")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each side per row, alternating (fresh processes each); medians reported")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="keep both sides' processes alive and alternate their timed blocks (--steps calls "
                             "each) ROUNDS times; the ratio is the median of the rounds' ratios (the machine's "
                             "drift between blocks seconds apart is small). Not with --repeats")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="both sides with glibc's hugetlb tunable (where it applies) or both without")
    parser.add_argument("--baseline-tree", type=Path, default=None, metavar="DIR",
                        help="with --interleave: A/B against the moe_jax of another checkout (its side in the 'ref' "
                             "columns) instead of the reference")
    parser.add_argument("--reference-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ours-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rate-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--implementation", default="-", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference_worker:
        reference_worker(Path(args.reference_worker), args.layout, args.implementation, args.steps, args.serve)
        return 0
    if args.ours_worker:
        ours_worker(Path(args.ours_worker), args.layout, args.implementation, args.steps, args.warm_up, args.serve)
        return 0
    if args.rate_worker:
        rate_worker(Path(args.rate_worker))
        return 0
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1.")
    if args.interleave < 0 or (args.interleave and args.repeats > 1):
        parser.error(f"--interleave {args.interleave}: a number of rounds >= 1 (0: off), without --repeats.")
    if args.baseline_tree is not None and (not args.interleave or not (
            args.baseline_tree / "scripts" / "bench" / Path(__file__).name).is_file()):
        parser.error(f"--baseline-tree {args.baseline_tree}: needs --interleave and a moe_jax checkout with "
                     f"scripts/bench/{Path(__file__).name}.")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="moe_jax_vs_reference_"))
    workdir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    environ, host_memory = host_memory_environ(dict(os.environ), args.huge_pages == "on")
    build(workdir, args.batch, args.seq, SIZES[args.size])
    tokens = args.batch * args.seq
    rows = []
    names = args.layouts.split(",")
    if unknown := sorted(set(names) - set(LAYOUTS)):
        parser.error(f"--layouts names {unknown}; choose from {', '.join(LAYOUTS)}")
    if "single" not in names and args.baseline_tree is None:  # the one-process reference: every row's logits baseline
        names.insert(0, "single")
    for name in names:
        for implementation in implementations(LAYOUTS[name]):
            # Sides alternate, each repeat a fresh pair of processes; the median of each side's times is reported
            # (this machine's speed drifts by tens of percent between runs minutes apart).
            runs = {"reference": [], "ours": []}
            if args.interleave:
                reference_s, ours_s, ratios = interleaved_row(workdir, name, implementation, args.steps, environ,
                                                              args.warm_up, args.interleave, tokens,
                                                              args.baseline_tree.resolve() if args.baseline_tree
                                                              else None)
                runs = {"reference": [{f"{kind}_s": seconds for kind, seconds in reference_s.items()}],
                        "ours": [{f"{kind}_s": seconds for kind, seconds in ours_s.items()}]}
            for repeat in range(0 if args.interleave else args.repeats):
                runs["reference"].append(run_worker("reference", workdir, name, implementation, args.steps, environ))
                runs["ours"].append(run_worker("ours", workdir, name, implementation, args.steps, environ,
                                               args.warm_up))
                if args.repeats > 1:
                    print(f"  repeat {repeat + 1}: " + ", ".join(
                        f"{side} fwd {tokens / times[-1]['forward_s']:.0f} train {tokens / times[-1]['train_s']:.0f}"
                        for side, times in runs.items()) + " tokens/s", file=sys.stderr, flush=True)
            reference, ours = ({key: float(np.median([run[key] for run in runs[side]])) for key in ("forward_s", "train_s")}
                               for side in ("reference", "ours"))
            if args.baseline_tree is None:
                baseline = np.load(workdir / "logits_reference_single_-.npy")
                differences = [float(np.max(np.abs(np.load(workdir / f"logits_{side}_{name}_{implementation}.npy")
                                                   - baseline))) for side in ("reference", "ours")]
            else:   # the two checkouts' logits against each other (in the 'diff ours' column)
                logits = f"logits_ours_{name}_{implementation}.npy"
                differences = [float("nan"), float(np.max(np.abs(np.load(workdir / logits)
                                                                 - np.load(baseline_workdir(workdir) / logits))))]
            if not args.interleave:
                ratios = {kind: reference[f"{kind}_s"] / ours[f"{kind}_s"] for kind in ("forward", "train")}
            rows.append((name, implementation, tokens / reference["forward_s"], tokens / ours["forward_s"],
                         ratios["forward"], tokens / reference["train_s"], tokens / ours["train_s"], ratios["train"],
                         *differences))
            print(f"done: {name} {implementation}", file=sys.stderr, flush=True)
    # The hardware ceiling: the train step's matmul FLOPs (3x the forward's) at the dense-matmul rate of this
    # machine, measured now at the model's shapes (scripts/bench/timing.py); every layout shares the same cores.
    sys.path.insert(0, str(ROOT))
    from scripts.bench.timing import matmul_flops_per_token

    rate = run_worker("rate", workdir, "single", "-", args.steps, environ)["rate"]
    ceiling = rate / (3 * matmul_flops_per_token(SIZES[args.size], args.seq))   # train tokens/s
    repeats = (f"; medians of {args.repeats} alternating runs per side" if args.repeats > 1 else
               f"; {args.interleave} interleaved rounds of {args.steps} calls, tokens/s medians per side, ratios "
               "the medians of the rounds' ratios" if args.interleave else "")
    if args.baseline_tree is not None:
        print(f"A/B: 'ref' columns = moe_jax from {args.baseline_tree}; 'ours' = this tree; ratio = this / that; "
              "'diff ours' = max |this tree's logits - that one's|")
    print(f"size {args.size}, batch {args.batch} x {args.seq} tokens, both sides with {host_memory}{repeats}; "
          "tokens/s (higher is better); max |logits - 1-process reference|")
    print(f"dense matmul rate {rate / 1e9:.0f} GFLOP/s -> train-step ceiling {ceiling:.0f} tokens/s; 'ceil': the "
          "train step's share of it")
    print(f"{'layout':<15}{'ep_impl':<12}{'fwd ref':>10}{'fwd ours':>10}{'ratio':>8}{'train ref':>11}"
          f"{'train ours':>11}{'ratio':>8}{'ceil ref':>9}{'ceil ours':>10}{'diff ref':>10}{'diff ours':>10}")
    for name, implementation, fwd_ref, fwd_ours, fwd_ratio, train_ref, train_ours, train_ratio, diff_ref, diff_ours \
            in rows:
        print(f"{name:<15}{implementation:<12}{fwd_ref:>10.0f}{fwd_ours:>10.0f}{fwd_ratio:>7.2f}x"
              f"{train_ref:>11.0f}{train_ours:>11.0f}{train_ratio:>7.2f}x{train_ref / ceiling:>8.0%}"
              f"{train_ours / ceiling:>10.0%}{diff_ref:>10.1e}{diff_ours:>10.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
