"""Where a `ServingEngine`'s time goes: its programs (placing the inputs, running, reading the new ids) against
everything else on the host (admission, building and packing inputs, emitting tokens), with no HTTP.

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python scripts/profile_engine_host.py

bench_serve.py's default model and requests (48, prompts 16-256, outputs 16-128, seed 0) queued at once, 8 slots,
pages of 16, every program compiled first; two rounds. Needs torch + transformers (the checkpoint is written by
bench_serve's `build`).
"""

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MOE_JAX_HUGE_PAGES", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402
import jax  # noqa: E402

from moe_jax import AutoModelForCausalLM  # noqa: E402
from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings, ServingEngine  # noqa: E402


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="moe_jax_engine_host_"))
    bench_serve.build(workdir, "default")
    requests = bench_serve.draw_requests(48, (16, 256), (16, 128), bench_serve.SIZES["default"]["vocab_size"], 0)
    model = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", devices=jax.devices()[:1], progress=False)
    max_len = max(len(r["prompt"]) + r["max_tokens"] for r in requests) + 1
    engine = ServingEngine(model, ContinuousBatchingConfig(max_slots=8, page_size=16, max_model_len=max_len))
    engine.compile_all()
    inside = {"prefill": 0.0, "decode": 0.0}
    original = ServingEngine._execute

    def timed(self, name, ints, floats, length):
        began = time.perf_counter()
        out = original(self, name, ints, floats, length)
        inside[name] += time.perf_counter() - began
        return out

    ServingEngine._execute = timed
    for round_ in range(2):
        inside.update(prefill=0.0, decode=0.0)
        for i, r in enumerate(requests):
            engine.add(Request(f"r{round_}-{i}", r["prompt"], RequestSettings(max_new_tokens=r["max_tokens"])))
        steps_before = dict(engine.steps)
        began = time.perf_counter()
        tokens = 0
        while engine.has_work():
            tokens += len(engine.step())
        wall = time.perf_counter() - began
        steps = {k: engine.steps[k] - steps_before.get(k, 0) for k in engine.steps}
        program = sum(inside.values())
        print(f"round {round_}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tokens/s; steps {steps}; "
              f"programs {program:.2f} s (prefill {inside['prefill']:.2f}, decode {inside['decode']:.2f}); "
              f"host outside programs {wall - program:.2f} s ({(wall - program) / wall:.0%}), "
              f"{(wall - program) / sum(steps.values()) * 1e3:.2f} ms per program call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
