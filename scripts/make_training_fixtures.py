"""Record the reference's loss curve on the committed tiny Qwen3-MoE (needs torch + transformers).

    pip install torch==2.13.0 transformers==5.23.0
    python scripts/make_training_fixtures.py

Writes tests/fixtures/training/qwen3_moe_adamw.npz: 10 steps of torch AdamW (lr 3e-3, weight decay 0.01,
clip 1.0) on batches with padded rows, with the router loss added (coefficient 0.1). tests/training/
test_loss_curves.py compares moe_jax's curve with it on 1 device and 8-device layouts, and reruns the
reference live when torch is installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.training.hf_training import CONFIG_CHANGES, CURVE, SETUP, reference_training  # noqa: E402


def main() -> int:
    curve = reference_training()
    CURVE.parent.mkdir(parents=True, exist_ok=True)
    np.savez(CURVE, **curve, setup=json.dumps({**SETUP, **CONFIG_CHANGES}))
    for step, (loss, aux) in enumerate(zip(curve["losses"], curve["aux_losses"]), start=1):
        print(f"step {step:2d}: loss {loss:.6f} (aux {aux:.6f})")
    print(f"wrote {CURVE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
