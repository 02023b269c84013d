"""Train bench_serve's random checkpoint to copy, so that code-edit answers copy spans of their prompt.

    python scripts/bench/copy_model.py CHECKPOINT OUT [--steps 300] [--seq-len 256]

A random-weight model's greedy output does not follow its prompt, so n-gram (prompt lookup) speculation on it
measures the model's loops, not what a code model gives it. This trains the checkpoint with `moe-jax train` on
rows that are code-edit-like files followed by a copy of them (serve_workloads.py's structure: functions sharing
one skeleton, identifiers drawn per function, a fresh skeleton per row): the model learns to continue a span it
has seen (induction), which is what a code model does when it rewrites a file. OUT is an HF checkpoint with the
tokenizer files of CHECKPOINT; the copy accuracy on held-out rows (greedy next token over each row's copy half) is
printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_workloads import FIRST_ID, SKELETON  # noqa: E402

SLOTS = (1, 5, 11, 17)   # the skeleton's identifier positions, as serve_workloads draws them


def copy_rows(count: int, seq_len: int, vocab: int, seed: int) -> np.ndarray:
    """[count, seq_len] int32: an instruction (8-16 ids), a file of skeleton functions, then the file again."""
    rng = np.random.default_rng(seed)
    rows = np.empty((count, seq_len), np.int32)
    for row in rows:
        instruction = rng.integers(FIRST_ID, vocab, int(rng.integers(8, 17)))
        skeleton = rng.integers(FIRST_ID, vocab, SKELETON)
        size = (seq_len - len(instruction)) // 2 + 1
        code = []
        while len(code) < size:
            function = skeleton.copy()
            function[list(SLOTS)] = rng.integers(FIRST_ID, vocab, len(SLOTS))
            code.extend(function.tolist())
        code = code[:size]
        row[:] = np.concatenate([instruction, code, code])[:seq_len]
    return rows


def copy_accuracy(checkpoint: Path, rows: np.ndarray) -> float:
    """Greedy next-token accuracy over the second copy of each row's file (ids predicted from the first)."""
    import jax

    from moe_jax import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, devices=jax.devices()[:1], progress=False)
    predicted = np.asarray(model.forward(rows).logits).argmax(-1)
    half = rows.shape[1] // 2 + 8
    return float((predicted[:, half:-1] == rows[:, half + 1:]).mean())


def train(checkpoint: Path, out: Path, steps: int, seq_len: int, seed: int = 0) -> float:
    """`moe-jax train` on copy rows -> OUT (tokenizer files copied); returns the held-out copy accuracy."""
    import json

    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "copy.npy"
        np.save(data, copy_rows(16 * steps, seq_len, vocab, seed))
        command = [sys.executable, "-m", "moe_jax.cli", "train", "--model", str(checkpoint), "--data", str(data),
                   "--steps", str(steps), "--batch-size", "16", "--lr", "2e-3", "--lr-schedule", "cosine",
                   "--warmup-steps", str(max(steps // 20, 1)), "--min-lr-ratio", "0.1", "--export-hf", str(out),
                   "--no-progress"]
        subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (checkpoint / name).exists() and not (out / name).exists():
            shutil.copy(checkpoint / name, out / name)
    return copy_accuracy(out, copy_rows(8, seq_len, vocab, seed + 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)
    accuracy = train(args.checkpoint, args.out, args.steps, args.seq_len)
    print(f"copy accuracy over held-out files' second halves: {accuracy:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
