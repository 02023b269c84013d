"""Record Transformers' greedy `generate` on the tiny fixture checkpoints (needs torch + transformers).

    python scripts/make_generation_fixtures.py

Writes `tests/fixtures/generation/<model_type>.npz`: the left-padded prompts, the 20 greedy tokens of
Transformers' `generate` (fp32), and a second run with an EOS id that makes rows stop early. The tests
compare `model.generate` against these on one device and on 8-device layouts without torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.inference.hf_generation import FAMILIES, FIXTURES, hf_generate  # noqa: E402


def main() -> int:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for model_type in sys.argv[1:] or FAMILIES:  # e.g. `python scripts/make_generation_fixtures.py gpt_oss`
        arrays = hf_generate(model_type)
        np.savez(FIXTURES / f"{model_type}.npz", **arrays)
        finished = (arrays["with_eos"][:, 7:] == arrays["eos_token_id"]).any(axis=1)
        print(f"{model_type}: greedy {arrays['greedy'].shape}, with EOS {arrays['with_eos'].shape} "
              f"(rows finished: {finished.tolist()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
