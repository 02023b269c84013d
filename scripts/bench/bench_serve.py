"""Serving throughput and latency: `moe-jax serve` (continuous batching) against static `generate` batches and
Transformers' continuous batching, on the same checkpoint, requests and machine, in one run.

    pip install "moe_jax[serve,bench]" torch==2.13.0 transformers==5.23.0   # the reference side needs torch
    python scripts/bench/bench_serve.py [--requests 48] [--clients 16] [--max-slots CLIENTS]
                                  [--workload random|shared-prefix|multi-turn|code-edit] [--system-tokens 1024]
                                  [--turns 4] [--prompt LOW-HIGH] [--output LOW-HIGH]
                                  [--output-distribution uniform|lognormal]
                                  [--size default|large|copy] [--copy-steps N] [--seed 0] [--skip-reference]
                                  [--scan-layers auto|true|false]   # ours and static alike
                                  [--huge-pages on|off] [--no-mixed-steps] [--reference-arrival clients|all]
                                  [--decode-rows ROWS[,ROWS...]] [--prefill-rows N] [--repeats 1]
                                  [--api-key KEY] [--baseline-tree DIR] [--skip-static]
                                  [--server-flags="FLAGS"] [--baseline-flags="FLAGS"]

Builds one Qwen3-MoE checkpoint (bench_vs_reference's sizes, its positions raised where the workload needs more; no
EOS id, so every request generates exactly its `max_tokens`) with a word-level tokenizer, draws the requests of
`--workload` (serve_workloads.py: random prompts, the default; one shared system prompt; multi-turn conversations
resending the answers ours gave; code edits for n-gram speculation; lengths as `--prompt` / `--output` say, or
the workload's defaults; fresh token ids each repeat, so no pass meets the prefix cache of another beyond a
shared system prompt), then measures, each in a fresh process:
- ours: `moe-jax serve` on 127.0.0.1 (warmed up), driven by `--clients` concurrent streaming clients over HTTP
  (aiohttp on asyncio in one thread, as vLLM's benchmark client; each sends its next request, or its
  conversation's next turn, when the last one ends); time to first token and inter-token latency are measured at
  the client, from sending the request (ITL: between streamed chunks; with speculative decoding a chunk may carry
  several tokens); the clients share the machine; the prefix cache's counters are read from /metrics before and
  after the timed pass;
- static: `model.generate` on the same requests in arrival order, `--max-slots` at a time, each batch left-padded
  to its longest prompt and run to its longest output (a static batch ends with its longest request; only each
  request's own tokens count); compilation excluded (every batch shape runs once before the timed pass); static
  and reference replay the prompts ours sent in the same repeat (multi-turn: ours' answers in them);
- reference: Transformers' `init_continuous_batching` manager (its default config; one warm-up request first),
  each request with its own `max_new_tokens`: `--clients` requests in flight, the next added in arrival order as
  one finishes (the closed loop our clients run; default), or with `--reference-arrival all` every request added
  at once (`generate_batch`'s way: run ours with `--clients` = `--requests` to compare at equal arrival).
Prints tokens/s (generated tokens of every request / wall seconds of the whole pass), p50 / p99 TTFT and ITL,
for servers the prompt tokens, those served from the prefix cache, those computed (prompt - cached) and the hit
rate over the timed pass (server-side counters; speculative decoding's, where the server has any), and the ratios
ours / static and ours / reference. `--repeats N` times every side N times, alternated (ours,
static, reference, ours, ...; the server starts once), prints each repeat's line and the medians (ratios: the
median of each repeat's ratio): this machine's figures move 10-20% between passes. Greedy on every side.
`--huge-pages on` (default) runs all three processes with glibc's hugetlb tunable where it applies (as the
`moe-jax` command runs itself), `off` all three without. `--no-mixed-steps`: the server runs separate prefill
and decode programs (`moe-jax serve --no-mixed-steps`). Also printed: the decode-step ceiling of the ratio to
static batches for these requests, at equal batch width (static batch decode steps / (generated tokens / slots)):
continuous batching cannot beat it by scheduling alone when a step costs the same whatever rows it holds.

A/B of the server itself: `--baseline-tree DIR` (another checkout, e.g. `git worktree add /tmp/base COMMIT`)
and / or `--baseline-flags=FLAGS` (e.g. =--no-prefix-caching; ours gets `--server-flags=FLAGS`) start a second
`moe-jax serve`, of DIR or this tree, beside ours on the same checkpoint, and each repeat times both on the same
requests, alternating which goes first; printed: ours / baseline tokens/s, TTFT / ITL and prefill tokens computed
per repeat and their medians. `--api-key KEY` starts ours with the key and has the clients send it (the baseline
gets it only if it knows the flag: pass a tree that does, or compare the cost of the checks themselves).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
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

from serve_workloads import (  # noqa: E402
    DEFAULT_LENGTHS,
    OUTPUT_DISTRIBUTIONS,
    WORKLOADS,
    conversations,
    drive,
    longest,
    lookup_hits,
    requests_count,
    transcripts,
)

from moe_jax.cli.layout_flags import SCAN_CHOICES, decode_scan_layers  # noqa: E402
from moe_jax.cli.serve import parse_row_counts  # noqa: E402


def parse_range(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split("-"))
    return low, high


def build(workdir: Path, size: str, positions: int) -> None:
    """The checkpoint, its positions raised to `positions` where the workload needs more."""
    import torch
    import transformers

    config = dict(SIZES[size], eos_token_id=None, pad_token_id=None, bos_token_id=None)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], positions)
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


COPYING = 0.9   # held-out copy accuracy below which a --copy-steps checkpoint is refused


def train_to_copy(workdir: Path, steps: int) -> None:
    """Replace workdir/checkpoint with itself trained `steps` steps to copy (copy_model.py); refuse one that did
    not learn to."""
    from copy_model import train

    accuracy = train(workdir / "checkpoint", workdir / "copying", steps)
    if accuracy < COPYING:
        raise SystemExit(f"the checkpoint trained {steps} steps to copy reaches a copy accuracy of {accuracy:.3f} "
                         f"(< {COPYING}): raise --copy-steps, or use --size copy.")
    shutil.rmtree(workdir / "checkpoint")
    (workdir / "copying").rename(workdir / "checkpoint")
    print(f"# checkpoint trained {steps} steps to copy: held-out copy accuracy {accuracy:.3f}", flush=True)


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
def served(workdir: Path, warm_up: list[list[dict]], args, flags: list[str], tree: Path = ROOT,
           label: str = "ours", api_key: str | None = None):
    """`moe-jax serve` of checkout `tree` with extra `flags` on a free port, healthy and warmed up (the clients run
    `warm_up` once) -> (base URL, its process); terminated on exit."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "moe_jax.cli", "serve", "--model", str(workdir / "checkpoint"),
               "--port", str(port), "--max-slots", str(args.max_slots), "--page-size", "16",
               "--max-model-len", str(args.max_model_len), "--served-model-name", "bench",
               "--scan-layers", args.scan_layers, "--mixed-steps" if args.mixed_steps else "--no-mixed-steps"]
    if args.decode_rows:
        command += ["--decode-rows", ",".join(map(str, args.decode_rows))]
    if args.prefill_rows:
        command += ["--prefill-rows", str(args.prefill_rows)]
    if api_key:
        command += ["--api-key", api_key]
    log_path = workdir / f"server-{label}.log"
    log = open(log_path, "w")
    # `python -m` from the tree's root imports that tree's moe_jax first, whatever is installed.
    server = subprocess.Popen(command + flags, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=args.environ)
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
                log.flush()   # the log goes with the work directory: its end in the error
                raise RuntimeError(f"the {label} server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        drive(base, warm_up, args.clients, api_key)   # the server's first steps and the clients' connections warmed
        yield base, server
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def run_ours(base: str, server: subprocess.Popen, convs: list[list[dict]], args, api_key: str | None = None) -> dict:
    """One timed pass of the clients against the running server."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    before = metric_values(httpx.get(f"{base}/metrics", timeout=10, headers=headers).text)
    start, client_cpu, server_cpu = time.perf_counter(), time.process_time(), cpu_seconds(server.pid)
    results = drive(base, convs, args.clients, api_key)
    seconds = time.perf_counter() - start
    client_cpu, server_cpu = time.process_time() - client_cpu, cpu_seconds(server.pid) - server_cpu
    text = httpx.get(f"{base}/metrics", timeout=10, headers=headers).text
    after, kinds = metric_values(text), metric_kinds(text)
    wrong = [i for i, got in enumerate(results) if got["tokens"] != got["max_tokens"]
             or len(got["answer"]) != got["max_tokens"]]
    if wrong:
        raise RuntimeError(f"requests {wrong[:5]} got the wrong number of tokens")
    out = summary(sum(r["tokens"] for r in results), seconds, [r["ttft"] for r in results],
                  [gap for r in results for gap in r["gaps"]])
    out["cpu_seconds"] = {"clients": client_cpu, "server": server_cpu}
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    out["steps"] = {kind: int(delta[f"moe_jax_{kind}_steps_total"]) for kind in ("prefill", "decode", "mixed")}
    prompt = delta.get("moe_jax_prompt_tokens_total", float("nan"))
    cached = delta.get("moe_jax_prompt_tokens_cached_total", float("nan"))
    out["cache"] = {"prompt": prompt, "cached": cached, "computed": prompt - cached,
                    "hit_rate": cached / prompt if prompt else float("nan")}
    # Speculative decoding's metrics (none where the server does not speculate): counters over the pass, gauges
    # (the acceptance rate since the start) as they stand after it; the acceptance over the pass from the counters.
    spec = out["speculative"] = {name: delta[name] if kinds.get(name.split("{")[0]) == "counter" else after[name]
                                 for name in after if "spec" in name or "verify" in name}
    if spec.get("moe_jax_spec_draft_tokens_total"):
        spec["accepted / draft tokens over the pass"] = (spec["moe_jax_spec_accepted_tokens_total"]
                                                         / spec["moe_jax_spec_draft_tokens_total"])
    out["prompt_lookup"] = lookup_hits(results)
    out["transcripts"] = transcripts(convs, results)
    return out


def metric_values(metrics: str) -> dict[str, float]:
    """The samples of a /metrics text whose labels hold no space: name{labels} -> value."""
    return {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
            if line and not line.startswith("#") and len(line.split()) == 2}


def metric_kinds(metrics: str) -> dict[str, str]:
    """Metric name -> its # TYPE (counter, gauge, summary...)."""
    return {line.split()[2]: line.split()[3] for line in metrics.splitlines()
            if line.startswith("# TYPE ") and len(line.split()) == 4}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used, all its threads (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    """Transformers' CB manager on the conversations our clients sent (one-turn ones: plain requests): `clients`
    conversations in flight at a time (a conversation's next turn added as its last one finishes, the next
    conversation, in arrival order, as one ends: the closed loop our clients run), or every conversation at once
    (None: `generate_batch`'s way). Times to first token count from each request's adding."""
    import torch
    import transformers

    plan = json.loads((workdir / "conversations.json").read_text())
    convs = plan["conversations"]
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    in_flight = len(convs) if clients is None else clients
    with torch.no_grad():
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        warm = manager.add_request(plan["warm_up"], max_new_tokens=4, record_timestamps=True)
        while not (manager.get_result(warm, timeout=60) or _Never).is_finished():
            pass
        start = time.perf_counter()
        added, turn_of, finished, started = {}, {}, {}, 0

        def add(conv: int, turn: int) -> None:
            r = convs[conv][turn]
            added_at = time.perf_counter()
            request_id = manager.add_request(r["prompt"], max_new_tokens=r["max_tokens"], record_timestamps=True)
            added[request_id], turn_of[request_id] = added_at, (conv, turn)

        while started < min(in_flight, len(convs)):
            add(started, 0)
            started += 1
        while len(finished) < len(added) or started < len(convs):
            result = manager.get_result(timeout=600)
            if result is not None and result.is_finished():
                finished[result.request_id] = result
                conv, turn = turn_of[result.request_id]
                if turn + 1 < len(convs[conv]):
                    add(conv, turn + 1)
                elif started < len(convs):
                    add(started, 0)
                    started += 1
        seconds = time.perf_counter() - start
        manager.stop(block=True)
    outputs = list(finished.values())
    tokens = sum(len(o.generated_tokens) for o in outputs)
    ttft = [o.timestamps[0] - added[o.request_id] for o in outputs if o.timestamps]
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
                   "itl": {q: median_of(name, "itl", q) for q in ("p50", "p99")},
                   **({"cache": {k: median_of(name, "cache", k) for k in passes[0][name]["cache"]}}
                      if "cache" in passes[0][name] else {})}
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
    parser.add_argument("--workload", choices=WORKLOADS, default="random",
                        help="what the requests look like (serve_workloads.py): random prompts, one shared system "
                             "prompt, multi-turn conversations, or code edits (for n-gram speculation)")
    parser.add_argument("--prompt", type=parse_range, default=None,
                        help="prompt lengths, LOW-HIGH (shared-prefix: the question after the system prompt; "
                             "multi-turn: each user message; code-edit: the code); default per workload: "
                             + ", ".join(f"{w} {p[0]}-{p[1]}" for w, (p, _) in DEFAULT_LENGTHS.items()))
    parser.add_argument("--output", type=parse_range, default=None,
                        help="output lengths, LOW-HIGH; default per workload: "
                             + ", ".join(f"{w} {o[0]}-{o[1]}" for w, (_, o) in DEFAULT_LENGTHS.items()))
    parser.add_argument("--system-tokens", type=int, default=1024, help="shared-prefix: the system prompt's tokens")
    parser.add_argument("--turns", type=int, default=4,
                        help="multi-turn: turns per conversation (--requests / TURNS conversations)")
    parser.add_argument("--server-flags", default="",
                        help="extra `moe-jax serve` flags for ours, e.g. --server-flags=\"--speculative ngram "
                             "--num-speculative-tokens 4\" (with '=': the value starts with a dash)")
    parser.add_argument("--baseline-flags", default=None,
                        help="start a baseline server beside ours (this tree, or --baseline-tree) with these extra "
                             "flags instead of --server-flags, e.g. --baseline-flags=--no-prefix-caching")
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
                        help="another checkout whose `moe-jax serve` runs beside ours, alternated with it each repeat "
                             "(its flags: --baseline-flags, or else --server-flags)")
    parser.add_argument("--skip-static", action="store_true", help="do not time static generate batches")
    parser.add_argument("--copy-steps", type=int, default=0,
                        help="first train the checkpoint this many steps to copy what it has seen (copy_model.py; "
                             "with --size copy, which learns it in about 100): code-edit answers then copy their "
                             "file, as a code model's do (default 0: random weights)")
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
    args.prompt = args.prompt or DEFAULT_LENGTHS[args.workload][0]
    args.output = args.output or DEFAULT_LENGTHS[args.workload][1]

    def workload(pass_index: int) -> list[list[dict]]:
        return conversations(args.workload, args.requests, args.prompt, args.output, SIZES[args.size]["vocab_size"],
                             args.seed, pass_index, output_distribution=args.output_distribution,
                             system_tokens=args.system_tokens, turns=args.turns)

    warm_up, first = workload(-1)[:args.clients], workload(0)
    args.max_model_len = longest(first) + 1   # every pass has the same lengths
    with_baseline = args.baseline_tree is not None or args.baseline_flags is not None
    baseline_flags = shlex.split(args.server_flags if args.baseline_flags is None else args.baseline_flags)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        build(workdir, args.size, args.max_model_len)
        if args.copy_steps:
            train_to_copy(workdir, args.copy_steps)
        print(f"# workload {args.workload}: {requests_count(first)} requests"
              + (f" in {len(first)} conversations of {args.turns} turns" if args.workload == "multi-turn" else "")
              + (f", a {args.system_tokens}-token system prompt" if args.workload == "shared-prefix" else "")
              + f", prompts {args.prompt[0]}-{args.prompt[1]}, outputs {args.output[0]}-{args.output[1]} tokens "
              f"({args.output_distribution}); max model len {args.max_model_len}; {args.clients} clients, "
              f"{args.max_slots} slots; ours' flags {args.server_flags!r}"
              + (f", the baseline's {shlex.join(baseline_flags)!r} from {args.baseline_tree or 'this tree'}"
                 if with_baseline else "") + "; "
              f"Transformers' CB: {'every request at once' if args.reference_arrival == 'all' else 'as many in flight'}; "
              f"size {args.size}; scan layers {args.scan_layers}; mixed steps {'on' if args.mixed_steps else 'off'}; "
              f"decode rows {','.join(map(str, args.decode_rows)) if args.decode_rows else 'the server default'}; "
              f"prefill rows {args.prefill_rows or 'the server default'}; "
              f"{host_memory}; {os.cpu_count()} CPUs", flush=True)
        print(f"# decode-step ceiling of ours / static at {args.max_slots} slots: "
              f"{static_ceiling([t for conv in first for t in conv], args.max_slots):.2f}x", flush=True)
        passes = []
        with contextlib.ExitStack() as servers:
            sides = [("moe_jax serve", servers.enter_context(
                served(workdir, warm_up, args, shlex.split(args.server_flags), api_key=args.api_key)), args.api_key)]
            if with_baseline:
                sides.append(("baseline serve", servers.enter_context(
                    served(workdir, warm_up, args, baseline_flags, tree=(args.baseline_tree or ROOT).resolve(),
                           label="baseline")), None))
            for repeat in range(args.repeats):
                convs, rows = first if repeat == 0 else workload(repeat), {}
                for name, server, api_key in sides[::-1] if repeat % 2 else sides:   # alternate which goes first
                    rows[name] = run_ours(*server, convs, args, api_key)
                plan = rows["moe_jax serve"]["transcripts"]   # the prompts ours sent, for the other sides
                for row in rows.values():
                    row.pop("transcripts")
                (workdir / "requests.json").write_text(json.dumps([turn for conv in plan for turn in conv]))
                (workdir / "conversations.json").write_text(json.dumps(
                    {"warm_up": warm_up[0][0]["user"], "conversations": plan}))
                rows = {"moe_jax serve": rows.pop("moe_jax serve"), **rows}
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
    print(f"{'':18}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}"
          f"{'prompt':>9}{'cached':>9}{'computed':>9}{'hit rate':>9}")
    for name, row in rows.items():
        cache = row.get("cache")
        print(f"{name:18}{row['tokens_per_s']:10.1f}{row['ttft']['p50']:10.3f}{row['ttft']['p99']:10.3f}"
              f"{row['itl']['p50'] * 1e3:9.1f}m{row['itl']['p99'] * 1e3:9.1f}m"
              + (f"{cache['prompt']:9.0f}{cache['cached']:9.0f}{cache['computed']:9.0f}{cache['hit_rate']:9.3f}"
                 if cache else ""))
    cpu = passes[-1]["moe_jax serve"]["cpu_seconds"]
    print(f"# during our {'last ' if len(passes) > 1 else ''}pass ({passes[-1]['moe_jax serve']['seconds']:.1f} s on "
          f"{os.cpu_count()} CPUs): server process {cpu['server']:.1f} CPU s, clients {cpu['clients']:.1f} CPU s; "
          f"server steps {passes[-1]['moe_jax serve']['steps']}")
    each = [ratios(rows) for rows in passes]
    for name in each[0]:
        print(f"ours / {name}: {statistics.median(r[name] for r in each):.2f}x throughput")
    for other in ("baseline serve", "transformers CB"):
        if other not in passes[0]:
            continue
        for what in ("ttft", "itl"):
            for q in ("p50", "p99"):
                ratio = statistics.median(rows["moe_jax serve"][what][q] / rows[other][what][q] for rows in passes)
                print(f"ours / {other}: {ratio:.3f}x {what.upper()} {q}")
        if "cache" in passes[0][other]:
            ratio = statistics.median(rows["moe_jax serve"]["cache"]["computed"] / rows[other]["cache"]["computed"]
                                      for rows in passes)
            print(f"ours / {other}: {ratio:.3f}x prefill tokens computed")
    for name, row in passes[-1].items():
        lookup = row.get("prompt_lookup")
        if lookup and (args.workload == "code-edit" or any(row.get("speculative", {}).values())):
            print(f"# {name}'s answers, {'last ' if len(passes) > 1 else ''}pass: 3-gram prompt lookup would have "
                  f"proposed a token at {lookup['proposed']:.1%} of the {lookup['tokens']} generated tokens, "
                  f"{lookup['right']:.1%} of them right")
        if any(row.get("speculative", {}).values()):
            print(f"# {name}'s speculative decoding metrics over its {'last ' if len(passes) > 1 else ''}pass: "
                  + ", ".join(f"{metric} {value:g}" for metric, value in row["speculative"].items()))
    print(json.dumps(passes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
