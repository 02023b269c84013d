"""Train a bench checkpoint to copy what it has seen, so that code-edit answers copy spans of their prompt.

    python scripts/bench/copy_model.py CHECKPOINT OUT [--steps 150] [--segment 48]

A random-weight model's greedy output does not follow its prompt, so n-gram (prompt lookup) speculation on it
measures the model's loops, not what a code model gives it. This trains CHECKPOINT with `moe-jax train` (AdamW,
cosine schedule) on rows that are a random segment of `--segment` token ids followed by the same segment: the
model learns induction (a token is followed by what followed it last time), which is what a code model does when
it rewrites a file. OUT is an HF checkpoint with CHECKPOINT's tokenizer files; the copy accuracy on held-out rows
(greedy next token over each row's second half) is printed.

What learns quickly on a 2-core CPU is small: bench_vs_reference's `copy` size (its default with a vocabulary of
512 and 2 layers) copies after about 100 steps (accuracy 1.0 at 150, about a minute). Its default size (a
vocabulary of 4096, 4 layers) stays at chance for hundreds of steps here.
"""

from __future__ import annotations

import argparse
import json
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

from serve_workloads import FIRST_ID  # noqa: E402

BATCH = 32
LEARNING_RATE = 3e-3


def copy_rows(count: int, segment: int, vocab: int, seed: int) -> np.ndarray:
    """[count, 2 x segment] int32: a random segment of ids, then the same segment again."""
    first = np.random.default_rng(seed).integers(FIRST_ID, vocab, (count, segment))
    return np.concatenate([first, first], axis=1).astype(np.int32)


def copy_accuracy(checkpoint: Path, rows: np.ndarray) -> float:
    """Greedy next-token accuracy over each row's second half (every id there is predictable from the first)."""
    import jax

    from moe_jax import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, devices=jax.devices()[:1], progress=False)
    predicted = np.asarray(model.forward(rows).logits).argmax(-1)
    half = rows.shape[1] // 2
    return float((predicted[:, half:-1] == rows[:, half + 1:]).mean())


def train(checkpoint: Path, out: Path, steps: int, segment: int = 48, seed: int = 0) -> float:
    """`moe-jax train` on copy rows -> OUT (tokenizer files copied); returns the held-out copy accuracy."""
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "copy.npy"
        np.save(data, copy_rows(BATCH * steps, segment, vocab, seed))
        command = [sys.executable, "-m", "moe_jax.cli", "train", "--model", str(checkpoint), "--data", str(data),
                   "--steps", str(steps), "--batch-size", str(BATCH), "--lr", str(LEARNING_RATE),
                   "--lr-schedule", "cosine", "--warmup-steps", str(max(steps // 5, 1)), "--min-lr-ratio", "0.0",
                   "--grad-clip", "1.0", "--export-hf", str(out), "--no-progress"]
        subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (checkpoint / name).exists() and not (out / name).exists():
            shutil.copy(checkpoint / name, out / name)
    return copy_accuracy(out, copy_rows(8, segment, vocab, seed + 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--segment", type=int, default=48, help="ids per segment; rows are twice as long")
    args = parser.parse_args(argv)
    accuracy = train(args.checkpoint, args.out, args.steps, args.segment)
    print(f"copy accuracy over held-out rows' second halves: {accuracy:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
