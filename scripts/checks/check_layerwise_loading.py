"""Layer-by-layer loading of stacked runs equals whole-block loading, bit for bit, for every family's fixture on
one device and every legal 8-device layout (the grid behind tests/models/test_layer_stack.py's two layouts).

    python scripts/checks/check_layerwise_loading.py [FAMILY ...]

Each case loads the committed fixture with scanned layers twice: with `converters.load.LAYERWISE_READ_BYTES`
at infinity (every device block read whole) and at 0 (every stacked block read one layer at a time into its
device buffer), and compares every shard's device and bytes. ep_implementation does not change loading, so
each layout is loaded once.
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

import converters.load  # noqa: E402
import moe_jax  # noqa: E402
from moe_jax import DistributedConfig  # noqa: E402
from tests.models.test_fixture_parity import FAMILIES, FIXTURES, every_layout_and_implementation  # noqa: E402


def load(family: str, layout: dict | None, layerwise_read_bytes: float):
    converters.load.LAYERWISE_READ_BYTES = layerwise_read_bytes
    return moe_jax.AutoModelForCausalLM.from_pretrained(
        FIXTURES / family, None if layout is None else DistributedConfig(**layout), progress=False,
        scan_layers=True, devices=jax.devices()[:1] if layout is None else None)


def distinct_layouts(family: str) -> list[dict | None]:
    layouts = {}
    for case in every_layout_and_implementation(family):
        layout = {key: value for key, value in case.items() if key != "ep_implementation"}
        layouts[tuple(sorted(layout.items()))] = layout
    return [None, *layouts.values()]


def differences(whole, layerwise) -> list[str]:
    found = []
    for name, expected in whole.params.items():
        got = layerwise.params[name]
        if got.sharding != expected.sharding:
            found.append(f"{name}: sharding {got.sharding} != {expected.sharding}")
            continue
        for ours, theirs in zip(got.addressable_shards, expected.addressable_shards, strict=True):
            if ours.device != theirs.device or not np.array_equal(np.asarray(ours.data), np.asarray(theirs.data)):
                found.append(f"{name}: shard on {theirs.device} differs")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"any of {', '.join(FAMILIES)} (default: all)")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.families) - set(FAMILIES)):
        parser.error(f"unknown families {unknown}; choose among {FAMILIES}")
    failures = 0
    for family in args.families or FAMILIES:
        start, layouts = time.perf_counter(), distinct_layouts(family)
        for layout in layouts:
            found = differences(load(family, layout, float("inf")), load(family, layout, 0))
            failures += bool(found)
            for line in found:
                print(f"{family} {layout}: {line}")
        stacked = any(name.startswith("model.layers.") and "-" in name.split(".")[2]
                      for name in load(family, None, float("inf")).params)
        print(f"{family}: {len(layouts)} layouts, layer-by-layer == whole blocks bit for bit"
              f"{'' if stacked else ' (no scanned run in this fixture: nothing is read layer by layer)'} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    print("FAILED" if failures else "all cases equal")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
