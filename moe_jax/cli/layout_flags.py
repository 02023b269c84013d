"""The layout flags every `moe-jax` command shares, and the `DistributedConfig` they spell.

    add_layout_flags(parser)                        # --tp --fsdp --ep --dp-replicate [--pp] [--ep-implementation]
    add_layout_flags(parser, context=True)          # ... and --cp --cp-strategy --sequence-parallel (full sequences)
    check_no_context_parallel(args, "generate")     # a decoding command refuses --cp > 1
    config = distributed_config_from_flags(args)    # DistributedConfig(tp_size=args.tp, ...)
    options = pipeline_options_from_flags(args)     # pipeline_microbatches=args.pp_microbatches, ... (model kwargs)
    add_scan_layers_flag(parser); scan_layers_from_flags(args)   # --scan-layers auto|true|false -> scan_layers
    add_dequantize_flag(parser); args.dequantize                 # --no-dequantize: from_pretrained(dequantize=False)

Kept free of JAX imports so `moe-jax --help` stays fast.
"""

from __future__ import annotations

import argparse

# flag -> DistributedConfig field
LAYOUT_FLAGS = {"tp": "tp_size", "fsdp": "fsdp_size", "ep": "ep_size", "dp_replicate": "dp_replicate_size",
                "pp": "pp_size", "ep_implementation": "ep_implementation", "cp": "cp_size",
                "cp_strategy": "cp_strategy", "sequence_parallel": "enable_sequence_parallel"}
# The flags that size a layout (a command without any of them runs on one device).
LAYOUT_SIZE_FLAGS = ("tp", "fsdp", "ep", "dp_replicate", "pp", "cp")
CP_HELP = ("cp_size: context parallelism, devices that split each sequence between them (2 x cp zig-zag chunks: "
           "rank r holds chunks r and 2cp-1-r, so --seq-len must be a multiple of 2 x cp); parameters are "
           "replicated over cp, FSDP-sharded over --fsdp; expert groups (--ep) may span cp ranks")
CP_STRATEGY_HELP = ("with --cp: how attention sees the other ranks' keys: all_gather (gather keys and values whole: "
                    "few KV heads, GQA / MLA; the default) or ring (pass them around with ppermute, online softmax: "
                    "less memory, long sequences)")
SEQUENCE_PARALLEL_HELP = ("enable_sequence_parallel: with --tp, split the residual stream, norms and router inputs "
                          "over tp along the sequence (same results, less activation memory)")


def add_layout_flags(parser: argparse.ArgumentParser, *, pipeline: bool = True,
                     ep_implementation: bool = False, what: str = "", context: bool | str = False) -> None:
    """Add --tp/--fsdp/--ep/--dp-replicate (and --pp, --ep-implementation, and with `context` --cp /
    --cp-strategy / --sequence-parallel, when asked) to `parser`; context="decoding": --cp alone, refused."""
    parser.add_argument("--tp", type=int, default=None, help=f"tp_size{what}")
    parser.add_argument("--fsdp", type=int, default=None, help=f"fsdp_size{what}")
    parser.add_argument("--ep", type=int, default=None, help=f"ep_size{what}")
    parser.add_argument("--dp-replicate", type=int, default=None, help=f"dp_replicate_size (HSDP replicas){what}")
    if pipeline:
        parser.add_argument("--pp", type=int, default=None, help="pp_size: pipeline stages")
        parser.add_argument("--pp-microbatches", type=int, default=None,
                            help="with --pp: microbatches a batch is cut into (default: one per stage)")
        parser.add_argument("--pp-schedule", choices=("gpipe", "circular"), default="gpipe",
                            help="with --pp: gpipe (the reference's split of the layers) or circular "
                                 "(--pp-repeats chunks of layers per stage; default gpipe)")
        parser.add_argument("--pp-repeats", type=int, default=1,
                            help="with --pp-schedule circular: chunks of layers per stage (default 1)")
    if ep_implementation:
        parser.add_argument("--ep-implementation", default="auto",
                            help="a registered EP implementation: auto, all_to_all, all_reduce, ...")
    if context:
        add_context_flags(parser, decoding=context == "decoding")


DECODE_CP_HELP = ("refused here: a KV cache step does not split the sequence; use a layout without --cp (--cp "
                  "is for train, eval, plan, compile --train)")


def add_context_flags(parser: argparse.ArgumentParser, *, decoding: bool = False) -> None:
    """--cp, --cp-strategy and --sequence-parallel (commands that run whole sequences: train, eval, plan, ...);
    `decoding`: --cp alone, refused by `check_no_context_parallel` (generate, serve)."""
    from ..distributed.config import CP_STRATEGIES

    if decoding:
        parser.add_argument("--cp", type=int, default=None, help=DECODE_CP_HELP)
        return
    parser.add_argument("--cp", type=int, default=None, help=CP_HELP)
    parser.add_argument("--cp-strategy", choices=CP_STRATEGIES, default=None, help=CP_STRATEGY_HELP)
    parser.add_argument("--sequence-parallel", action="store_true", default=None, help=SEQUENCE_PARALLEL_HELP)


def check_context_flags(args: argparse.Namespace, seq_len: int | None) -> None:
    """--cp-strategy needs --cp > 1; --seq-len (when known) must split into 2 x cp chunks. Raised before
    anything is loaded."""
    cp = getattr(args, "cp", None)
    if getattr(args, "cp_strategy", None) is not None and (cp or 1) == 1:
        raise ValueError("--cp-strategy chooses how context parallelism's attention runs: add --cp N (N > 1), "
                         "or drop --cp-strategy.")
    if cp is not None and cp > 1 and seq_len is not None and seq_len % (2 * cp):
        raise ValueError(f"--seq-len {seq_len} cannot be split over --cp {cp}: context parallelism cuts each "
                         f"sequence into 2 x cp = {2 * cp} equal chunks; use a --seq-len that is a multiple of "
                         f"{2 * cp} (e.g. {(seq_len // (2 * cp) + 1) * 2 * cp}).")


def check_no_context_parallel(args: argparse.Namespace, command: str) -> None:
    """A decoding command (generate, serve) refuses --cp > 1 before loading anything: a KV cache step does not
    split the sequence."""
    if (getattr(args, "cp", None) or 1) > 1:
        raise ValueError(f"`moe-jax {command}` decodes with a KV cache, which context parallelism does not split: "
                         f"drop --cp (and --cp-strategy) and use a layout without cp, e.g. --fsdp "
                         f"{args.cp * (getattr(args, 'fsdp', None) or 1)} for the same devices.")


# --scan-layers value -> the model's `scan_layers` option
SCAN_CHOICES = {"auto": "auto", "true": True, "false": False}
# What --scan-layers means for the commands that decode (docs/benchmarks.md, "Compile time"):
# their "auto" is unrolled, as MaxText / JetStream serve from unscanned parameters.
DECODE_SCAN_HELP = ("run identical layers as one scan over stacked parameters (auto, the default here: unrolled; "
                    "a scanned decode step copies each layer's stacked expert weights, unrolled ones ran 1.2-1.6x "
                    "faster; unrolled programs compile about 0.25 s longer per layer on CPU, so a deep model may "
                    "start faster with true)")
TRAIN_SCAN_HELP = "run identical layers as one scan over stacked parameters (auto: from 16 layers)"


def add_scan_layers_flag(parser: argparse.ArgumentParser, help_text: str = TRAIN_SCAN_HELP) -> None:
    parser.add_argument("--scan-layers", choices=tuple(SCAN_CHOICES), default="auto", help=help_text)


DEQUANTIZE_HELP = ("--no-dequantize keeps a quantised checkpoint's weights (gpt-oss's MXFP4 experts) in their "
                   "format on the devices, decoded inside each step: the quantised bytes, inference only; "
                   "--dequantize (default) decodes them at load")


QUANTIZE_HELP = ("quantise an unquantised checkpoint's weights as they are read, weight-only: int8 (one scale per "
                 "output row) or fp8 (e4m3, 128 x 128 block scales; `convert` writes Transformers' FineGrainedFP8 "
                 "format); inference only")
QUANTIZE_MODULES_HELP = ("what --quantize covers: 'experts' (default) and / or linear module names such as o_proj "
                         "or self_attn.q_proj, comma-separated")


def add_dequantize_flag(parser: argparse.ArgumentParser) -> None:
    """--dequantize / --no-dequantize (a quantised checkpoint) and --quantize / --quantize-modules (a plain one)."""
    parser.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=True, help=DEQUANTIZE_HELP)
    # Checked by WeightQuantization (not argparse choices), so the flag and the Python API give the same error.
    parser.add_argument("--quantize", default=None, metavar="{int8,fp8}", help=QUANTIZE_HELP)
    parser.add_argument("--quantize-modules", default=None, type=lambda text: tuple(text.split(",")),
                        metavar="MODULES", help=QUANTIZE_MODULES_HELP)


def quantize_options(args: argparse.Namespace) -> dict:
    """from_pretrained's `dequantize`, `quantize` and `quantize_modules` from the flags."""
    return {"dequantize": getattr(args, "dequantize", True), "quantize": getattr(args, "quantize", None),
            "quantize_modules": getattr(args, "quantize_modules", None)}


def weight_quantization_from_flags(args: argparse.Namespace, config: dict):
    """The model's `weight_quantization` for a model built from `config` alone (no weights read), or None."""
    if getattr(args, "quantize", None) is None and getattr(args, "quantize_modules", None) is None:
        return None
    from ..pretrained import weight_quantization

    return weight_quantization(config, args.model, args.quantize, args.quantize_modules)


def kept_quantization_from_flags(args: argparse.Namespace, config: dict) -> str | None:
    """The model's `kept_quantization` for a model built from `config` alone (no weights read): its
    quantization_config's method under --no-dequantize, else None."""
    if getattr(args, "dequantize", True):
        return None
    from ..pretrained import quantization_method

    return quantization_method(config, args.model)


def decode_scan_layers(choice: str):
    """The model's `scan_layers` option for a decoding job from a --scan-layers choice: "auto" is False."""
    return False if choice == "auto" else SCAN_CHOICES[choice]


def scan_layers_from_flags(args: argparse.Namespace, *, decoding: bool = False):
    """The model's `scan_layers` option from --scan-layers ("auto" for a command without it); a decoding command
    (`decoding`) resolves "auto" to unrolled layers (`decode_scan_layers`)."""
    choice = getattr(args, "scan_layers", "auto")
    return decode_scan_layers(choice) if decoding else SCAN_CHOICES[choice]


def distributed_config_from_flags(args: argparse.Namespace):
    """The `DistributedConfig` of the layout flags present on `args` (absent flags keep its defaults)."""
    from ..distributed.config import DistributedConfig

    values = {field: getattr(args, flag) for flag, field in LAYOUT_FLAGS.items()
              if getattr(args, flag, None) is not None}
    return DistributedConfig(**values)


def pipeline_options_from_flags(args: argparse.Namespace) -> dict:
    """The model's pipeline keyword arguments from --pp-microbatches / --pp-schedule / --pp-repeats ({} for a
    command without them)."""
    if not hasattr(args, "pp_schedule"):
        return {}
    return {"pipeline_microbatches": args.pp_microbatches, "pipeline_schedule": args.pp_schedule,
            "pipeline_repeats": args.pp_repeats}


def layout_given(args: argparse.Namespace) -> bool:
    """Whether any layout size flag was passed (without one, commands run on one device)."""
    return any(getattr(args, flag, None) is not None for flag in LAYOUT_SIZE_FLAGS)


def layout_devices(count: int, command: str) -> list:
    """The first `count` devices of the default platform in rank order; on CPU, virtual devices are requested
    first. A multi-process job uses every device of the job."""
    if count > 1:
        from ..host_devices import use_cpu_devices

        use_cpu_devices(count)  # takes effect only if JAX has not started its CPU backend yet
    import jax

    from ..distributed.runtime import job_devices

    devices = job_devices()
    if jax.process_count() > 1 and count != len(devices):
        raise ValueError(
            f"The layout covers {count} device(s) but this job of {jax.process_count()} processes has "
            f"{len(devices)}: a multi-process job must use all of them (every process holds some). Choose --pp, "
            f"--dp-replicate, --fsdp and --tp whose product is {len(devices)} (--ep regroups those devices)."
        )
    if len(devices) >= count:
        return devices[:count]
    platform = devices[0].platform
    if platform == "cpu":
        raise ValueError(
            f"The layout needs {count} devices but JAX started with {len(devices)} CPU device(s). Set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX starts (e.g. in the shell: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} moe-jax {command} ...), or use a smaller layout."
        )
    raise ValueError(
        f"The layout needs {count} devices but JAX sees {len(devices)} {platform} device(s); choose --pp, "
        f"--dp-replicate, --fsdp and --tp whose product is at most {len(devices)}."
    )


def describe_layout(distributed_config) -> str:
    stages = f" pp={distributed_config.pp_size}" if distributed_config.pp_size > 1 else ""
    cp = getattr(distributed_config, "cp_size", 1)
    context = f" cp={cp} ({distributed_config.cp_strategy})" if cp > 1 else ""
    sequence = " sequence_parallel" if distributed_config.enable_sequence_parallel and distributed_config.tp_size > 1 else ""
    return (f"tp={distributed_config.tp_size} fsdp={distributed_config.fsdp_size} ep={distributed_config.ep_size} "
            f"dp_replicate={distributed_config.dp_replicate_size}{stages}{context}{sequence}")


def warn_about_head_split(model) -> None:
    """One `warning:` line on stderr when the layout's tp_size does not divide the model's KV heads, saying
    what becomes of them (`moe-jax plan` prints the same as a note)."""
    import sys

    from ..reporting.plan_report import head_split_note

    if (note := head_split_note(model)) is not None:
        print(f"warning: {note}", file=sys.stderr)
