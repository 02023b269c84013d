"""`moe-jax plan --auto`: which layout to use for a model, a device count and a batch.

    moe-jax plan --auto --model CONFIG_OR_DIR --devices 8 --batch-size 16 --seq-len 4096 --train
                 [--device-memory 80GiB] [--hardware h100] [--nodes 1] [--top 10] [--json FILE]
                 [--max-compiles N] [--time-budget S] [--cache-dir DIR | --no-cache]

Plans every legal layout from its step compiled on virtual CPU devices, or for abstract GPUs of --hardware
(`--compiler target`; `moe_jax.planning`) and prints them ranked, with the command and `DistributedConfig` of
the best. Without --time-budget the floor (the best analytic guesses and every layout family) is compiled,
side by side in --compile-workers processes; a given --time-budget compiles in guess order for that long, a hard
limit. Compiled steps are kept in the user's cache directory and read by the next plan whatever its budget. The
virtual devices are requested here, before JAX starts: a pool of them, so that a layout can be compiled on more
devices than asked for when none fits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .layout_flags import LAYOUT_FLAGS

DEVICE_SEARCH_BUDGET = 60.0   # default seconds for the smallest-device-count search when nothing fits
# The best analytic guesses the default budget always compiles (with one layout of every family).
FLOOR_GUESSES = 12
# Virtual CPU devices requested when JAX starts, at least: enough to compile a layout on more devices than asked
# for when none fits there (min_devices_to_fit); an unused virtual device costs nothing.
DEVICE_POOL = 512


def add_auto_arguments(parser: argparse.ArgumentParser) -> None:
    """The --auto flags of `moe-jax plan` (the layout and --train/--optimizer flags are the command's own)."""
    group = parser.add_argument_group("--auto: choose the layout")
    group.add_argument("--auto", action="store_true",
                       help="rank every legal layout of --devices for the model, batch and hardware, from each "
                            "layout's step compiled ahead of time on virtual CPU devices (nothing allocated)")
    group.add_argument("--devices", type=int, default=None, help="with --auto: devices to lay the model over")
    group.add_argument("--batch-size", type=int, default=8, help="with --auto --train: sequences per step (default 8)")
    group.add_argument("--seq-len", type=int, default=2048, help="with --auto --train: tokens per sequence "
                                                                   "(default 2048)")
    group.add_argument("--serve", action="store_true",
                       help="with --auto: plan serving (one decode step of --max-slots requests against a KV cache "
                            "of --max-model-len tokens each) instead of training; no pipeline stages")
    group.add_argument("--max-slots", type=int, default=8, help="with --auto --serve: running requests (default 8)")
    group.add_argument("--max-model-len", type=int, default=2048,
                       help="with --auto --serve: tokens of KV cache per request (default 2048)")
    group.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                       help="parameter dtype, as moe-jax train --dtype (default float32): the bytes plan counts "
                            "(quantised codes kept with --no-dequantize count as stored) and --auto's steps")
    group.add_argument("--mixed-precision", action="store_true",
                       help="with --auto --train: float32 parameters and optimizer state, bfloat16 compute")
    group.add_argument("--grad-accum", type=int, default=1, help="with --auto --train: micro-batches per step")
    group.add_argument("--remat", choices=("none", "full", "dots_saveable"), default="none",
                       help="with --auto --train: what each layer keeps for the backward pass (default none)")
    group.add_argument("--device-memory", default=None,
                       help="with --auto: memory of one device, e.g. 80GiB (2^30 bytes) or 80GB (10^9 bytes) "
                            "(default: the hardware profile's)")
    group.add_argument("--memory-margin", type=float, default=0.1,
                       help="with --auto: share of device memory kept free for what the plan does not see "
                            "(allocator fragmentation, the runtime; default 0.1)")
    group.add_argument("--hardware", default="h100",
                       help="with --auto: a named profile of moe_jax/planning/hardware.py (h100, h200, b200, a100, "
                            "tpu-v5p), cpu, or a JSON file of a profile's fields "
                            "(default h100: datasheet rates; cpu: measured now on this machine; GPU and TPU "
                            "profiles are not measured here, only their datasheets are used)")
    group.add_argument("--nodes", type=int, default=None,
                       help="with --auto: nodes the devices span (collectives between nodes use the slower link; "
                            "default: as the hardware profile groups devices)")
    group.add_argument("--top", type=int, default=10, help="with --auto: rows printed (default 10)")
    group.add_argument("--json", default=None, metavar="FILE",
                       help="with --auto: write every row (best first), the excluded layouts and "
                            "min_devices_to_fit to FILE")
    group.add_argument("--max-compiles", type=int, default=None,
                       help="with --auto: compile at most this many layouts (the rest are listed as not compiled)")
    group.add_argument("--time-budget", type=float, default=None,
                       help=f"with --auto: compile layouts in guess order for this many seconds in all, a hard "
                            f"limit (0: every legal layout). Default: the floor, the {FLOOR_GUESSES} best analytic "
                            f"guesses and one layout of every family (ep size, pp size, tp, HSDP); layouts in the "
                            f"compile cache are read whatever the budget")
    group.add_argument("--compiler", choices=("target", "cpu"), default=None,
                       help="with --auto: what compiles each layout's step: target (XLA:GPU for abstract devices of "
                            "--hardware: its memory and collectives are the GPU compiler's; needs JAX's CUDA plugin, "
                            "pip install -e \".[gpu-compile]\") or cpu (XLA:CPU on virtual CPU devices). Default: "
                            "target when the plugin is installed and --hardware is h100, h200, b200 or a100, else cpu")
    group.add_argument("--compile-workers", type=int, default=None,
                       help="with --auto: layouts compiled at once, each in a worker process (default: one per "
                            "core, at most 4; each takes about one core and the host memory of its program)")
    cache = group.add_mutually_exclusive_group()
    cache.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="with --auto: keep compiled steps in DIR (default: $XDG_CACHE_HOME/moe_jax/plan or "
                            "~/.cache/moe_jax/plan); a plan of the same model, layouts and request reads them "
                            "instead of compiling")
    cache.add_argument("--no-cache", action="store_true",
                       help="with --auto: compile every layout, neither reading nor writing the cache")


def check_auto_flags(args: argparse.Namespace) -> None:
    given = [f"--{flag.replace('_', '-')}" for flag in LAYOUT_FLAGS
             if flag != "ep_implementation" and getattr(args, flag, None) is not None]
    if given:
        raise ValueError(f"--auto chooses the layout: drop {', '.join(given)} (or drop --auto to plan that layout).")
    if args.devices is None:
        raise ValueError("--auto needs --devices N: the number of devices to lay the model over.")
    if args.train and args.serve:
        raise ValueError("--auto plans --train or --serve, not both.")


def request_virtual_devices(devices: int) -> None:
    """Ask XLA for the virtual CPU devices the plan compiles on, before anything starts JAX (building a model
    may: a plan warning asks which process it is in)."""
    from ..host_devices import use_cpu_devices

    use_cpu_devices(max(devices, DEVICE_POOL), override=True)


def cpu_devices(count: int) -> list:
    """Up to the first `count` CPU devices: the planner's `cpu_devices`."""
    import jax

    return jax.devices("cpu")[:count]


def progress_printer(start: float):
    """Progress lines on stderr: rewritten in place on a terminal, one per layout otherwise."""
    terminal = sys.stderr.isatty()

    def show(message: str) -> None:
        line = f"[{time.perf_counter() - start:5.0f} s] {message}"
        print(f"\r\033[K{line}" if terminal else line, end="" if terminal else "\n", file=sys.stderr, flush=True)

    return show


def run_auto(args: argparse.Namespace) -> int:
    from ..planning.compile_cache import CompileCache
    from ..planning.compile_pool import default_compile_workers
    from ..planning.memory_size import describe_memory_size
    from ..planning.search import plan_layouts
    from ..reporting.layout_ranking import ranking_report

    check_auto_flags(args)
    from ..verbosity import verbose
    from .train import offload_from_flags

    if not verbose():
        # XLA's C++ warnings about the planned programs (a partitioner's resharding, per layout) would bury the
        # answer; the costs they describe are in the rows. Read when JAX starts: no effect once it has.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    request_virtual_devices(args.devices)
    from ..planning.compile_pool import quiet_compiler_logs

    quiet_compiler_logs()
    if args.device_memory is not None:
        print(f"device memory: {describe_memory_size(args.device_memory)}", file=sys.stderr)
    start = time.perf_counter()
    time_budget = 0.0 if args.time_budget is None else args.time_budget or None   # default: the floor alone
    plan = plan_layouts(
        args.model, devices=args.devices, batch_size=args.batch_size, seq_len=args.seq_len,
        mode="serve" if args.serve else "train", hardware=args.hardware, device_memory=args.device_memory,
        margin=args.memory_margin, nodes=args.nodes, max_compiles=args.max_compiles,
        time_budget=time_budget, compile_floor=args.time_budget is None, floor_guesses=FLOOR_GUESSES,
        device_search_budget=DEVICE_SEARCH_BUDGET if args.time_budget is None else None,
        cache=CompileCache.at(args.cache_dir, enabled=not args.no_cache), cpu_devices=cpu_devices,
        progress=progress_printer(start),
        dtype=args.dtype, optimizer=args.optimizer or "adamw", mixed_precision=args.mixed_precision,
        grad_accum=args.grad_accum, remat=args.remat, max_slots=args.max_slots, max_model_len=args.max_model_len,
        offload=offload_from_flags(args), compiler=args.compiler,
        compile_workers=args.compile_workers or default_compile_workers())
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(ranking_report(plan, model=args.model, top=args.top))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(plan.as_json(), handle, indent=1)
            handle.write("\n")
    print(f"\n(planned in {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0
