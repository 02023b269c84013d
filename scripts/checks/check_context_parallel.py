"""Context parallelism against one device, for every family: loss and gradients, fp32, within 1e-5.

    python scripts/checks/check_context_parallel.py [FAMILY ...]

Each committed fixture family on cp 2, 4 and 8, alone and with ep (cp4 x fsdp2 with ep4) and tp (tp2 x cp4),
both strategies (all_gather, ring), on packed rows (documents ending inside cp chunks) and on left-padded rows
(`tests/models/test_context_parallel.py`'s check; Llama 4, without an EP plan, takes cp4 x fsdp2), and through
pipeline stages (pp2 x cp2 x fsdp2). Then
sequence parallelism over tp: ten AdamW steps' losses with `enable_sequence_parallel` on and off within 1e-6.
The suite runs a representative few.
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

from tests.models.test_context_parallel import differences_from_one_device  # noqa: E402
from tests.models.test_fixture_parity import FAMILIES, has_ep_plan  # noqa: E402

ATOL = 1e-5


def layouts(family: str) -> list[dict]:
    with_ep = dict(cp_size=4, fsdp_size=2, ep_size=4) if has_ep_plan(family) else dict(cp_size=4, fsdp_size=2)
    return [dict(cp_size=2), dict(cp_size=8), with_ep, dict(tp_size=2, cp_size=4),
            dict(pp_size=2, cp_size=2, fsdp_size=2)]


def check_sequence_parallelism() -> float:
    """Max |loss difference| over ten AdamW steps of tp2 x fsdp4 x ep4 with sequence parallelism on and off."""
    from tests.training.conftest import build_trainer
    from tests.training.test_loss_curves import train_curve

    curves = [[r["loss"] for r in train_curve(build_trainer(dict(tp_size=2, fsdp_size=4, ep_size=4,
                                                                 enable_sequence_parallel=on))[1])]
              for on in (False, True)]
    return max(abs(a - b) for a, b in zip(*curves))


def main(argv: list[str]) -> int:
    families = argv or FAMILIES
    failed, worst = [], 0.0
    for family in families:
        for layout in layouts(family):
            for strategy in ("all_gather", "ring"):
                for packed in (True, False):
                    began = time.perf_counter()
                    case = dict(layout, cp_strategy=strategy)
                    loss, gradients = differences_from_one_device(family, case, packed)
                    worst = max(worst, loss, gradients)
                    verdict = "ok" if max(loss, gradients) < ATOL else "FAILED"
                    if verdict != "ok":
                        failed.append((family, case, packed))
                    print(f"{family} {case} {'packed' if packed else 'padded'}: loss {loss:.1e} gradients "
                          f"{gradients:.1e} {verdict} ({time.perf_counter() - began:.1f} s)", flush=True)
    sequence = check_sequence_parallelism()
    print(f"sequence parallelism: ten steps' losses within {sequence:.1e} of tp's all-reduce")
    total = len(families) * 20
    print(f"{total - len(failed)} of {total} cases within {ATOL:g} of one device (worst {worst:.1e})")
    return 1 if failed or sequence > 1e-6 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
