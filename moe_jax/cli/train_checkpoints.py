"""`moe-jax train`'s checkpoints and exports, so that one command line serves the first launch and every requeue:
`--resume` starts at step 0 where --checkpoint-dir holds no checkpoint yet and continues from the latest complete
one otherwise; what an interrupted save left is removed with a note; the signals of a preemption stop the run at a
step boundary with a checkpoint (`training.preemption`); an --export-hf directory this job wrote before is replaced
at the end by the complete new export, while another non-empty directory is still refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..checkpoint_files import TRAINING_SETTINGS_FILE
from .run_settings import schedule_change_note, write_run_settings

# Where orbax writes a checkpoint before renaming it into place: what a killed save leaves.
HALF_WRITTEN = "*.orbax-checkpoint-tmp*"


def preemption_from_flags(args):
    """The run's `Preemption` (its --preemption-signals), or None for 'none'."""
    from ..training.preemption import Preemption

    names = [name for name in args.preemption_signals.split(",") if name.strip()]
    if not names or [name.strip().lower() for name in names] == ["none"]:
        return None
    return Preemption(names)


def check_preemption_flags(args) -> None:
    from ..training.preemption import signal_numbers

    if args.preemption_signals.strip().lower() != "none":
        try:
            signal_numbers([name for name in args.preemption_signals.split(",") if name.strip()])
        except ValueError as error:
            raise ValueError(f"--preemption-signals {args.preemption_signals}: {error}") from None


def _job(args) -> dict:
    """What identifies this job in its exports: its checkpoint directory."""
    return {"checkpoint_dir": str(Path(args.checkpoint_dir).resolve()) if args.checkpoint_dir else None}


def _written_by_this_job(args, path: Path) -> bool:
    try:
        settings = json.loads((path / TRAINING_SETTINGS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return args.checkpoint_dir is not None and settings.get("job") == _job(args)


def check_export_dir(args, path: str | None, flag: str) -> None:
    """A new or empty directory, or (with --resume) the export this job wrote before, replaced at the end."""
    if path is None or not Path(path).exists() or not any(Path(path).iterdir()):
        return
    if flag == "--export-hf" and args.resume and _written_by_this_job(args, Path(path)):
        print(f"{flag} {path}: this job's earlier export; the new one replaces it when it is complete")
        return
    raise FileExistsError(f"{flag} {path} exists and is not empty (not an export of this job's --checkpoint-dir); "
                          "pass a new directory.")


def open_checkpoints(args, model, train_step, settings):
    """(the checkpoint manager or None, the record of the checkpoint to resume or None: a fresh start)."""
    from ..training.checkpoints import TrainCheckpoints

    if args.checkpoint_dir is None:
        return None, None
    _remove_half_written(Path(args.checkpoint_dir))
    checkpoints = TrainCheckpoints(args.checkpoint_dir, model, train_step, save_every=args.save_every,
                                   keep=args.keep, run=settings)
    latest = checkpoints.latest_step()
    if latest is not None and not args.resume:
        raise FileExistsError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (latest step "
                              f"{latest}); pass --resume to continue from it, or a new directory.")
    if not args.resume:
        return checkpoints, None
    if latest is None:
        print(f"--resume: {args.checkpoint_dir} holds no checkpoint yet; starting at step 0")
        return checkpoints, None
    saved_record = checkpoints.record(latest)
    checkpoints.check_compatible(saved_record)
    return checkpoints, saved_record


def _remove_half_written(directory: Path) -> None:
    import jax

    if jax.process_index() != 0 or not directory.is_dir():
        return
    for partial in sorted(directory.glob(HALF_WRITTEN)):
        shutil.rmtree(partial, ignore_errors=True)
        print(f"removed {partial.name} from {directory}: a save that did not finish (the checkpoints before it "
              "are complete)")


def starting_state(args, model, train_step, checkpoints, saved_record, model_dir):
    """(train state, capacity state): the resumed checkpoint's (`saved_record` given), or fresh from the weights or a
    seed."""
    from ..pretrained import load_weights

    if saved_record is not None and train_step.trainable.everything:
        state, capacity_state = checkpoints.restore()
        print(f"resumed from step {int(state.step)} of {args.checkpoint_dir}")
        if (note := schedule_change_note(args, saved_record.get("run"), int(state.step))) is not None:
            print(note)
        return state, capacity_state
    if model_dir is not None:
        load_weights(model, model_dir, progress=not args.no_progress)
    else:
        model.init_params(args.seed)
    if saved_record is not None:   # a state of part of the model: the frozen rest comes from the weights just loaded
        state, capacity_state = checkpoints.restore()
        print(f"resumed {train_step.trainable.describe()} from step {int(state.step)} of {args.checkpoint_dir}")
        return state, capacity_state
    return train_step.init_state(seed=args.seed), None


def export_hf(args, model, params, model_dir, settings) -> None:
    """The trained weights (an adapter merged into them) as an HF checkpoint, with the --model checkpoint's
    tokenizer files, chat template and generation config (so text commands work on it) and the run's settings
    (`moe-jax eval`'s defaults) and job. An earlier export of this job is replaced only once the new one is
    complete: written beside it, then swapped in by renames."""
    import jax

    from ..checkpoint_files import copy_companion_files
    from converters.multihost import barrier

    target = Path(args.export_hf)
    replacing = target.exists() and any(target.iterdir())
    destination = target.with_name(f".{target.name}.next") if replacing else target
    if replacing and jax.process_index() == 0:
        shutil.rmtree(destination, ignore_errors=True)   # a swap that did not finish
    barrier("moe_jax.export_hf.start")
    model.save_pretrained(destination, params=params, progress=not args.no_progress)
    copied = []
    if jax.process_index() == 0:
        copied = [] if model_dir is None else copy_companion_files(model_dir, destination)
        write_run_settings(destination, {**settings, "job": _job(args)})
        if replacing:
            previous = target.with_name(f".{target.name}.previous")
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(target, previous)
            os.rename(destination, target)
            shutil.rmtree(previous, ignore_errors=True)
    barrier("moe_jax.export_hf.done")
    print(f"{'replaced the earlier export with' if replacing else 'wrote'} the trained weights as an HF checkpoint "
          f"in {args.export_hf}" + (f" (with {model_dir}'s tokenizer)" if copied else ""))
