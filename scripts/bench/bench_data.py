"""Does the input pipeline keep up? Host time per batch of a packed text corpus against the train step's time.

    python scripts/bench/bench_data.py [--documents 20000] [--batch 8] [--seq 128] [--workers 0,2] [--steps 5]

Writes a Parquet corpus of random words (the byte tokenizer's vocabulary), then measures in one run:
- tokenising it through Grain (`moe_jax.training.corpus.tokenize`) with each `--workers` count (worker processes;
  0: in this process), tokens/s;
- packing an epoch into rows (once per epoch) and placing one batch (`Corpus.batch_rows` + `place_batch`: what
  the training loop asks of the host each step), ms;
- one train step of bench_vs_reference's default Qwen3-MoE at --batch x --seq on one device (AdamW), ms;
and prints the ratio host time per batch / step time (below 1: the pipeline keeps up; the loop also overlaps
the next batch's placement with the running step).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MOE_JAX_HUGE_PAGES", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import jax
    import numpy as np
    import pyarrow
    import pyarrow.parquet as parquet
    from bench_vs_reference import CONFIG

    from moe_jax import AutoModelForCausalLM
    from moe_jax.tokenization import write_byte_tokenizer
    from moe_jax.training import make_train_step
    from moe_jax.training.corpus import Corpus, read_texts, tokenize
    from moe_jax.training.data import place_batch
    from moe_jax.training.optimizers import build_optimizer

    words = np.array(["expert", "router", "token", "layer", "mixture", "of", "the", "a", "jax", "page"])
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, int(rng.integers(5, 200)))) for _ in range(args.documents)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        parquet.write_table(pyarrow.table({"text": texts}), tmp / "corpus.parquet")
        write_byte_tokenizer(tmp)
        start = time.perf_counter()
        documents = read_texts(tmp / "corpus.parquet")
        print(f"read {len(documents)} documents in {time.perf_counter() - start:.2f} s", flush=True)
        for workers in (int(w) for w in args.workers.split(",")):
            start = time.perf_counter()
            tokens = tokenize(documents, tmp, workers=workers)
            seconds = time.perf_counter() - start
            count = sum(len(t) for t in tokens)
            print(f"tokenise, {workers} worker process(es): {seconds:.2f} s, {count / seconds:,.0f} tokens/s",
                  flush=True)

    corpus = Corpus(tokens, batch_size=args.batch, seq_len=args.seq, pack=True)
    start = time.perf_counter()
    corpus.epoch_rows(0)
    print(f"pack one epoch ({corpus.num_sequences} rows, efficiency {corpus.packing_efficiency:.3f}): "
          f"{(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)

    model = AutoModelForCausalLM.from_config({**CONFIG, "model_type": "qwen3_moe"}, devices=jax.devices()[:1])
    model.init_params(0)
    step = make_train_step(model, build_optimizer("adamw", 1e-4))
    state = step.init_state()
    sharding = model.batch_sharding()
    start = time.perf_counter()
    for index in range(50):
        batch = place_batch(corpus, index, sharding)
    jax.block_until_ready(batch)
    host_ms = (time.perf_counter() - start) / 50 * 1e3
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for index in range(args.steps):
        state, metrics = step(state, place_batch(corpus, index, sharding))
    jax.block_until_ready(metrics)
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    print(f"host time per batch {host_ms:.3f} ms; train step {step_ms:.1f} ms ({args.batch} x {args.seq}); "
          f"ratio {host_ms / step_ms:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
