"""Kept-quantised weights on every representative layout: gpt-oss's MXFP4 and DeepSeek-V3's FP8 checkpoints loaded
with `dequantize=False` against the same checkpoint dequantised at load.

    python scripts/checks/check_kept_quantized.py [mxfp4] [fp8]

For each format and layout (one device, fsdp8/ep8, tp2/fsdp4/ep4, pp2/fsdp4/ep4, dp_replicate2/fsdp2/ep2 and,
for FP8, tp2/ep4/fsdp4 with the linears split over tp): the largest |logits difference| (must be <= 1e-5) and
whether greedy `generate` gives the same tokens. The suite runs a representative subset
(tests/models/test_kept_mxfp4.py, tests/models/test_kept_fp8.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ.setdefault("MOE_JAX_HUGE_PAGES", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402

LAYOUTS = {
    "one_device": None,
    "fsdp8_ep8": dict(fsdp_size=8, ep_size=8),
    "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4),
    "pp2_fsdp4_ep4": dict(pp_size=2, fsdp_size=4, ep_size=4),
    "dp_replicate2_fsdp2_ep2": dict(dp_replicate_size=2, fsdp_size=2, ep_size=2, tp_size=2),
}


def mxfp4_checkpoint(directory: Path) -> Path:
    from tests.models.mxfp4_checkpoints import write_mxfp4_checkpoint

    return write_mxfp4_checkpoint(directory / "gpt_oss")


def fp8_checkpoint(directory: Path) -> Path:
    from tests.converters.fp8_checkpoints import write_fp8_checkpoint
    from tests.models.test_fixture_parity import FIXTURES

    write_fp8_checkpoint(FIXTURES / "deepseek_v3", directory / "deepseek_v3", (8, 8))
    return directory / "deepseek_v3"


CHECKPOINTS = {"mxfp4": mxfp4_checkpoint, "fp8": fp8_checkpoint}


def load(directory: Path, layout, **kwargs):
    config = None if layout is None else DistributedConfig(**layout)
    devices = jax.devices()[:1] if layout is None else None
    return AutoModelForCausalLM.from_pretrained(directory, config, progress=False, devices=devices, **kwargs)


def main() -> int:
    formats = sys.argv[1:] or list(CHECKPOINTS)
    ids = np.random.default_rng(1).integers(0, 64, (8, 12)).astype(np.int32)
    failures = 0
    with tempfile.TemporaryDirectory() as root:
        for name in formats:
            directory = CHECKPOINTS[name](Path(root) / name)
            for layout_name, layout in LAYOUTS.items():
                start = time.perf_counter()
                kept, dequantised = (load(directory, layout, dequantize=False), load(directory, layout))
                difference = float(np.max(np.abs(np.asarray(kept(ids)) - np.asarray(dequantised(ids)))))
                same = np.array_equal(kept.generate(ids[:2, :6], max_new_tokens=6, do_sample=False),
                                      dequantised.generate(ids[:2, :6], max_new_tokens=6, do_sample=False))
                ok = difference <= 1e-5 and same
                failures += not ok
                print(f"{name:<6} {layout_name:<24} max |logits diff| {difference:.1e}  generate equal {same}  "
                      f"{'ok' if ok else 'FAIL'}  ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
