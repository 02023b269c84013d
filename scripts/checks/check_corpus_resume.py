"""SIGKILL mid-run, then `--resume`, on a packed text corpus: one process x 8 devices and 2 processes x 4 devices
(`moe-jax launch`, each process reading and tokenising only its share of the corpus). The resumed run's metrics must
equal an uninterrupted run's, step for step (loss, data position, lr, router load, the eval loss every 5 steps on a
held-out JSON Lines corpus read in shares too), across an epoch boundary.

    python scripts/checks/check_corpus_resume.py [--workdir DIR] [--layout "--fsdp 8 --ep 8"] [--steps 14]

Uses the committed tiny Qwen3-MoE with a byte tokenizer and a Parquet corpus of short documents written here; prints
what matched and exits 1 on any difference. The kill lands once step `--kill-after` has been recorded and a
checkpoint (--save-every 4) is complete: every process of the job and the launcher are killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_multiprocess_cli import job_command, run  # noqa: E402 - the same job as one process or under launch

CHECKPOINT = ROOT / "tests" / "fixtures" / "models" / "qwen3_moe"
WORDS = ("moe", "jax", "expert", "token", "router", "layer", "page", "slot")
COMPARED = ("step", "loss", "ce_loss", "aux_loss", "grad_norm", "data_position", "lr", "expert_load", "tokens",
            "eval_loss")


def prepare(workdir: Path, documents: int) -> tuple[Path, Path]:
    import pyarrow
    import pyarrow.parquet as parquet

    from moe_jax.tokenization import write_byte_tokenizer

    checkpoint = workdir / "qwen3_moe"
    shutil.copytree(CHECKPOINT, checkpoint)
    write_byte_tokenizer(checkpoint)
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(2, 14)))) for _ in range(documents)]
    corpus = workdir / "corpus.parquet"
    parquet.write_table(pyarrow.table({"text": texts}), corpus, row_group_size=16)
    held_out = [" ".join(rng.choice(WORDS, int(rng.integers(2, 14)))) for _ in range(24)]
    (workdir / "eval.jsonl").write_text("\n".join(json.dumps({"text": text}) for text in held_out))
    return checkpoint, corpus, texts


def epoch_rows(texts: list[str], shares: int, seq_len: int) -> list[int]:
    """Packed rows per epoch of each share (the byte tokenizer: a token per UTF-8 byte)."""
    bounds = [index * len(texts) // shares for index in range(shares + 1)]
    return [-(-sum(len(t.encode()) for t in texts[lo:hi]) // seq_len) for lo, hi in zip(bounds, bounds[1:])]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in parents.get(parent, [])]
        found += children
        frontier = children
    return found


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def saved_steps(directory: Path) -> list[int]:
    """Steps with a complete checkpoint (orbax renames a save's temporary directory to the step when done)."""
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def kill_after(arguments: list[str], processes: int, metrics: Path, step: int, states: Path,
               timeout_s: float = 600) -> tuple[int, list[int]]:
    """Starts the run, SIGKILLs it (launcher and every process) once `step` is in the metrics and a checkpoint
    is complete; (the last step recorded before the kill, the complete checkpoints)."""
    full, environ = job_command(arguments, processes)
    process = subprocess.Popen(full, cwd=ROOT, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not (any(r["step"] >= step for r in records(metrics)) and saved_steps(states)):
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{shlex.join(full)} ended or stalled before step {step}")
        time.sleep(0.05)
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    return max(r["step"] for r in records(metrics)), saved_steps(states)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layout", default="--fsdp 8 --ep 8", help="layout flags of every run")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--kill-after", type=int, default=6)
    parser.add_argument("--documents", type=int, default=60,
                        help="Parquet records (default 60: the run crosses into a second epoch)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="moe_jax_corpus_resume_"))
    checkpoint, corpus, texts = prepare(workdir, args.documents)
    failures = []
    for processes in (1, 2):
        out = workdir / f"{processes}proc"
        out.mkdir()
        base = ["train", "--model", str(checkpoint), "--data", str(corpus), "--text-column", "text", "--pack",
                "--seq-len", "32", "--batch-size", "8", "--steps", str(args.steps), "--lr", "1e-2",
                "--lr-schedule", "cosine", "--warmup-steps", "2", "--eval-data", str(workdir / "eval.jsonl"),
                "--eval-every", "5", "--no-progress",
                *shlex.split(args.layout)]
        _, full_s = run([*base, "--metrics-jsonl", str(out / "full.jsonl")], processes)
        checkpointing = ["--checkpoint-dir", str(out / "state"), "--save-every", "4"]
        killed = out / "killed.jsonl"
        last, saved = kill_after([*base, *checkpointing, "--metrics-jsonl", str(killed)], processes, killed,
                                 args.kill_after, out / "state")
        _, resume_s = run([*base, *checkpointing, "--resume", "--metrics-jsonl", str(killed)], processes)
        full, resumed = records(out / "full.jsonl"), records(killed)
        steps = [r["step"] for r in resumed]
        same = [all(a.get(k) == b.get(k) for k in COMPARED) for a, b in zip(full, resumed)]
        print(f"{processes} process(es): uninterrupted {full_s:.1f} s; killed after step {last} (complete "
              f"checkpoints: steps {saved}); resumed {resume_s:.1f} s; steps {steps[0]}-{steps[-1]}; "
              f"{sum(same)}/{len(full)} records equal ({', '.join(COMPARED)})")
        rows = epoch_rows(texts, processes, 32)
        print(f"  an epoch is {rows} packed rows per share; the run reads {args.steps * 8 // processes} per share")
        expected = sum(len(text.encode()) for text in texts) / (sum(rows) * 32)   # every share's rows, once
        reported = full[0].get("packing_efficiency")
        print(f"  packing efficiency: reported {reported}, the whole corpus's {expected:.6f}")
        if reported is None or abs(reported - expected) > 1e-6:
            failures.append(f"{processes} process(es): packing efficiency {reported}, not the corpus's {expected}")
        if min(rows) >= args.steps * 8 // processes:
            failures.append(f"{processes} process(es): the run does not cross an epoch boundary")
        if steps != list(range(1, args.steps + 1)):
            failures.append(f"{processes} process(es): the resumed JSONL holds steps {steps}")
        if not all(same) or len(resumed) != len(full):
            first = next((i for i, ok in enumerate(same) if not ok), len(same))
            failures.append(f"{processes} process(es): records differ from step {first + 1}")
        if last >= args.steps:
            failures.append(f"{processes} process(es): the run finished before the kill")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
