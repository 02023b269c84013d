"""Check continuous batching against Transformers' greedy tokens on every legal 8-device layout x ep_implementation.

    python scripts/checks/check_serving_layouts.py [FAMILY ...] [--every-layout] [--slots-per-group N]

For each family, the committed fixture's three prompts (7, 4 and 2 tokens; tests/fixtures/generation/) go through a
`ServingEngine` with staggered arrivals (request i joins after 2i steps), pages of 4 tokens and prompts prefilled
in chunks of 3, as many slots as the layout has data-parallel groups (at least 2, so the third request waits for a
slot on the smallest layouts; `--slots-per-group 2`: twice as many, so a group's decode steps pack 1 or 2 rows,
`ContinuousBatchingConfig.decode_rows`); every request's 20 greedy tokens must equal Transformers' `generate`'s,
and every page must come back. Default: one device and one representative layout per shape of the mesh (tp=ep all_reduce, tp<ep
dispatch, fsdp only, dp_replicate); `--every-layout`: the whole parity grid. The suite runs one device for every
family and one 8-device layout (tests/inference/test_continuous.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ.setdefault("MOE_JAX_HUGE_PAGES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.inference import ContinuousBatchingConfig, RequestSettings, ServingEngine  # noqa: E402
from tests.inference.hf_generation import FAMILIES, MODELS, NEW_TOKENS  # noqa: E402
from tests.inference.test_continuous import fixture_prompts, run_staggered  # noqa: E402
from tests.models.test_fixture_parity import every_layout_and_implementation, has_ep_plan  # noqa: E402

REPRESENTATIVE = [
    dict(tp_size=2, ep_size=2, fsdp_size=4, ep_implementation="all_reduce"),
    dict(tp_size=2, fsdp_size=4, ep_size=4, ep_implementation="all_to_all"),
    dict(tp_size=1, fsdp_size=8, ep_size=8, ep_implementation="all_to_all"),
    dict(tp_size=2, fsdp_size=2, dp_replicate_size=2),
    dict(tp_size=1, fsdp_size=8),
]


def check(family: str, layout: dict | None, slots_per_group: int = 1) -> list[str]:
    prompts, greedy, _ = fixture_prompts(family)
    model = AutoModelForCausalLM.from_pretrained(
        MODELS / family, None if layout is None else DistributedConfig(**layout),
        devices=jax.devices()[:1] if layout is None else None, progress=False)
    config = ContinuousBatchingConfig(max_slots=max(2, slots_per_group * model.data_parallel_size), page_size=4,
                                      max_model_len=64, prefill_chunk=3)
    engine = ServingEngine(model, config)
    requests = run_staggered(engine, prompts, RequestSettings(max_new_tokens=NEW_TOKENS), stagger=2)
    failures = [f"{r.request_id} tokens differ" for r, row in zip(requests, greedy)
                if r.output.generated_tokens != list(row)]
    if engine.book.free_pages() != engine.book.total_pages:
        failures.append(f"{engine.book.total_pages - engine.book.free_pages()} pages not returned")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"any of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--every-layout", action="store_true", help="the whole parity grid (26 layouts x EP modes)")
    parser.add_argument("--slots-per-group", type=int, default=1,
                        help="slots per data-parallel group (default 1; 2: decode steps of 1 or 2 rows per group)")
    args = parser.parse_args()
    failed = total = 0
    for family in args.families or FAMILIES:
        if args.every_layout:
            layouts = every_layout_and_implementation(family)
        else:
            layouts = [layout for layout in REPRESENTATIVE if layout.get("ep_size", 1) == 1 or has_ep_plan(family)]
        start = time.perf_counter()
        for layout in [None, *layouts]:
            failures = check(family, layout, args.slots_per_group)
            total += 1
            if failures:
                failed += 1
                print(f"FAIL {family} {layout or 'one device'}: {', '.join(failures)}", flush=True)
            jax.clear_caches()
        print(f"{family}: {len(layouts) + 1} cases in {time.perf_counter() - start:.0f} s", flush=True)
    print(f"{failed} failing case(s) of {total}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
