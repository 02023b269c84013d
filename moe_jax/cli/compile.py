"""`moe-jax compile`: compile a model's step for the cluster it will run on, from any machine (MaxText's
train_compile, for our layouts).

    moe-jax compile --model CKPT_OR_CONFIG --hardware h100 --devices 8 --fsdp 8 --ep 8 \
        --train --batch-size 16 --seq-len 4096 --mixed-precision [--remat full] [--json report.json] \
        [--offload-optimizer] [--offload-parameters] [--save-executable out/]
    moe-jax compile --model CKPT_OR_CONFIG --hardware h100 --devices 8 --tp 8 --ep 8 --serve --max-slots 64
    moe-jax compile --model CKPT_OR_CONFIG --hardware h100 --devices 8 --fsdp 8 --ep 8 --generate --seq-len 1024

For GPU hardware (h100, h200, b200, a100) it needs JAX's CUDA plugin, not a GPU: XLA:GPU compiles for abstract
devices of that model (`moe_jax.distributed.target_devices`). `--hardware cpu` compiles for this machine's
(virtual) CPU devices. Prints, per program and device: memory against the device (fits or not, and what to
change), compile seconds, the collectives of one step, the kernel that runs the expert matmuls, host transfers;
with --offload-optimizer / --offload-parameters, the pinned host memory apart from the device's (XLA:GPU).
A program that does not fit, or a bad request, is one `error:` line and exit 2, with nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .layout_flags import (
    LAYOUT_FLAGS,
    add_dequantize_flag,
    add_layout_flags,
    check_context_flags,
    check_no_context_parallel,
    decode_scan_layers,
    kept_quantization_from_flags,
    pipeline_options_from_flags,
    weight_quantization_from_flags,
)

HARDWARE_HELP = "h100, h200, b200, a100 (XLA:GPU for abstract devices; needs JAX's CUDA plugin), or cpu (this machine)"


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory or config.json of an HF MoE model "
                                                       "(only the config is read)")
    parser.add_argument("--hardware", default="h100", help=f"what to compile for: {HARDWARE_HELP} (default h100)")
    parser.add_argument("--devices", type=int, required=True,
                        help="devices to compile for (one host of up to 8 GPUs, then hosts of 8)")
    add_layout_flags(parser, ep_implementation=True, what=" (default: --fsdp DEVICES)", context=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--train", action="store_true", help="compile the train step")
    mode.add_argument("--serve", action="store_true",
                      help="compile the continuous-batching step and decode `moe-jax serve` runs (--max-slots slots "
                           "of --max-model-len tokens, at the widest page table)")
    mode.add_argument("--generate", action="store_true",
                      help="compile generate's prefill (prompts of --seq-len tokens) and decode programs")
    parser.add_argument("--batch-size", type=int, default=8, help="--train: sequences per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=2048,
                        help="--train: tokens per sequence; --serve: prompt length of the prefill, at most half "
                             "of --max-model-len (default 2048)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="parameter dtype (default float32)")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="--train: float32 parameters and optimizer state, bfloat16 compute")
    parser.add_argument("--remat", choices=("none", "full", "dots_saveable"), default="none",
                        help="--train: what each layer keeps for the backward pass (default none)")
    parser.add_argument("--grad-accum", type=int, default=1, help="--train: micro-batches per step (default 1)")
    parser.add_argument("--optimizer", choices=("adamw", "muon", "sgd"), default="adamw",
                        help="--train (default adamw)")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="--train: keep the optimizer state in pinned host memory between steps (memory is "
                             "then counted on the device and in host memory apart)")
    parser.add_argument("--offload-parameters", action="store_true",
                        help="--train: keep the trained parameters in pinned host memory between steps")
    parser.add_argument("--max-slots", type=int, default=8, help="--serve: rows decoded together (default 8)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="--serve: tokens of KV cache per row (default 2048)")
    parser.add_argument("--num-redundant-experts", type=int, default=0,
                        help="extra expert slots per sparse layer over the ep ranks (default 0)")
    add_dequantize_flag(parser)   # --no-dequantize: a quantised checkpoint's weights kept; --quantize int8|fp8
    parser.add_argument("--experts-backend", default=None,
                        help="grouped-matmul backend of the experts (default: the target platform's)")
    parser.add_argument("--device-memory", default=None,
                        help="memory of one device, e.g. 80GiB (default: the hardware's)")
    parser.add_argument("--memory-margin", type=float, default=0.1,
                        help="share of device memory kept free for what the compiler does not see (default 0.1)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the report as JSON (hardware, devices, compiler, memory_bytes, fits, "
                             "compile_seconds, collectives, experts_kernel, host_transfers, programs, ...)")
    parser.add_argument("--save-executable", default=None, metavar="DIR",
                        help="write each compiled program (jax.experimental.serialize_executable) and the report "
                             "into DIR, to load on the machine it targets (moe_jax.target_compile.load_executable)")


def _distributed_config(args: argparse.Namespace):
    from ..distributed.config import DistributedConfig
    from ..distributed.mesh import DeviceLayout

    values = {field: getattr(args, flag) for flag, field in LAYOUT_FLAGS.items() if getattr(args, flag) is not None}
    others = (values.get("tp_size", 1) * values.get("dp_replicate_size", 1) * values.get("pp_size", 1)
              * values.get("cp_size", 1))
    if "fsdp_size" not in values and args.devices % others == 0:
        values["fsdp_size"] = args.devices // others     # fsdp fills the devices the other sizes leave
    config = DistributedConfig(**values)
    needed = DeviceLayout.from_config(config).num_devices
    if needed != args.devices:
        raise ValueError(f"the layout (--tp x --fsdp x --dp-replicate x --pp x --cp = {needed}) does not fill --devices "
                         f"{args.devices}: choose sizes whose product is {args.devices}.")
    return config


def _request(args: argparse.Namespace):
    from ..planning.request import PlanRequest
    from .train import offload_from_flags

    offload = offload_from_flags(args)
    if offload is not None and not args.train:
        raise ValueError("--offload-optimizer / --offload-parameters place a train state: add --train.")

    return PlanRequest(mode="train" if args.train else "serve", batch_size=args.batch_size, seq_len=args.seq_len,
                       dtype=args.dtype, optimizer=args.optimizer, mixed_precision=args.mixed_precision,
                       grad_accum=args.grad_accum, remat=args.remat, max_slots=args.max_slots,
                       max_model_len=args.max_model_len, offload=offload)


def _check_outputs(args: argparse.Namespace) -> None:
    if args.save_executable is not None:
        directory = Path(args.save_executable)
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise ValueError(f"--save-executable {directory}: not a new or empty directory; name another one.")
    if args.json is not None and Path(args.json).is_dir():
        raise ValueError(f"--json {args.json} is a directory; name a file.")


def run_compile(args: argparse.Namespace) -> int:
    from ..target_compile import HARDWARE_CHOICES

    if args.hardware not in HARDWARE_CHOICES:
        raise ValueError(f"unknown --hardware {args.hardware!r}: use one of {', '.join(HARDWARE_CHOICES)}.")
    if args.devices < 1:
        raise ValueError(f"--devices {args.devices}: compile for at least one device.")
    if args.hardware == "cpu":
        from ..host_devices import use_cpu_devices

        use_cpu_devices(args.devices, override=True)
    _check_outputs(args)
    if args.train:
        check_context_flags(args, args.seq_len)
    else:
        check_no_context_parallel(args, "serve" if args.serve else "generate")
    request = _request(args)
    config = _distributed_config(args)
    from ..planning.compile_pool import quiet_compiler_logs

    quiet_compiler_logs()   # XLA's per-program warnings (a partitioner's resharding, a deviceless sort)
    from ..target_compile import CompileFailed, build_target_model, compile_devices, compile_model, save_executables

    start = time.perf_counter()
    devices = compile_devices(args.hardware, args.devices)
    options = {**pipeline_options_from_flags(args), "num_redundant_experts": args.num_redundant_experts,
               "experts_backend": args.experts_backend}
    from ..checkpoint_files import read_config

    values = read_config(args.model)
    options["kept_quantization"] = kept_quantization_from_flags(args, values)
    options["weight_quantization"] = weight_quantization_from_flags(args, values)
    programs = "train" if args.train else "serve" if args.serve else "generate"
    if programs != "train":
        options["scan_layers"] = decode_scan_layers("auto")   # as generate and serve run it
    model = build_target_model(values, config, devices, request, **options)
    try:
        report = compile_model(model, request, hardware=args.hardware, device_memory=args.device_memory,
                               margin=args.memory_margin, programs=programs,
                               progress=lambda message: print(f"[{time.perf_counter() - start:5.0f} s] {message}",
                                                              file=sys.stderr))
    except CompileFailed as error:   # the compiler's failure, not the request's: exit 1, as a failed check
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(report.text())
    if not report.fits:
        raise ValueError(f"{report.largest.name} needs {report.largest.memory.total / 2**30:.2f} GiB per device of "
                         f"the {report.usable_bytes / 2**30:.2f} GiB usable on {args.hardware}: {report.advice} "
                         "(nothing written).")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=1) + "\n", encoding="utf-8")
    if args.save_executable:
        save_executables(report.executables, Path(args.save_executable), report)
        print(f"executables in {args.save_executable}: load each on {args.devices} x {args.hardware} with "
              "moe_jax.target_compile.load_executable(PATH) (jax.experimental.serialize_executable), then call it "
              "with the program's arguments", file=sys.stderr)
    return 0
