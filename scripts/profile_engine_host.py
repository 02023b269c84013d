"""Where a `ServingEngine`'s time goes: its programs (placing the inputs, running, reading the new ids) against
everything else on the host (admission, building and packing inputs, emitting tokens), with no HTTP.

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python scripts/profile_engine_host.py [--rounds 2]
        [--max-slots 8] [--prefill-rows 1] [--prefill-chunk 128] [--scan-layers auto|true|false] [--compare-mixed]
        [--decode-rows 1,2,8] [--output 16-128] [--output-distribution uniform|lognormal]

bench_serve.py's default model and requests (48, prompts 16-256, outputs 16-128, seed 0) queued at once, 8 slots,
pages of 16, every program compiled first. Program time is printed per program and row count (each decode program
of --decode-rows apart: seconds / calls = ms a call). --compare-mixed alternates engines with mixed steps (a step that
prefills also decodes, one program) and without (a prefill program, then a decode program), round by round.
Needs torch + transformers (the checkpoint is written by bench_serve's `build`).
"""

import argparse
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
from moe_jax.cli.layout_flags import SCAN_CHOICES, decode_scan_layers  # noqa: E402
from moe_jax.cli.serve import parse_row_counts  # noqa: E402
from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings, ServingEngine  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-slots", type=int, default=8)
    parser.add_argument("--prefill-rows", type=int, default=1)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--scan-layers", choices=tuple(SCAN_CHOICES), default="auto")
    parser.add_argument("--compare-mixed", action="store_true")
    parser.add_argument("--decode-rows", type=parse_row_counts, default=None, help="e.g. 1,4,16 (ContinuousBatchingConfig.decode_rows)")
    parser.add_argument("--output", default="16-128", help="output lengths, LOW-HIGH (bench_serve's --output)")
    parser.add_argument("--output-distribution", choices=bench_serve.OUTPUT_DISTRIBUTIONS, default="uniform")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="moe_jax_engine_host_"))
    bench_serve.build(workdir, "default")
    requests = bench_serve.draw_requests(48, (16, 256), bench_serve.parse_range(args.output),
                                         bench_serve.SIZES["default"]["vocab_size"], 0, args.output_distribution)
    model = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", devices=jax.devices()[:1], progress=False,
                                                 scan_layers=decode_scan_layers(args.scan_layers))
    max_len = max(len(r["prompt"]) + r["max_tokens"] for r in requests) + 1
    engines = [ServingEngine(model, ContinuousBatchingConfig(max_slots=args.max_slots, page_size=16,
                                                             max_model_len=max_len, mixed_steps=mixed,
                                                             prefill_rows=args.prefill_rows,
                                                             prefill_chunk=args.prefill_chunk,
                                                             decode_rows=args.decode_rows))
               for mixed in ((True, False) if args.compare_mixed else (True,))]
    for engine in engines:
        engine.compile_all()
    inside: dict[str, float] = {}
    original = ServingEngine._execute

    calls: dict[str, int] = {}

    def timed(self, name, ints, floats, length):
        began = time.perf_counter()
        out = original(self, name, ints, floats, length)
        program = f"{name} {ints.shape[0]} rows"   # each decode program of --decode-rows apart
        inside[program] = inside.get(program, 0.0) + time.perf_counter() - began
        calls[program] = calls.get(program, 0) + 1
        return out

    ServingEngine._execute = timed
    for round_ in range(args.rounds * len(engines)):
        engine = engines[round_ % len(engines)]
        inside.clear()
        calls.clear()
        for i, r in enumerate(requests):
            engine.add(Request(f"r{round_}-{i}", r["prompt"], RequestSettings(max_new_tokens=r["max_tokens"])))
        steps_before = dict(engine.steps)
        began, cpu = time.perf_counter(), time.process_time()
        tokens = 0
        while engine.has_work():
            tokens += len(engine.step())
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        steps = {k: engine.steps[k] - steps_before.get(k, 0) for k in engine.steps if engine.steps[k] > 0}
        program = sum(inside.values())
        each = ", ".join(f"{name} {seconds:.2f} s / {calls[name]} = {seconds / calls[name] * 1e3:.1f} ms"
                         for name, seconds in sorted(inside.items()))
        print(f"round {round_} (mixed steps {'on' if engine.config.mixed_steps else 'off'}): {tokens} tokens in "
              f"{wall:.2f} s = {tokens / wall:.0f} tokens/s ({cpu:.1f} CPU s); steps {steps}; programs {program:.2f} s ({each}); "
              f"host outside programs {wall - program:.2f} s ({(wall - program) / wall:.0%}), "
              f"{(wall - program) / sum(steps.values()) * 1e3:.2f} ms per program call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
