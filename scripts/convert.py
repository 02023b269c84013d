"""Convert between Hugging Face safetensors and orbax parameter checkpoints (same job as `moe-jax convert`).

    python scripts/convert.py --from hf --to orbax Qwen3-30B-A3B/ qwen3-orbax/ --fsdp 8 --ep 8
    python scripts/convert.py --from orbax --to hf qwen3-orbax/ qwen3-hf/ --tp 2 --fsdp 4 --ep 4

On a CPU-only machine the layout's virtual CPU devices are requested before JAX starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_jax.cli import main as moe_jax_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return moe_jax_main(["convert", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
