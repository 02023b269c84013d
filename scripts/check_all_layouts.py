"""Check every family against its PyTorch fixture on every legal 8-device layout x ep_implementation.

    python scripts/check_all_layouts.py [qwen3_moe qwen2_moe olmoe mixtral]

CI runs this grid for Qwen3-MoE (tests/models/test_fixture_parity.py, marked slow) and a representative
set of layouts for the other families; this script runs the full grid for any of them (about 2 minutes
per family on 2 cores).
"""

from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from tests.models.test_fixture_parity import (  # noqa: E402
    FAMILIES,
    check_against_fixture,
    every_layout_and_implementation,
)


def main(argv: list[str]) -> int:
    families = argv or FAMILIES
    cases = every_layout_and_implementation()
    for family in families:
        start = time.perf_counter()
        worst = max(check_against_fixture(family, layout) for layout in [None, *cases])
        print(f"{family}: logits and aux loss match PyTorch on one device and {len(cases)} layout x implementation "
              f"cases; worst max |logits - PyTorch| {worst:.2e} ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
