"""Check every family through pipeline stages on every legal pp layout of 8 devices against its PyTorch fixture.

    python scripts/checks/check_pipeline_layouts.py [qwen3_moe ...] [--generate]

For each family and each pp_size from 2 up to its layer count that divides 8, every legal layout of the other
8 / pp devices (tp, fsdp, ep, dp_replicate) x every ep_implementation that applies, with the default GPipe
schedule and one microbatch per stage: logits and aux loss against the fixture (tests/models/test_fixture_parity
tolerances). Where the layer count allows, the circular schedule (2 repeats) runs on the first layout of each
pp_size too. `--generate` also compares greedy tokens with one device on the first layout of each pp_size.
The suite runs one pp layout per family (tests/models/test_pipeline.py); run this before resolving anything that
touches the pipeline. Prints one line per case and the worst logits difference; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from tests.distributed.test_mesh import legal_layouts  # noqa: E402
from tests.models.test_fixture_parity import FAMILIES, FIXTURES, check_against_fixture, has_ep_plan  # noqa: E402
from tests.models.test_pipeline import greedy_tokens  # noqa: E402


def pipeline_cases(family: str) -> list[tuple[dict, dict]]:
    """(layout, model options) of every case of `family`."""
    layers = json.loads((FIXTURES / family / "config.json").read_text())["num_hidden_layers"]
    cases = []
    for stages in (2, 4, 8):
        if stages > layers:
            continue
        first = True
        for tp, fsdp, ep, replicate in legal_layouts(8 // stages):
            if ep > 1 and not has_ep_plan(family):
                continue
            base = dict(pp_size=stages, tp_size=tp, fsdp_size=fsdp, ep_size=ep, dp_replicate_size=replicate)
            names = ["-"] if ep == 1 else ["all_to_all", "auto"] + (["all_reduce"] if ep == tp else [])
            for name in names:
                layout = base if name == "-" else dict(base, ep_implementation=name)
                cases.append((layout, {}))
                if first and layers % (2 * stages) == 0:
                    cases.append((layout, dict(pipeline_schedule="circular", pipeline_repeats=2)))
                first = False
    return cases


def generation_matches(family: str, layout: dict) -> bool:
    staged, one = greedy_tokens(family, layout)
    return bool(np.array_equal(staged, one))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"any of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--generate", action="store_true", help="also compare greedy tokens (first layout per pp)")
    args = parser.parse_args(argv)
    failures, worst, count, began = [], 0.0, 0, time.perf_counter()
    for family in args.families or FAMILIES:
        generated = set()
        for layout, options in pipeline_cases(family):
            label = f"{family} {layout} {options or ''}".rstrip()
            count += 1
            try:
                difference = check_against_fixture(family, layout, **options)
                worst = max(worst, difference)
                line = f"ok   {label}: max |logits - PyTorch| {difference:.1e}"
                if args.generate and layout["pp_size"] not in generated and not options:
                    generated.add(layout["pp_size"])
                    matched = generation_matches(family, layout)
                    line += f", greedy tokens {'equal' if matched else 'DIFFER'}"
                    if not matched:
                        failures.append(f"{label}: greedy tokens differ")
                print(line, flush=True)
            except AssertionError as error:
                failures.append(f"{label}: {error}")
                print(f"FAIL {label}: {error}", flush=True)
    print(f"{count} cases, {len(failures)} failed in {time.perf_counter() - began:.0f} s; worst logits "
          f"difference {worst:.1e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
