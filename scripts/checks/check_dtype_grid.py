"""Check every family in fp32, bf16 and fp16 on one device and every legal 8-device layout: forward and one train step.

    python scripts/checks/check_dtype_grid.py [--families F ...] [--dtypes D ...] [--parts forward step] [--limit N]
                                       [--implementations all_to_all all_reduce auto]

For each family x dtype x case (one device, then every legal 8-device layout x each ep_implementation that
applies, `every_layout_and_implementation`):
  forward   logits on the committed fixture's inputs. fp32: within LOGITS_ATOL (1e-5) of PyTorch's; bf16/fp16:
            as close to PyTorch's fp32 logits as PyTorch's own bf16/fp16 run, rms within 1.25x and the largest
            error within 2x of the reference's (tests/models/low_precision.py).
  step      one SGD step (router loss on, largest capacity) against the one-device fp32 step: loss, aux loss and
            grad norm within STEP_TOLERANCE for the dtype (fp32 also the parameters after the step).
Prints one line per case and a summary with the worst figures; exits 1 if any case fails. The suite runs a
representative set (tests/models/test_low_precision.py). About 3-6 s per case on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# As tests/conftest.py: 8 CPU devices, and LLVM's optimisation passes skipped (the models are tiny, the time is
# compiling; XLA's own passes, so the programs checked, are unchanged).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from tests.models.hf_reference import LOGITS_ATOL  # noqa: E402
from tests.models.low_precision import (  # noqa: E402
    LOW_PRECISION_DTYPES,
    forward_error,
    reference_error,
    step_errors,
    step_within,
    train_step_result,
)
from tests.models.test_fixture_parity import FAMILIES, every_layout_and_implementation  # noqa: E402

DTYPES = ("float32", *LOW_PRECISION_DTYPES)


def check_forward(family: str, layout: dict | None, dtype: str) -> tuple[bool, str, float]:
    """(ok, report, error ratio against the bar)."""
    error = forward_error(family, layout, dtype)
    if dtype == "float32":
        return error.max <= LOGITS_ATOL, f"forward {error}", error.max / LOGITS_ATOL
    bar = reference_error(family, dtype)
    ratio = max(error.rms / bar.rms, error.max / bar.max)
    return error.within(bar), f"forward {error} (PyTorch {dtype}: {bar})", ratio


def check_step(family: str, layout: dict | None, dtype: str, baseline) -> tuple[bool, str, dict]:
    errors = step_errors(train_step_result(family, layout, dtype), baseline)
    report = ", ".join(f"{name} {value:.1e}" for name, value in errors.items())
    return step_within(errors, dtype), f"step {report}", errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    parser.add_argument("--parts", nargs="+", default=("forward", "step"), choices=("forward", "step"))
    parser.add_argument("--limit", type=int, default=None, help="run only the first N cases of each family")
    parser.add_argument("--implementations", nargs="+", default=("all_to_all", "all_reduce", "auto"),
                        choices=("all_to_all", "all_reduce", "auto"),
                        help="the ep_implementations of EP layouts to run ('auto' runs one of the other two)")
    args = parser.parse_args(argv)

    failures, cases, worst = [], 0, {}
    start = time.perf_counter()
    for family in args.families:
        layouts = [layout for layout in [None, *every_layout_and_implementation(family)]
                   if layout is None or layout.get("ep_implementation", "all_to_all") in args.implementations]
        layouts = layouts[: args.limit]
        baseline = train_step_result(family, None, "float32") if "step" in args.parts else None
        for dtype in args.dtypes:
            for layout in layouts:
                case_start = time.perf_counter()
                results = []
                if "forward" in args.parts:
                    ok, report, ratio = check_forward(family, layout, dtype)
                    results.append((ok, report))
                    key = (dtype, "forward / bar")
                    worst[key] = max(worst.get(key, 0.0), ratio)
                if "step" in args.parts:
                    ok, report, errors = check_step(family, layout, dtype, baseline)
                    results.append((ok, report))
                    for name, value in errors.items():
                        worst[(dtype, f"step {name}")] = max(worst.get((dtype, f"step {name}"), 0.0), value)
                cases += 1
                passed = all(ok for ok, _ in results)
                if not passed:
                    failures.append((family, dtype, layout))
                print(f"{'ok  ' if passed else 'FAIL'} {family} {dtype} {layout or 'one device'}: "
                      f"{'; '.join(report for _, report in results)} ({time.perf_counter() - case_start:.1f} s)",
                      flush=True)
            jax.clear_caches()  # a family's programs are not reused by the next dtype's
    print(f"\n{cases} cases, {len(failures)} failed, {time.perf_counter() - start:.0f} s")
    for (dtype, name), value in sorted(worst.items()):
        print(f"  worst {dtype:9s} {name}: {value:.2e}")
    for failure in failures:
        print("FAILED:", *failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
