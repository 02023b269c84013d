"""Serving throughput and latency: `moe-jax serve` (continuous batching) against static `generate` batches and
Transformers' continuous batching, on the same checkpoint, requests and machine, in one run.

    pip install "moe_jax[serve,bench]" torch==2.13.0 transformers==5.23.0   # the reference side needs torch
    python scripts/bench/bench_serve.py [--requests 48] [--clients 16] [--max-slots CLIENTS] [--prompt 16-256]
                                  [--output 16-128] [--output-distribution uniform|lognormal]
                                  [--size default|large] [--seed 0] [--skip-reference]
                                  [--scan-layers auto|true|false]   # ours and static alike
                                  [--huge-pages on|off] [--no-mixed-steps] [--reference-arrival clients|all]
                                  [--decode-rows ROWS[,ROWS...]] [--prefill-rows N] [--repeats 1]
                                  [--api-key KEY] [--baseline-tree DIR] [--skip-static]

Builds one Qwen3-MoE checkpoint (bench_vs_reference's sizes; no EOS id, so every request generates exactly its
`max_tokens`) with a word-level tokenizer, draws the requests (prompt lengths uniform in the given range, output
lengths uniform or, with `--output-distribution lognormal`, long-tailed in theirs; token ids random), then
measures, each in a fresh process:
- ours: `moe-jax serve` on 127.0.0.1 (warmed up), driven by `--clients` concurrent streaming clients over HTTP
  (aiohttp on asyncio in one thread, as vLLM's benchmark client; each sends its next request when the last one
  ends); time to first token and inter-token latency are measured at the client, from sending the request; the
  clients share the machine;
- static: `model.generate` on the same requests in arrival order, `--max-slots` at a time, each batch left-padded
  to its longest prompt and run to its longest output (a static batch ends with its longest request; only each
  request's own tokens count); compilation excluded (every batch shape runs once before the timed pass);
- reference: Transformers' `init_continuous_batching` manager (its default config; one warm-up request first),
  each request with its own `max_new_tokens`: `--clients` requests in flight, the next added in arrival order as
  one finishes (the closed loop our clients run; default), or with `--reference-arrival all` every request added
  at once (`generate_batch`'s way: run ours with `--clients` = `--requests` to compare at equal arrival).
Prints tokens/s (generated tokens of every request / wall seconds of the whole pass), p50 / p99 TTFT and ITL,
and the ratios ours / static and ours / reference. `--repeats N` times every side N times, alternated (ours,
static, reference, ours, ...; the server starts once), prints each repeat's line and the medians (ratios: the
median of each repeat's ratio): this machine's figures move 10-20% between passes. Greedy on every side.
`--huge-pages on` (default) runs all three processes with glibc's hugetlb tunable where it applies (as the
`moe-jax` command runs itself), `off` all three without. `--no-mixed-steps`: the server runs separate prefill
and decode programs (`moe-jax serve --no-mixed-steps`). Also printed: the decode-step ceiling of the ratio to
static batches for these requests, at equal batch width (static batch decode steps / (generated tokens / slots)):
continuous batching cannot beat it by scheduling alone when a step costs the same whatever rows it holds.

A/B of the server itself: `--baseline-tree DIR` (another checkout, e.g. `git worktree add /tmp/base COMMIT`)
starts that tree's `moe-jax serve` beside ours on the same checkpoint and flags, and each repeat times both on the
same requests, alternating which goes first; printed: ours / baseline tokens/s and TTFT / ITL per repeat and their
medians. `--api-key KEY` starts ours with the key and has the clients send it (the baseline gets it only if it
knows the flag: pass a tree that does, or compare the cost of the checks themselves).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from bench_vs_reference import SIZES, host_memory_environ  # noqa: E402

from moe_jax.cli.layout_flags import SCAN_CHOICES, decode_scan_layers  # noqa: E402
from moe_jax.cli.serve import parse_row_counts  # noqa: E402


def parse_range(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split("-"))
    return low, high


def build(workdir: Path, size: str) -> None:
    import torch
    import transformers

    config = dict(SIZES[size], eos_token_id=None, pad_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**config), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(workdir / "checkpoint")
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}
    (workdir / "checkpoint" / "tokenizer.json").write_text(json.dumps(tokenizer))
    (workdir / "checkpoint" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))


OUTPUT_DISTRIBUTIONS = ("uniform", "lognormal")


def draw_output_length(rng: np.random.Generator, output: tuple[int, int], distribution: str) -> int:
    """One request's output length in [low, high]: uniform, or lognormal with its median at sqrt(low * high) and
    sigma ln(high / low) / 4 (about 95% of draws inside the range before clipping): chat traffic's long tail,
    many short answers and a few long ones (vLLM's ShareGPT runs have that shape)."""
    low, high = output
    if distribution == "uniform":
        return int(rng.integers(low, high + 1))
    if distribution == "lognormal":
        draw = rng.lognormal(np.log(np.sqrt(low * high)), np.log(high / low) / 4)
        return int(np.clip(np.round(draw), low, high))
    raise ValueError(f"output distribution {distribution!r}: expected one of {OUTPUT_DISTRIBUTIONS}")


def draw_requests(count: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int,
                  output_distribution: str = "uniform"):
    rng = np.random.default_rng(seed)
    return [dict(prompt=[int(t) for t in rng.integers(3, vocab, int(rng.integers(prompt[0], prompt[1] + 1)))],
                 max_tokens=draw_output_length(rng, output, output_distribution)) for _ in range(count)]


def static_ceiling(requests: list[dict], slots: int) -> float:
    """Decode steps of static batches of `slots` requests in arrival order (each runs to its longest output) over
    the steps continuous batching needs with every slot always busy (generated tokens / slots)."""
    outputs = [r["max_tokens"] for r in requests]
    static_steps = sum(max(outputs[i:i + slots]) for i in range(0, len(outputs), slots))
    return static_steps / (sum(outputs) / slots)


def percentiles(values) -> dict:
    values = np.asarray(values, float)
    if values.size == 0:
        return {"p50": float("nan"), "p99": float("nan")}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def summary(tokens: int, seconds: float, ttft, itl) -> dict:
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "ttft": percentiles(ttft),
            "itl": percentiles(itl)}


# ---- ours: the server and its clients ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(workdir: Path, requests: list[dict], args, tree: Path = ROOT, api_key: str | None = None):
    """`moe-jax serve` of checkout `tree` on a free port, healthy and warmed up (one short pass of the clients) ->
    (base URL, its process); terminated on exit."""
    import httpx

    port = free_port()
    max_len = max(len(r["prompt"]) + r["max_tokens"] for r in requests) + 1
    command = [sys.executable, "-m", "moe_jax.cli", "serve", "--model", str(workdir / "checkpoint"),
               "--port", str(port), "--max-slots", str(args.max_slots), "--page-size", "16",
               "--max-model-len", str(max_len), "--served-model-name", "bench", "--scan-layers", args.scan_layers,
               "--mixed-steps" if args.mixed_steps else "--no-mixed-steps"]
    if args.decode_rows:
        command += ["--decode-rows", ",".join(map(str, args.decode_rows))]
    if args.prefill_rows:
        command += ["--prefill-rows", str(args.prefill_rows)]
    if api_key:
        command += ["--api-key", api_key]
    log_path = workdir / f"server-{'ours' if tree == ROOT else 'baseline'}.log"
    log = open(log_path, "w")
    # `python -m` from the tree's root imports that tree's moe_jax first, whatever is installed.
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=args.environ)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: see {log_path}")
            time.sleep(0.5)
        # One short pass first: the server's first steps and the clients' connections warmed.
        drive(base, requests[:args.clients], args.clients, api_key)
        yield base, server
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def run_ours(base: str, server: subprocess.Popen, requests: list[dict], args, api_key: str | None = None) -> dict:
    """One timed pass of the clients against the running server."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    before = step_counts(httpx.get(f"{base}/metrics", timeout=10, headers=headers).text)
    start, client_cpu, server_cpu = time.perf_counter(), time.process_time(), cpu_seconds(server.pid)
    results = drive(base, requests, args.clients, api_key)
    seconds = time.perf_counter() - start
    client_cpu, server_cpu = time.process_time() - client_cpu, cpu_seconds(server.pid) - server_cpu
    metrics = httpx.get(f"{base}/metrics", timeout=10, headers=headers).text
    steps = {kind: count - before[kind] for kind, count in step_counts(metrics).items()}
    wrong = [i for i, (r, got) in enumerate(zip(requests, results)) if got["tokens"] != r["max_tokens"]]
    if wrong:
        raise RuntimeError(f"requests {wrong[:5]} got the wrong number of tokens")
    out = summary(sum(r["tokens"] for r in results), seconds, [r["ttft"] for r in results],
                  [gap for r in results for gap in r["gaps"]])
    out["cpu_seconds"] = {"clients": client_cpu, "server": server_cpu}
    out["steps"] = steps
    out["server_metrics"] = {line.split()[0]: line.split()[1] for line in metrics.splitlines()
                             if line and not line.startswith("#") and len(line.split()) == 2}
    return out


def step_counts(metrics: str) -> dict[str, int]:
    """The server's steps so far by kind, from its /metrics text."""
    counts = {}
    for kind in ("prefill", "decode", "mixed"):
        line = next(line for line in metrics.splitlines() if line.startswith(f"moe_jax_{kind}_steps_total "))
        counts[kind] = int(float(line.split()[1]))
    return counts


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used, all its threads (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(base: str, requests: list[dict], clients: int, api_key: str | None = None) -> list[dict]:
    """`clients` concurrent streaming clients (asyncio and aiohttp in one thread, as vLLM's benchmark client: the
    clients share the machine with the server, so they take as little of its CPU as they can), each sending its
    next request when the last one ended -> per request: tokens, time to first token, gaps between tokens
    (seconds, at the client)."""
    import asyncio

    import aiohttp

    results: list[dict | None] = [None] * len(requests)

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        request = requests[index]
        body = {"model": "bench", "prompt": request["prompt"], "max_tokens": request["max_tokens"],
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        sent, stamps, tokens = time.perf_counter(), [], 0
        async with session.post(f"{base}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:   # the server-sent events, a line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if b'"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                elif b'"text":""' not in line:
                    stamps.append(time.perf_counter())
        results[index] = {"tokens": tokens, "ttft": stamps[0] - sent if stamps else float("nan"),
                          "gaps": list(np.diff(stamps))}

    async def main() -> None:
        cursor = iter(range(len(requests)))
        connector = aiohttp.TCPConnector(limit=clients)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600),
                                         headers=headers) as session:
            async def client() -> None:
                for index in cursor:
                    await one(session, index)
            await asyncio.gather(*(client() for _ in range(clients)))

    asyncio.run(main())
    return results


# ---- static generate ---------------------------------------------------------------------------------------
def static_worker(workdir: Path, max_slots: int, scan_layers: str) -> None:
    import jax

    from moe_jax import AutoModelForCausalLM

    requests = json.loads((workdir / "requests.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", devices=jax.devices()[:1], progress=False,
                                                 scan_layers=decode_scan_layers(scan_layers))
    batches = [requests[i:i + max_slots] for i in range(0, len(requests), max_slots)]

    def run_batch(batch):
        width = max(len(r["prompt"]) for r in batch)
        ids = np.zeros((len(batch), width), np.int32)
        mask = np.zeros((len(batch), width), np.int32)
        for row, r in enumerate(batch):
            ids[row, width - len(r["prompt"]):] = r["prompt"]
            mask[row, width - len(r["prompt"]):] = 1
        return model.generator.generate(ids, mask, config=model.generation_config.updated(
            max_new_tokens=max(r["max_tokens"] for r in batch)))

    for batch in batches:       # every prefill / decode shape compiled before the timed pass
        run_batch(batch)
    ttft, itl, tokens = [], [], 0
    start = time.perf_counter()
    for batch in batches:
        began = time.perf_counter() - start
        result = run_batch(batch)
        timings = result.timings
        ttft += [began + timings.prefill_s] * len(batch)
        gap = timings.decode_s / max(timings.steps - 1, 1)
        itl += [gap] * sum(r["max_tokens"] - 1 for r in batch)
        tokens += sum(r["max_tokens"] for r in batch)
    seconds = time.perf_counter() - start
    print(json.dumps(summary(tokens, seconds, ttft, itl)))


# ---- the reference ---------------------------------------------------------------------------------------
def reference_worker(workdir: Path, clients: int | None) -> None:
    """Transformers' CB manager on the requests: `clients` of them in flight at a time (a new one added, in arrival
    order, as each finishes: the closed loop our clients run), or every one added at once (None:
    `generate_batch`'s way). Times to first token count from each request's adding."""
    import torch
    import transformers

    requests = json.loads((workdir / "requests.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    in_flight = len(requests) if clients is None else clients
    with torch.no_grad():
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        warm = manager.add_request(requests[0]["prompt"], max_new_tokens=4, record_timestamps=True)
        while not (manager.get_result(warm, timeout=60) or _Never).is_finished():
            pass
        start = time.perf_counter()
        added, ids, finished = {}, [], {}

        def add_next() -> None:
            r = requests[len(ids)]
            added_at = time.perf_counter()
            ids.append(manager.add_request(r["prompt"], max_new_tokens=r["max_tokens"], record_timestamps=True))
            added[ids[-1]] = added_at

        while len(ids) < min(in_flight, len(requests)):
            add_next()
        while len(finished) < len(requests):
            result = manager.get_result(timeout=600)
            if result is not None and result.is_finished():
                finished[result.request_id] = result
                if len(ids) < len(requests):
                    add_next()
        seconds = time.perf_counter() - start
        manager.stop(block=True)
    outputs = [finished[i] for i in ids]
    tokens = sum(len(o.generated_tokens) for o in outputs)
    ttft = [o.timestamps[0] - added[i] for i, o in zip(ids, outputs) if o.timestamps]
    itl = [gap for o in outputs for gap in np.diff(o.timestamps)]
    print(json.dumps(summary(tokens, seconds, ttft, itl)))


class _Never:
    @staticmethod
    def is_finished() -> bool:
        return False


def ratios(rows: dict) -> dict[str, float]:
    """Ours over each other side's tokens/s."""
    ours = rows["moe_jax serve"]["tokens_per_s"]
    return {name: ours / rows[name]["tokens_per_s"] for name in ("baseline serve", "static generate", "transformers CB")
            if name in rows}


def median_rows(passes: list[dict]) -> dict:
    """Each side's tokens/s, TTFT and ITL percentiles: the median over the passes."""
    def median_of(name, *path):
        values = []
        for rows in passes:
            value = rows[name]
            for key in path:
                value = value[key]
            values.append(value)
        return statistics.median(values)

    return {name: {"tokens_per_s": median_of(name, "tokens_per_s"),
                   "ttft": {q: median_of(name, "ttft", q) for q in ("p50", "p99")},
                   "itl": {q: median_of(name, "itl", q) for q in ("p50", "p99")}}
            for name in passes[0]}


def in_fresh_process(role: str, workdir: Path, environ: dict, *extra: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--role", role, "--workdir", str(workdir), *extra],
                         capture_output=True, text=True, cwd=ROOT, env=environ)
    if out.returncode:
        raise RuntimeError(f"{role} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-slots", type=int, default=None,
                        help="the server's slots and the static batches' width (default: --clients, a server sized "
                             "for the requests in flight)")
    parser.add_argument("--prompt", type=parse_range, default=(16, 256), help="prompt lengths, LOW-HIGH")
    parser.add_argument("--output", type=parse_range, default=(16, 128), help="output lengths, LOW-HIGH")
    parser.add_argument("--output-distribution", choices=OUTPUT_DISTRIBUTIONS, default="uniform",
                        help="output lengths uniform in --output, or lognormal (median sqrt(LOW * HIGH), a long "
                             "tail, clipped to the range)")
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed passes of every side, alternated (one server start); medians printed")
    parser.add_argument("--scan-layers", choices=tuple(SCAN_CHOICES), default="auto",
                        help="the model's layer scan, the same on both of our sides (moe-jax serve --scan-layers: auto is "
                             "unrolled for decoding)")
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="every side with glibc's hugetlb tunable (where it applies) or every side without")
    parser.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=True,
                        help="the server's mixed prefill + decode steps (moe-jax serve --mixed-steps)")
    parser.add_argument("--decode-rows", type=parse_row_counts, default=None, metavar="ROWS[,ROWS...]",
                        help="the server's decode programs' rows (moe-jax serve --decode-rows, e.g. 16 for one "
                             "program of every slot; default the server's)")
    parser.add_argument("--prefill-rows", type=int, default=None,
                        help="the server's prompt rows per prefill step (moe-jax serve --prefill-rows; default the "
                             "server's)")
    parser.add_argument("--reference-arrival", choices=("clients", "all"), default="clients",
                        help="Transformers' CB with --clients requests in flight, a new one as each finishes (our "
                             "clients' closed loop), or every request added at once (generate_batch's way)")
    parser.add_argument("--api-key", default=None, help="start our server with this API key; the clients send it")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout whose `moe-jax serve` runs beside ours, alternated with it each repeat")
    parser.add_argument("--skip-static", action="store_true", help="do not time static generate batches")
    parser.add_argument("--role", choices=("static", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_slots is None:
        args.max_slots = args.clients
    if args.role == "static":
        static_worker(args.workdir, args.max_slots, args.scan_layers)
        return 0
    if args.role == "reference":
        reference_worker(args.workdir, None if args.reference_arrival == "all" else args.clients)
        return 0

    environ, host_memory = host_memory_environ(dict(os.environ), args.huge_pages == "on")
    args.environ = {**environ, "MOE_JAX_HUGE_PAGES": "0"}   # the tunable is set (or not) here, for every side
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        build(workdir, args.size)
        requests = draw_requests(args.requests, args.prompt, args.output, SIZES[args.size]["vocab_size"], args.seed,
                                 args.output_distribution)
        (workdir / "requests.json").write_text(json.dumps(requests))
        print(f"# {args.requests} requests, prompts {args.prompt[0]}-{args.prompt[1]}, outputs "
              f"{args.output[0]}-{args.output[1]} tokens ({args.output_distribution}); {args.clients} clients, {args.max_slots} slots; "
              f"Transformers' CB: {'every request at once' if args.reference_arrival == 'all' else 'as many in flight'}; "
              f"size {args.size}; scan layers {args.scan_layers}; mixed steps {'on' if args.mixed_steps else 'off'}; "
              f"decode rows {','.join(map(str, args.decode_rows)) if args.decode_rows else 'the server default'}; "
              f"prefill rows {args.prefill_rows or 'the server default'}; "
              f"{host_memory}; {os.cpu_count()} CPUs", flush=True)
        print(f"# decode-step ceiling of ours / static at {args.max_slots} slots: "
              f"{static_ceiling(requests, args.max_slots):.2f}x", flush=True)
        passes = []
        with contextlib.ExitStack() as servers:
            base, server = servers.enter_context(served(workdir, requests, args, api_key=args.api_key))
            if args.baseline_tree is not None:
                baseline = servers.enter_context(served(workdir, requests, args, tree=args.baseline_tree.resolve()))
            for repeat in range(args.repeats):
                rows = {}
                if args.baseline_tree is not None and repeat % 2:   # alternate which server goes first
                    rows["baseline serve"] = run_ours(*baseline, requests, args)
                rows["moe_jax serve"] = run_ours(base, server, requests, args, args.api_key)
                if args.baseline_tree is not None and not repeat % 2:
                    rows["baseline serve"] = run_ours(*baseline, requests, args)
                if not args.skip_static:
                    rows["static generate"] = in_fresh_process("static", workdir, args.environ, "--max-slots",
                                                               str(args.max_slots), "--scan-layers", args.scan_layers)
                if not args.skip_reference:
                    rows["transformers CB"] = in_fresh_process("reference", workdir, args.environ, "--clients",
                                                               str(args.clients), "--reference-arrival",
                                                               args.reference_arrival)
                passes.append(rows)
                if args.repeats > 1:
                    print(f"# repeat {repeat + 1}: " + ", ".join(f"{name} {row['tokens_per_s']:.1f}"
                                                                 for name, row in rows.items())
                          + " tokens/s; " + "; ".join(f"ours / {name} {ratio:.2f}x"
                                                      for name, ratio in ratios(rows).items()), flush=True)
    rows = passes[0] if len(passes) == 1 else median_rows(passes)
    if len(passes) > 1:
        print(f"# medians of {len(passes)} repeats (ours / static and ours / reference: medians of each repeat's ratio)")
    print(f"{'':18}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}")
    for name, row in rows.items():
        print(f"{name:18}{row['tokens_per_s']:10.1f}{row['ttft']['p50']:10.3f}{row['ttft']['p99']:10.3f}"
              f"{row['itl']['p50'] * 1e3:9.1f}m{row['itl']['p99'] * 1e3:9.1f}m")
    cpu = passes[-1]["moe_jax serve"]["cpu_seconds"]
    print(f"# during our {'last ' if len(passes) > 1 else ''}pass ({passes[-1]['moe_jax serve']['seconds']:.1f} s on "
          f"{os.cpu_count()} CPUs): server process {cpu['server']:.1f} CPU s, clients {cpu['clients']:.1f} CPU s; "
          f"server steps {passes[-1]['moe_jax serve']['steps']}")
    each = [ratios(rows) for rows in passes]
    for name in each[0]:
        print(f"ours / {name}: {statistics.median(r[name] for r in each):.2f}x throughput")
    if "baseline serve" in passes[0]:
        for what in ("ttft", "itl"):
            for q in ("p50", "p99"):
                ratio = statistics.median(rows["moe_jax serve"][what][q] / rows["baseline serve"][what][q]
                                          for rows in passes)
                print(f"ours / baseline serve: {ratio:.3f}x {what.upper()} {q}")
    print(json.dumps([{name: {k: v for k, v in row.items() if k != "server_metrics"} for name, row in rows.items()}
                      for rows in passes]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
