"""Check greedy generation against Transformers' on every legal 8-device layout x ep_implementation.

    python scripts/checks/check_generate_layouts.py [qwen3_moe qwen2_moe olmoe mixtral] [--scan-layers]

For each family, the committed fixture (tests/fixtures/generation/, `scripts/fixtures/make_generation_fixtures.py`:
3 left-padded prompts, 20 greedy tokens of Transformers' `generate`, and a run with an EOS that stops rows
early) must be reproduced token for token on one device and on every case of the parity grid: 48 cases,
3 rows on up to 8 data-parallel groups, so most batches are smaller than the data-parallel size. The
suite runs three layouts of one family (tests/inference/test_generate.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from tests.inference.hf_generation import FAMILIES, FIXTURES, MODELS, NEW_TOKENS  # noqa: E402
from tests.models.test_fixture_parity import every_layout_and_implementation  # noqa: E402


def check(family: str, layout: dict | None, scan_layers) -> list[str]:
    """The failures of one case (empty when the tokens match)."""
    expected = np.load(FIXTURES / f"{family}.npz")
    model = AutoModelForCausalLM.from_pretrained(
        MODELS / family, None if layout is None else DistributedConfig(**layout),
        devices=jax.devices()[:1] if layout is None else None, progress=False, scan_layers=scan_layers)
    prompt = expected["input_ids"], expected["attention_mask"]
    failures = []
    if not np.array_equal(model.generate(*prompt, max_new_tokens=NEW_TOKENS), expected["greedy"]):
        failures.append("greedy tokens differ")
    with_eos = model.generate(*prompt, max_new_tokens=NEW_TOKENS, eos_token_id=int(expected["eos_token_id"]),
                              pad_token_id=0)
    if not np.array_equal(with_eos, expected["with_eos"]):
        failures.append("tokens with EOS differ")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"any of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--scan-layers", action="store_true", help="scan the layers (default: the model's auto)")
    args = parser.parse_args()
    failed = 0
    for family in args.families or FAMILIES:
        cases = [None, *every_layout_and_implementation(family)]
        start = time.perf_counter()
        for layout in cases:
            failures = check(family, layout, True if args.scan_layers else "auto")
            if failures:
                failed += 1
                print(f"FAIL {family} {layout or 'one device'}: {', '.join(failures)}", flush=True)
            jax.clear_caches()
        print(f"{family}: {len(cases)} cases (one device + {len(cases) - 1} layouts) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    print(f"{failed} failing case(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
