"""What a `moe-jax train` run records of its settings, and what later commands read back.

    settings = run_settings(args, seq_len)           # the schedule and the data settings, JSON-ready
    TrainCheckpoints(..., run=settings)              # kept in every train-state checkpoint's record
    write_run_settings(export_dir, settings)         # moe_jax_training.json beside an --export-hf checkpoint
    read_run_settings(checkpoint_dir)                # None for a checkpoint no training run wrote

A resume compares the schedule's length with the checkpoint's (`schedule_change_note`), and `moe-jax eval` takes
the data settings as its defaults (`eval_defaults`), so its perplexity is the training run's eval on the same file.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint_files import TRAINING_SETTINGS_FILE

FORMAT = "moe_jax.training_run/1"
DECAYING = ("cosine", "linear")


def decay_steps(args: argparse.Namespace) -> int:
    """The optimizer updates the schedule decays over: --lr-decay-steps, else --steps."""
    return args.lr_decay_steps or args.steps


def run_settings(args: argparse.Namespace, seq_len: int) -> dict:
    return {
        "format": FORMAT,
        "schedule": {"lr_schedule": args.lr_schedule, "lr": args.lr, "warmup_steps": args.warmup_steps,
                     "min_lr_ratio": args.min_lr_ratio, "decay_steps": decay_steps(args)},
        "data": {"batch_size": args.batch_size, "seq_len": seq_len, "pack": bool(args.pack),
                 "text_column": args.text_column},
    }


def write_run_settings(directory, settings: dict) -> None:
    (Path(directory) / TRAINING_SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def read_run_settings(directory) -> dict | None:
    path = Path(directory) / TRAINING_SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}.") from None
    return settings if isinstance(settings, dict) and settings.get("format") == FORMAT else None


def schedule_change_note(args: argparse.Namespace, saved: dict | None, start: int) -> str | None:
    """A line for a resume whose decaying schedule's length is not the one the checkpoint trained with (a larger
    --steps restarts the decay over the new total), or whose checkpoint does not say; None when nothing changed."""
    if args.lr_schedule not in DECAYING:
        return None
    length = decay_steps(args)
    before = (saved or {}).get("schedule", {}).get("decay_steps")
    if before is None:
        return (f"note: the checkpoint does not record its schedule's length; this run's {args.lr_schedule} "
                f"schedule decays over {length} updates (--lr-decay-steps N pins the length).")
    if before == length:
        return None
    from ..training.schedules import learning_rate_schedule

    options = dict(warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio)
    old, new = (float(learning_rate_schedule(args.lr_schedule, args.lr, steps, **options)(start))
                for steps in (before, length))
    return (f"note: the {args.lr_schedule} schedule now decays over {length} updates, not the {before} the "
            f"checkpoint trained with: update {start + 1} runs at {new:.3g} instead of {old:.3g}; pass "
            f"--lr-decay-steps {before} to keep the checkpoint's schedule.")


@dataclass(frozen=True)
class EvalDefaults:
    batch_size: int
    seq_len: int | None      # None: the .npy's row length (or 512 for text, without a record)
    pack: bool
    text_column: str
    recorded: tuple[str, ...]   # the settings taken from the training run's record


def eval_defaults(args: argparse.Namespace, settings: dict | None, *, text: bool) -> EvalDefaults:
    """`moe-jax eval`'s data settings: each flag given, else the training run's (`settings["data"]`), else the
    command's own default. A .npy's rows keep their length unless --seq-len cuts them (`text` False)."""
    recorded = (settings or {}).get("data", {})
    taken = []

    def pick(flag: str, name: str, default, applies: bool = True):
        given = getattr(args, flag)
        if given is not None:
            return given
        if applies and recorded.get(name) is not None:
            taken.append(name.replace("_", " "))
            return recorded[name]
        return default

    batch_size = pick("batch_size", "batch_size", 8)
    seq_len = pick("seq_len", "seq_len", 512 if text else None, applies=text)
    pack = pick("pack", "pack", False, applies=text)
    text_column = pick("text_column", "text_column", "text", applies=text)
    return EvalDefaults(batch_size, seq_len, pack, text_column, tuple(taken))


def learning_rate_schedules(args: argparse.Namespace):
    """The learning-rate schedules of the dense parameters and, with --expert-lr, of the experts (errors here are
    the flags' own, raised before anything starts)."""
    from ..training.schedules import learning_rate_schedule

    options = dict(warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio)
    if args.lr_schedule == "constant" and not args.warmup_steps and not args.min_lr_ratio:
        # Plain rates: the optimizer state keeps the structure it had before schedules existed, so train states
        # saved then still resume.
        return args.lr, args.expert_lr
    total = decay_steps(args)
    try:
        dense = learning_rate_schedule(args.lr_schedule, args.lr, total, **options)
        experts = (None if args.expert_lr is None else
                   learning_rate_schedule(args.lr_schedule, args.expert_lr, total, **options))
    except ValueError as error:
        raise ValueError(f"--lr-schedule {args.lr_schedule} --warmup-steps {args.warmup_steps} --min-lr-ratio "
                         f"{args.min_lr_ratio}: {error}") from None
    return dense, experts
