"""`moe-jax train` and `moe-jax generate` under `moe-jax launch` (2 processes x 4 CPU devices) against the same
commands in one 8-device process: metrics, the exported checkpoint, the generated text.

    python scripts/checks/check_multiprocess_cli.py [--workdir DIR] [--layout "--fsdp 8 --ep 8"]

Uses the committed tiny Qwen3-MoE with a word-level tokenizer added and a random token file; prints what
matched and how long each run took, and exits 1 on any difference beyond float rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "tests" / "fixtures" / "models" / "qwen3_moe"
GLOO_LINE = re.compile(r"\[Gloo\][^\n]*\n?")
WORDS = ["[UNK]"] + [f"w{i}" for i in range(1, 128)]


def prepare(workdir: Path) -> tuple[Path, Path]:
    """A copy of the fixture checkpoint with a tokenizer, and a token file [32, 16]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    checkpoint = workdir / "qwen3_moe"
    shutil.copytree(CHECKPOINT, checkpoint)
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tokens = workdir / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(1, 128, (32, 16)).astype(np.int32))
    return checkpoint, tokens


def job_command(command: list[str], processes: int) -> tuple[list[str], dict]:
    """A `moe-jax` command as one 8-device process, or as `processes` processes under `moe-jax launch` (8 CPU
    devices in all): (argv, environment)."""
    environ = dict(os.environ, JAX_PLATFORMS="cpu")
    if processes == 1:
        environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        return [sys.executable, "-m", "moe_jax.cli", *command], environ
    return [sys.executable, "-m", "moe_jax.cli", "launch", "--nproc", str(processes), "--devices-per-process",
            str(8 // processes), "--", sys.executable, "-m", "moe_jax.cli", *command], environ


def run(command: list[str], processes: int) -> tuple[subprocess.CompletedProcess, float]:
    """Runs `job_command`; exits with its output when it fails. (result, seconds)."""
    full, environ = job_command(command, processes)
    began = time.perf_counter()
    result = subprocess.run(full, cwd=ROOT, env=environ, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if result.returncode != 0:
        sys.exit(f"{shlex.join(full)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result, seconds


def export_difference(ours: Path, theirs: Path) -> tuple[bool, float]:
    """(byte-identical, max |difference| over every tensor) of two exported checkpoints."""
    from safetensors.numpy import load_file

    names = sorted(p.name for p in theirs.iterdir())
    if sorted(p.name for p in ours.iterdir()) != names:
        return False, float("inf")
    identical = all((ours / n).read_bytes() == (theirs / n).read_bytes() for n in names)
    worst = 0.0
    for name in names:
        if name.endswith(".safetensors"):
            a, b = load_file(ours / name), load_file(theirs / name)
            worst = max([worst] + [float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a])
    return identical, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layout", default="--fsdp 8 --ep 8", help="layout flags of every run")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="moe_jax_multiprocess_cli_"))
    checkpoint, tokens = prepare(workdir)
    layout = shlex.split(args.layout)
    failures = []

    results = {}
    for processes in (1, 2):
        out = workdir / f"{processes}proc"
        train = ["train", "--model", str(checkpoint), "--data", str(tokens), "--batch-size", "8", "--steps", "4",
                 "--metrics-jsonl", str(out / "metrics.jsonl"), "--export-hf", str(out / "export"),
                 "--checkpoint-dir", str(out / "state"), "--save-every", "2", "--no-progress", *layout]
        out.mkdir()
        _, train_s = run(train, processes)
        resumed = [*train[:train.index("--steps") + 1], "6", *train[train.index("--steps") + 2:]]
        resumed = [a for a in resumed if a not in ("--export-hf", str(out / "export"))] + ["--resume"]
        _, resume_s = run(resumed, processes)
        generated, generate_s = run(["generate", "--model", str(checkpoint), "--prompt", "w5 w9 w3 w17",
                                     "--max-new-tokens", "8", *layout], processes)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        # Process 0's lines, without the connection lines gloo prints on stdout (they can land inside the
        # streamed line: the launcher relays whole lines).
        text = GLOO_LINE.sub("", "\n".join(line.removeprefix("[0] ") for line in generated.stdout.splitlines()
                                           if not line.startswith("[1] "))).strip()
        results[processes] = dict(records=records, text=text, seconds=(train_s, resume_s, generate_s), out=out)
        print(f"{processes} process(es): train {train_s:.1f} s, resume {resume_s:.1f} s, generate {generate_s:.1f} s")

    one, two = results[1], results[2]
    steps = [r["step"] for r in two["records"]]
    if steps != [1, 2, 3, 4, 5, 6]:
        failures.append(f"the 2-process metrics JSONL holds steps {steps}, not 1-6 once each")
    losses = np.asarray([[r["loss"] for r in run_["records"]] for run_ in (one, two)])
    loss_error = float(np.max(np.abs(losses[0] - losses[1]) / np.abs(losses[0])))
    print(f"losses (1 process): {np.round(losses[0], 6).tolist()}")
    print(f"losses (2 processes): {np.round(losses[1], 6).tolist()}; worst relative difference {loss_error:.1e}")
    if loss_error > 1e-6:
        failures.append(f"losses differ by up to {loss_error:.1e} (relative)")
    identical, worst = export_difference(two["out"] / "export", one["out"] / "export")
    print(f"exports after 4 steps: byte-identical {identical}, max |difference| {worst:.1e}")
    if worst > 1e-6:
        failures.append(f"the exported weights differ by up to {worst:.1e}")
    print(f"generated text equal: {one['text'] == two['text']} ({two['text']!r})")
    if one["text"] != two["text"]:
        failures.append(f"generated text differs: {one['text']} != {two['text']}")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
