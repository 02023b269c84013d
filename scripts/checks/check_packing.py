"""Packed rows against the same documents one per row, for every family: logits, loss, router aux loss, gradients.

    python scripts/checks/check_packing.py [FAMILY ...]

Runs `tests/models/test_packing.py`'s check (three documents packed into a row of 16 with padding after them,
against the documents one per row, fp32: logits within 2e-5, losses within 1e-5 relative, every gradient within
1e-5 + 1e-4 relative) on each committed fixture family; the suite runs one family per attention kind.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ.setdefault("MOE_JAX_HUGE_PAGES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from tests.inference.hf_generation import FAMILIES  # noqa: E402
from tests.models.test_packing import check_packed_row_equals_one_per_row  # noqa: E402


def main(argv: list[str]) -> int:
    families = argv or list(FAMILIES)
    failed = []
    for family in families:
        began = time.perf_counter()
        try:
            check_packed_row_equals_one_per_row(family)
            verdict = "ok"
        except AssertionError as error:
            failed.append(family)
            verdict = f"FAILED: {str(error).strip().splitlines()[0]}"
        print(f"{family}: {verdict} ({time.perf_counter() - began:.1f} s)", flush=True)
    print(f"{len(families) - len(failed)} of {len(families)} families: packed rows equal one document per row")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
