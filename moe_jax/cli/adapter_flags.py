"""The commands' LoRA and frozen-part flags: training an adapter, freezing parts of the model, and using an
adapter (generate, serve, convert).

    moe-jax train --model CKPT/ --lora-rank 8 --lora-alpha 16 --lora-target-modules q_proj,v_proj \\
        --lora-target-parameters mlp.experts.gate_up_proj,mlp.experts.down_proj --export-adapter adapter/
    moe-jax train --model CKPT/ --freeze '*.mlp.gate.*'            # full fine-tuning but the routers
    moe-jax generate --model CKPT/ --adapter adapter/ --prompt "..." [--merge-adapter]
    moe-jax convert --model CKPT/ --merge-adapter adapter/ --out merged/
    moe-jax serve --model CKPT/ --lora-modules sql=adapters/sql chat=adapters/chat [--max-loras 4]

An adapter's files are PEFT's (`adapter_config.json`, `adapter_model.safetensors`), read and written by
`moe_jax.lora`. Bad values (a rank <= 0, a target or --freeze pattern that matches nothing, an adapter made for
another model) fail before any step, with one `error:` line.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def split_names(text: str | None) -> list[str] | None:
    """"q_proj,v_proj" -> ["q_proj", "v_proj"]; None stays None."""
    return None if text is None else [name.strip() for name in text.split(",") if name.strip()]


# ---- train ----------------------------------------------------------------------------------------------------
def add_train_flags(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA and frozen parts")
    lora.add_argument("--lora-rank", type=int, default=None, metavar="R",
                      help="train a LoRA adapter of rank R (PEFT's r) instead of the whole model; the base weights "
                           "stay frozen and the checkpoints hold the adapter and its optimizer state only")
    lora.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                      help="PEFT's lora_alpha: the update is scaled by A / R (default 8, as PEFT)")
    lora.add_argument("--lora-rslora", action="store_true", help="scale by A / sqrt(R) (rsLoRA) instead of A / R")
    lora.add_argument("--lora-target-modules", default=None, metavar="NAMES",
                      help="comma-separated Linear modules to adapt, names or dotted suffixes as PEFT matches them "
                           "(default q_proj,v_proj when no --lora-target-parameters is given either)")
    lora.add_argument("--lora-target-parameters", default=None, metavar="NAMES",
                      help="comma-separated parameters to adapt directly, e.g. the fused experts "
                           "mlp.experts.gate_up_proj,mlp.experts.down_proj (one adapter per expert, sharded with it)")
    lora.add_argument("--export-adapter", default=None, metavar="DIR",
                      help="write the trained adapter here in PEFT's format (PeftModel.from_pretrained reads it)")
    lora.add_argument("--freeze", default=None, metavar="PATTERN[,PATTERN]",
                      help="do not train the parameters (or, with --lora-rank, the adapter arrays) whose HF names "
                           "match these globs, e.g. '*.mlp.gate.*' for the routers; they get no gradient and no "
                           "optimizer state")


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """`moe-jax plan --train`'s adapter flags: the train state of a LoRA run (the adapter and its optimizer state)."""
    lora = parser.add_argument_group("LoRA (with --train)")
    lora.add_argument("--lora-rank", type=int, default=None, metavar="R",
                      help="count the train state of a rank-R LoRA run: the adapter and its optimizer state only")
    lora.add_argument("--lora-alpha", type=float, default=None, metavar="A", help="PEFT's lora_alpha (default 8)")
    lora.add_argument("--lora-rslora", action="store_true", help="rsLoRA scaling (the bytes are the same)")
    lora.add_argument("--lora-target-modules", default=None, metavar="NAMES",
                      help="comma-separated Linear modules (default q_proj,v_proj without --lora-target-parameters)")
    lora.add_argument("--lora-target-parameters", default=None, metavar="NAMES",
                      help="comma-separated parameters, e.g. mlp.experts.gate_up_proj,mlp.experts.down_proj")
    parser.set_defaults(export_adapter=None)


def lora_config_from_flags(args, model_dir: Path | None):
    """The `LoraConfig` the flags ask for, or None without --lora-rank (ValueError for a flag given without it)."""
    from ..lora import LoraConfig

    lora_flags = {"--lora-alpha": args.lora_alpha, "--lora-target-modules": args.lora_target_modules,
                  "--lora-target-parameters": args.lora_target_parameters, "--export-adapter": args.export_adapter,
                  "--lora-rslora": args.lora_rslora or None}
    if args.lora_rank is None:
        given = [flag for flag, value in lora_flags.items() if value is not None]
        if given:
            raise ValueError(f"{given[0]} needs --lora-rank R (the adapter's rank).")
        return None
    modules, parameters = split_names(args.lora_target_modules), split_names(args.lora_target_parameters)
    if modules is None and parameters is None:
        modules = ["q_proj", "v_proj"]
    try:
        return LoraConfig(r=args.lora_rank, lora_alpha=8 if args.lora_alpha is None else args.lora_alpha,
                          target_modules=modules, target_parameters=parameters, use_rslora=args.lora_rslora,
                          base_model_name_or_path=None if model_dir is None else str(model_dir))
    except ValueError as error:
        raise ValueError(f"--lora-rank / --lora-*: {error}") from None


def trainable_from_flags(args, model):
    """What `make_train_step(trainable=)` gets: None (the default), or the --freeze complement."""
    from ..training.trainable import freezing

    patterns = split_names(args.freeze)
    if patterns is None:
        return None
    if not patterns:
        raise ValueError("--freeze needs at least one glob, e.g. --freeze '*.mlp.gate.*'.")
    return freezing(model, patterns)


def export_adapter(args, model, adapter) -> None:
    model.save_adapter(args.export_adapter, adapter=adapter)
    print(f"wrote the trained LoRA adapter to {args.export_adapter} (PEFT's adapter_config.json + "
          "adapter_model.safetensors)")


# ---- generate, serve, convert -----------------------------------------------------------------------------------
def add_use_flags(parser: argparse.ArgumentParser, *, merge_help: str) -> None:
    parser.add_argument("--adapter", default=None, metavar="DIR",
                        help="a LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) to "
                             "apply to --model")
    parser.add_argument("--merge-adapter", action="store_true", help=merge_help)


def check_adapter_dir(path: str | None, flag: str = "--adapter") -> None:
    """Refuse a missing adapter directory before any model is built."""
    if path is None:
        return
    from ..lora import read_adapter_config

    try:
        read_adapter_config(path)
    except (FileNotFoundError, ValueError) as error:
        raise type(error)(f"{flag} {path}: {error}") from None


def use_adapter(model, path: str | None, merge: bool, flag: str = "--adapter") -> None:
    """Load the adapter at `path` onto `model` (its parameters loaded), merged into them when `merge`."""
    if path is None:
        if merge:
            raise ValueError(f"--merge-adapter needs {flag} DIR (the adapter to merge).")
        return
    try:
        model.load_adapter(path)
    except ValueError as error:
        raise ValueError(f"{flag} {path}: {error}") from None
    if merge:
        model.merge_adapter()


# ---- serve: several adapters ------------------------------------------------------------------------------------
def add_lora_modules_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=DIR",
                        help="serve several LoRA adapters (PEFT's format) beside the base model, as vLLM's: a "
                             "request's `model` names one (or the base); requests of different adapters share each "
                             "step, the fused experts' adapters included on any --tp/--fsdp/--ep layout and with "
                             "redundant expert slots. Not with --adapter or --speculative mtp")
    parser.add_argument("--max-loras", type=int, default=None, metavar="K",
                        help="the most adapters --lora-modules may name (default: any number); every named adapter "
                             "is held on the device, and any mix of them runs in one step")


def lora_modules(args, served_name: str | None = None) -> dict[str, str] | None:
    """--lora-modules' NAME=DIR pairs -> {name: dir} (None without the flag); ValueError for a malformed pair, a
    repeated name, a clash with --adapter or the served model's name, or more than --max-loras."""
    if args.lora_modules is None:
        if args.max_loras is not None:
            raise ValueError("--max-loras needs --lora-modules NAME=DIR [NAME=DIR ...].")
        return None
    if args.adapter is not None:
        raise ValueError("--lora-modules and --adapter: one or the other (--adapter serves one adapter as the model).")
    modules = {}
    for pair in args.lora_modules:
        name, _, path = pair.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {pair!r}: expected NAME=DIR.")
        if name in modules or name == served_name:
            what = "given twice" if name in modules else "the served model's name"
            raise ValueError(f"--lora-modules: {name!r} is {what}.")
        check_adapter_dir(path, f"--lora-modules {name}=")
        modules[name] = path
    if args.max_loras is not None and not 1 <= len(modules) <= args.max_loras:
        raise ValueError(f"--lora-modules names {len(modules)} adapters; --max-loras {args.max_loras} allows at most "
                         f"{args.max_loras} (>= 1).")
    return modules


def use_adapters(model, modules: dict[str, str] | None) -> None:
    """Load --lora-modules' adapters onto `model` as one set (`model.load_adapters`)."""
    if modules:
        try:
            model.load_adapters(modules)
        except ValueError as error:
            raise ValueError(f"--lora-modules: {error}") from None
