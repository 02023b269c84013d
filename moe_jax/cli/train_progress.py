"""What `moe-jax train` writes as it goes: a progress bar, the metrics JSONL and TensorBoard event files.

    progress = TrainProgress(start, steps, "metrics.jsonl", True, tensorboard="tb/")   # opens (creates) them
    progress(record)                                   # one per optimizer step
    progress.close()                                   # the run finished
    kept, removed = progress.close(failed=True)        # it failed: what holds records stays, the rest goes

They are opened only after every check that can be made before a step runs, so a refused request writes nothing.
A run that fails later removes what it created and holds nothing (an empty JSONL, event files without a scalar,
the directory made for them) and keeps the rest, saying which (`close_after_failure`). A resume first drops
the records of steps after its checkpoint (`forget_records_after`), so each step is in the JSONL once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class RankBalance:
    """The busiest ep rank's share (max / mean of `ep_rank_load`) per sparse layer over the steps after the first
    re-placement (`TrainLoop(rebalance_every=)`): `summary()` is one clause for the run's last line, or None."""

    THRESHOLD = 1.3

    def __init__(self):
        self.placed, self.step_layers, self.over, self.worst = False, 0, 0, 0.0

    def __call__(self, record: dict) -> None:
        if self.placed and "ep_rank_load" in record:
            for ranks in record["ep_rank_load"]:
                mean = sum(ranks) / len(ranks)
                share = max(ranks) / mean if mean else 1.0
                self.step_layers += 1
                self.over += share > self.THRESHOLD
                self.worst = max(self.worst, share)
        self.placed = self.placed or bool(record.get("rebalanced"))

    def summary(self) -> str | None:
        if not self.step_layers:
            return None
        return (f"busiest ep rank after the first re-placement: worst {self.worst:.2f}x the mean, "
                f"{self.over / self.step_layers:.0%} of step-layers over {self.THRESHOLD}x")


class TrainProgress:
    """A tqdm bar with loss, tokens/s and capacity, plus the JSONL and TensorBoard writers. Each record gains
    tokens/s per device and model TFLOP/s per device (and MFU with a peak); a resumed run's first record (`start`
    > 0) gains "resumed": true, where `scripts/plot_run.py` marks the resume."""

    def __init__(self, start: int, total: int, jsonl: str | None, enabled: bool, *, devices: int = 1,
                 flops_per_token: float | None = None, peak_tflops: float | None = None,
                 tensorboard: str | None = None, packing_efficiency: float | None = None,
                 sparse_layers: list[int] | None = None):
        from tqdm.auto import tqdm

        self.jsonl_path = None if jsonl is None else Path(jsonl)
        self.jsonl_created = self.jsonl_path is not None and not self.jsonl_path.exists()
        self.tensorboard_dir = None if tensorboard is None else Path(tensorboard)
        self.tensorboard_dir_created = self.tensorboard_dir is not None and not self.tensorboard_dir.exists()
        self.tensorboard_before = _files(self.tensorboard_dir)
        self.records = 0   # written this run
        self.start = start
        self.bar = tqdm(total=total, initial=start, unit="step", disable=not enabled, file=sys.stderr)
        self.jsonl = open(jsonl, "a", encoding="utf-8") if jsonl else None  # noqa: SIM115 (closed in close())
        self.devices, self.flops_per_token, self.peak_tflops = devices, flops_per_token, peak_tflops
        self.packing_efficiency = packing_efficiency
        self.tensorboard = None
        if tensorboard is not None:
            from ..training.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(tensorboard, sparse_layers)
        self.last: dict | None = None
        self.balance = RankBalance()

    def __call__(self, record: dict) -> None:
        self.balance(record)
        if self.records == 0 and self.start > 0:
            record["resumed"] = True
        if self.packing_efficiency is not None:
            record["packing_efficiency"] = self.packing_efficiency
        per_device = record["tokens_per_s"] / self.devices
        record["tokens_per_s_per_device"] = per_device
        if self.flops_per_token is not None:
            record["model_tflops_per_s_per_device"] = per_device * self.flops_per_token / 1e12
            if self.peak_tflops:
                record["mfu"] = record["model_tflops_per_s_per_device"] / self.peak_tflops
        if self.tensorboard is not None:
            self.tensorboard(record)
        self.last = record
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        self.records += 1
        extra = {} if "eval_loss" not in record else {"eval_loss": f"{record['eval_loss']:.4f}"}
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                             capacity=record["capacity"], replays=record["replays"], refresh=False, **extra)
        self.bar.update(1)

    def warn(self, line: str) -> None:
        """One `warning:` line on stderr, above the bar (one process of a multi-process job says it)."""
        import jax
        from tqdm.auto import tqdm

        if jax.process_index() == 0:
            tqdm.write(f"warning: {line}", file=sys.stderr)

    def close(self, *, failed: bool = False) -> tuple[list[str], list[str]]:
        """Close the writers. After a failure, remove what this run created and holds nothing. Returns (what was
        kept, what was removed), each described for the user (both empty after a success)."""
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        kept, removed = [], []
        if not failed:
            return kept, removed
        if self.jsonl_path is not None:
            if self.jsonl_created and self.jsonl_path.stat().st_size == 0:
                self.jsonl_path.unlink()
                removed.append(f"the empty {self.jsonl_path}")
            else:
                kept.append(f"{self.jsonl_path} ({self.records} record(s) from this run)")
        if self.tensorboard_dir is not None:
            created = sorted(_files(self.tensorboard_dir) - self.tensorboard_before)
            if self.records:
                kept.append(f"{self.tensorboard_dir} ({self.records} step(s) of scalars from this run)")
            elif created or self.tensorboard_dir_created:
                for path in created:   # event files holding no scalar: only the file's version header
                    path.unlink()
                if self.tensorboard_dir_created and not any(self.tensorboard_dir.iterdir()):
                    self.tensorboard_dir.rmdir()
                removed.append(f"{self.tensorboard_dir}'s event file without scalars")
        return kept, removed


def stopped_early_line(kept: list[str], removed: list[str]) -> str | None:
    """"the run stopped early: kept ...; removed ..." (None when there is neither)."""
    parts = ([f"kept {', '.join(kept)}"] if kept else []) + ([f"removed {', '.join(removed)}"] if removed else [])
    return f"the run stopped early: {'; '.join(parts)}." if parts else None


def _files(directory: Path | None) -> set[Path]:
    return set() if directory is None or not directory.is_dir() else {p for p in directory.rglob("*") if p.is_file()}


def _after(line: str, step: int) -> bool:
    """Whether a JSONL line is the record of a step after `step`, or the torn last line of a killed write."""
    try:
        record = json.loads(line)
    except ValueError:
        return not line.endswith("\n")
    return isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step


def forget_records_after(path: Path, step: int) -> None:
    """Before a resume from `step`: drops the records of later steps from the metrics JSONL. The interrupted
    run trained past its last checkpoint; the resumed run trains those steps again and writes their records,
    so each step is in the file once, from the run the state continues."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if not _after(line, step)]
    if kept and not kept[-1].endswith("\n"):
        kept[-1] += "\n"  # the next record starts on a line of its own
    if kept != lines:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(kept), encoding="utf-8")
        temporary.replace(path)  # atomic: a kill now leaves the old file or the new one


def close_after_failure(progress: TrainProgress, checkpoints, start: int) -> None:
    """The writers closed after the loop failed, what holds nothing removed, and one line on stderr saying what
    the run kept (its records, event files, checkpoints) and removed; the error itself follows."""
    kept, removed = progress.close(failed=True)
    if checkpoints is not None:
        try:
            checkpoints.close()
            latest = checkpoints.latest_step()
        except Exception:  # noqa: BLE001 (the loop's failure is the one to report)
            latest = None
        if latest is not None and latest > start:
            kept.append(f"train-state checkpoints up to step {latest} in {checkpoints.directory}")
    if (line := stopped_early_line(kept, removed)) is not None:
        print(line, file=sys.stderr, flush=True)
