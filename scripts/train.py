"""Train an HF MoE checkpoint or the built-in tiny model (same job as `moe-jax train`).

    python scripts/train.py --steps 100                                      # tiny Qwen3-MoE, synthetic data
    python scripts/train.py --model CKPT/ --data tokens.npy --fsdp 8 --ep 8 --checkpoint-dir ckpt/ --resume

On a CPU-only machine the layout's virtual CPU devices are requested before JAX starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_jax.cli import main as moe_jax_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return moe_jax_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
