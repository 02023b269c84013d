"""Check every family against its PyTorch fixture on every legal 8-device layout x ep_implementation.

    python scripts/checks/check_all_layouts.py [qwen3_moe qwen2_moe olmoe mixtral] [--scan-layers both|true|false]

Each case runs with layers unrolled and with layers scanned (`--scan-layers both`, the default); a
fixture whose layers form no run of two (Qwen2-MoE's alternating attention) is the same model both ways.

The test suite runs a representative set of layouts per family (tests/models/test_fixture_parity.py,
tests/models/test_layer_stack.py); this script runs the full grid (about 2-5 minutes per family and
layer mode on 2 cores). Run it before resolving anything that touches the model step.
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

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from tests.models.test_fixture_parity import (  # noqa: E402
    FAMILIES,
    check_against_fixture,
    every_layout_and_implementation,
)

SCAN_MODES = {"both": (False, True), "true": (True,), "false": (False,)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"any of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--scan-layers", choices=sorted(SCAN_MODES), default="both")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.families) - set(FAMILIES)):
        parser.error(f"unknown families {unknown}; choose among {FAMILIES}")
    for family in args.families or FAMILIES:
        cases = every_layout_and_implementation(family)
        for scan in SCAN_MODES[args.scan_layers]:
            start = time.perf_counter()
            worst = max(check_against_fixture(family, layout, scan_layers=scan) for layout in [None, *cases])
            print(f"{family} ({'scanned' if scan else 'unrolled'} layers): logits and aux loss match PyTorch on one "
                  f"device and {len(cases)} layout x implementation cases; worst max |logits - PyTorch| "
                  f"{worst:.2e} ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
