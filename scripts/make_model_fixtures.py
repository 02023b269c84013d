"""Record tiny random HF checkpoints and their PyTorch logits as test fixtures (needs torch + transformers).

    pip install torch==2.13.0 transformers==5.23.0
    python scripts/make_model_fixtures.py

Writes `tests/fixtures/models/<model_type>/`: the checkpoint as transformers saves it (safetensors +
config.json), `reference.npz` (input_ids, attention_mask with left padding, logits, aux_loss) and
`reference_low_precision.npz` (PyTorch's logits with that checkpoint loaded in bf16 and in fp16, the bar for
moe_jax's low-precision runs). The default test run compares moe_jax against these without torch;
`-m reference` tests recompute live.

    python scripts/make_model_fixtures.py --low-precision-only [FAMILY ...]

writes only `reference_low_precision.npz`, from the committed checkpoints (which stay as they are).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.models.hf_reference import (  # noqa: E402
    TINY_DEEPSEEK_V3,
    TINY_GPT_OSS,
    TINY_LLAMA4,
    TINY_MIXTRAL,
    TINY_OLMOE,
    TINY_QWEN2_MOE,
    TINY_QWEN3_MOE,
    fixture_arrays,
    low_precision_arrays,
    perturb_vector_params,
    tiny_hf_model,
)

FAMILIES = {"qwen3_moe": TINY_QWEN3_MOE, "qwen2_moe": TINY_QWEN2_MOE, "olmoe": TINY_OLMOE, "mixtral": TINY_MIXTRAL,
            "gpt_oss": TINY_GPT_OSS, "deepseek_v3": TINY_DEEPSEEK_V3,
            "llama4_text": TINY_LLAMA4}
FIXTURES = ROOT / "tests" / "fixtures" / "models"


def main() -> int:
    arguments = sys.argv[1:]
    low_precision_only = "--low-precision-only" in arguments
    only = [name for name in arguments if name != "--low-precision-only"] or list(FAMILIES)
    if low_precision_only:
        for model_type in only:
            np.savez(FIXTURES / model_type / "reference_low_precision.npz",
                     **low_precision_arrays(FIXTURES / model_type))
            print(f"{model_type}: reference_low_precision.npz")
        return 0
    for model_type, config in ((name, FAMILIES[name]) for name in only):
        model = tiny_hf_model(model_type, config)
        perturb_vector_params(model)
        directory = FIXTURES / model_type
        shutil.rmtree(directory, ignore_errors=True)
        model.save_pretrained(directory)
        # The same computation tests/models/test_fixture_drift.py reruns on the saved checkpoint.
        np.savez(directory / "reference.npz", **fixture_arrays(model))
        np.savez(directory / "reference_low_precision.npz", **low_precision_arrays(directory))
        size = sum(f.stat().st_size for f in directory.iterdir())
        print(f"{model_type}: {size / 1024:.0f} KiB in {directory.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
