"""Train an HF MoE checkpoint or the built-in tiny model (same job as `moe-jax train`).

    python scripts/train.py --steps 100                                      # tiny Qwen3-MoE, synthetic data
    python scripts/train.py --model CKPT/ --data tokens.npy --fsdp 8 --ep 8 --checkpoint-dir ckpt/ --resume

On a CPU-only machine the layout's virtual CPU devices are requested before JAX starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_jax.train_job import add_arguments, run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="train.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
