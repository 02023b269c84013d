#!/usr/bin/env python
"""Mutation check: plant plausible slips, one at a time, in a copy of the repository and run the tests that cover
the slipped module there. A slip the tests pass is a survivor: a behaviour no test pins.

    python scripts/checks/mutation.py                          # every slip
    python scripts/checks/mutation.py --module inference       # moe_jax/inference/* only (a name or its prefix)
    python scripts/checks/mutation.py --module training.evaluation --module distributed
    python scripts/checks/mutation.py --list                   # the slips and their tests; runs nothing
    python scripts/checks/mutation.py -j 2                     # two copies, two slips at a time

Run it before resolving an issue that touches these modules (it is not part of CI; its figures and run time:
docs/benchmarks.md, "Correctness grids"). The working tree is never modified: each worker copies the repository
(without .git and .venv) to a temporary directory and plants, runs and restores there, with that copy first on
PYTHONPATH (checked before anything runs). Each test file first runs once unmodified (`--no-baseline` skips that):
a slip whose tests already fail cannot be judged and is reported as an error, as is a slip whose original text is
not found exactly once (the code moved: update the entry). pytest runs with -x -q and tests/conftest.py's own
environment (8 virtual CPU devices, heavy tests deselected); a run past `--timeout` counts as caught (the suite
would hang on it) and is marked so.

Each entry: the module, a one-line description, the edits (file, exact original text, replacement) and the test
files to run, most specific first (with -x the first failure ends the run). Add a slip for each behaviour a new
test pins, and keep the originals current when the code changes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPY_IGNORED = (".git", ".venv", ".ci-venv", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", "build",
                "dist", "out", ".whl")


@dataclass(frozen=True)
class Edit:
    path: str          # relative to the repository root
    original: str      # must occur exactly once in the file
    replacement: str


@dataclass(frozen=True)
class Slip:
    module: str                # "inference.continuous": moe_jax/inference/continuous.py
    description: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]

    @property
    def area(self) -> str:
        return self.module.split(".")[0]


def module_path(module: str) -> str:
    return "moe_jax/" + module.replace(".", "/") + ".py"


# The test files each module's slips run (most specific first).
TESTS = {
    "serving.protocol": ("tests/serving/test_protocol.py", "tests/serving/test_server.py"),
    "serving.metrics": ("tests/serving/test_latency_metrics.py",),
    "lora.targets": ("tests/lora/test_targets.py",),
    "inference.requests": ("tests/inference/test_scheduler.py", "tests/inference/test_continuous.py"),
    "inference.scheduler": ("tests/inference/test_scheduler.py", "tests/inference/test_continuous.py"),
    "inference.step_inputs": ("tests/inference/test_continuous.py",),
    "inference.step_programs": ("tests/inference/test_continuous.py",),
    "kv_cache.paged": ("tests/kv_cache/test_paged.py", "tests/inference/test_continuous.py"),
    "kv_cache.page_book": ("tests/kv_cache/test_page_book.py", "tests/kv_cache/test_paged.py",
                           "tests/inference/test_continuous.py"),
    "inference.sampling": ("tests/inference/test_sampling.py", "tests/inference/test_continuous.py",
                           "tests/inference/test_generate.py"),
    "inference.generate": ("tests/inference/test_generate.py",),
    "inference.manager": ("tests/inference/test_continuous.py",),
    "training.evaluation": ("tests/training/test_evaluation.py",),
    "training.loop": ("tests/training/test_loop_records.py", "tests/training/test_router_health.py"),
    "training.router_health": ("tests/training/test_router_health.py",),
    "training.data": ("tests/training/test_data.py", "tests/training/test_evaluation.py"),
    "training.corpus": ("tests/training/test_evaluation.py", "tests/training/test_corpus.py"),
    "models.pipeline": ("tests/models/test_pipeline.py",),
    "distributed.capacity": ("tests/distributed/test_capacity.py",),
    "target_compile.host_placement": ("tests/target_compile/test_host_placement.py",),
    "training.step": ("tests/training/test_rebalance.py",),
    "cli.launch": ("tests/test_launch.py",),
    "distributed.eplb": ("tests/distributed/test_eplb.py", "tests/training/test_rebalance.py"),
    "distributed.placement_search": ("tests/distributed/test_placement_search.py", "tests/training/test_rebalance.py"),
    "training.load_probe": ("tests/training/test_load_probe.py",),
    "training.memory": ("tests/test_cli.py",),
    "planning.estimate": ("tests/planning/test_plan_arithmetic.py", "tests/planning/test_search.py"),
    "training.preemption": ("tests/training/test_train_job.py", "tests/training/test_checkpoints.py"),
    "inference.speculative": ("tests/inference/test_speculative.py",),
    "inference.prefix_cache": ("tests/inference/test_prefix_caching.py",),
}


def slip(module: str, original: str, replacement: str, description: str, tests: tuple[str, ...] | None = None,
         *more: Edit) -> Slip:
    """A slip of one edit in `module` (plus `more` edits elsewhere), run against TESTS[module] unless `tests`."""
    return Slip(module, description, (Edit(module_path(module), original, replacement), *more),
                tests or TESTS[module])


SLIPS: list[Slip] = [
    # ---- serving: the OpenAI server's request fields ---------------------------------------------------------
    slip("serving.protocol", "return DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens",
         "return max_tokens", 'completions: "max_tokens": null generates to the context, not the default 16'),
    slip("serving.protocol",
         "return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens",
         "return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens",
         "chat: max_tokens wins over max_completion_tokens"),
    slip("serving.metrics", "self.gap_count += len(gaps)", "self.gap_count += 1",
         "the inter-token latency summary counts one per request's gaps, not each gap"),

    # ---- lora: which weights an adapter targets ------------------------------------------------------------------
    slip("lora.targets", 'return name == target or name.endswith("." + target)', "return name.endswith(target)",
         'a target_modules entry matches any name tail ("proj" adapts every *_proj), not whole segments'),

    # ---- inference: continuous batching ------------------------------------------------------------------------
    slip("inference.requests", "return -(-self.max_model_len // self.page_size)",
         "return self.max_model_len // self.page_size",
         "pages per slot by floor division (max_model_len not a whole number of pages)"),
    slip("inference.scheduler",
         "tokens = min(len(request.prompt_ids) + request.settings.max_new_tokens, self.config.max_model_len)",
         "tokens = len(request.prompt_ids) + request.settings.max_new_tokens",
         "admission asks pages for more tokens than the context holds"),
    slip("inference.scheduler",
         "elif len(request.prompt_ids) + len(output.generated_tokens) >= self.config.max_model_len:",
         "elif len(request.prompt_ids) + len(output.generated_tokens) > self.config.max_model_len:",
         "the context end compared with > (one token past max_model_len)"),
    slip("inference.step_inputs", 'floats = np.stack([inputs["temperature"], inputs["top_p"]], axis=1)',
         'floats = np.stack([inputs["top_p"], inputs["temperature"]], axis=1)',
         "temperature and top_p swapped in the step's float inputs"),
    slip("inference.scheduler", "write_sampling(inputs, row, request.settings, len(request.output.generated_tokens),",
         "write_sampling(inputs, row, request.settings, len(request.prompt_ids),",
         "every token of a request drawn with one key (the counter from the prompt length)"),
    slip("inference.step_inputs", 'inputs["top_k"][row] = settings.top_k or 0', 'inputs["top_k"][row] = 0',
         "a request's top_k never reaches the step"),
    slip("inference.step_inputs", 'inputs["seeds"][row] = settings.seed % (1 << 32)', 'inputs["seeds"][row] = 0',
         "every request samples with seed 0"),
    slip("inference.scheduler",
         'inputs["lengths"][row] = len(request.prompt_ids) + len(request.output.generated_tokens) - 1',
         'inputs["lengths"][row] = len(request.prompt_ids) + len(request.output.generated_tokens)',
         "a decode row's cache length one past its last token"),
    slip("inference.scheduler", "elif len(output.generated_tokens) >= s.max_new_tokens:",
         "elif len(output.generated_tokens) > s.max_new_tokens:", "one token more than max_new_tokens"),
    slip("inference.step_programs", "return min(1 << max(needed - 1, 0).bit_length(), self.pages_per_slot)",
         "return min(1 << max(needed - 2, 0).bit_length(), self.pages_per_slot)",
         "page-table width rounded below the pages a step's longest row needs"),
    slip("inference.scheduler", "if len(prompt) >= limit:", "if len(prompt) > limit:",
         "a prompt filling the whole context accepted (no room for a new token)"),
    slip("inference.scheduler", "self.book.release(request.group, request.pages)",
         "self.book.release(request.group, request.pages[1:])", "a finished request keeps its first page"),

    # ---- inference: the page book --------------------------------------------------------------------------------
    slip("kv_cache.page_book", "if count < 0 or count > available:", "if count < 0 or count >= available:",
         "a request needing exactly the free pages waits"),
    slip("kv_cache.page_book", "return -(-tokens // self.page_size)", "return tokens // self.page_size",
         "pages for a request by floor division"),
    slip("kv_cache.page_book", "self._free = [list(range(pages_per_group - 1, -1, -1)) for _ in range(groups)]",
         "self._free = [list(range(pages_per_group - 1, -1, -1))] * groups",
         "every data-parallel group shares one free list"),
    slip("kv_cache.page_book",
         "if any(page not in holders for page in pages) or len(set(pages)) != len(pages):",
         "if any(page not in holders for page in pages):", "a page released twice in one call goes unnoticed"),
    slip("kv_cache.paged", "* jnp.dtype(dtype or model.dtype).itemsize", "* 2",
         "pool bytes assume 2-byte entries"),

    # ---- inference: next-token rules -----------------------------------------------------------------------------
    slip("inference.sampling", "return jnp.where(logits < kth, -jnp.inf, logits)",
         "return jnp.where(logits <= kth, -jnp.inf, logits)", "top-k keeps k - 1 tokens"),
    slip("inference.sampling", "drop_sorted = (cumulative <= (1 - top_p)[:, None]).at[:, -1].set(False)",
         "drop_sorted = (cumulative <= (1 - top_p)[:, None]).at[:, 0].set(False)",
         "top-p always keeps the least likely token instead of the most likely"),
    slip("inference.sampling", "logits = jnp.where(top_k[:, None] > 0, _drop_below(logits, kth), logits)",
         "logits = jnp.where(top_k[:, None] >= 0, _drop_below(logits, kth), logits)",
         "per-row top_k=0 (off) keeps only the top token"),
    slip("inference.sampling", "return jnp.where(do_sample, sampled, greedy)",
         "return jnp.where(do_sample, greedy, sampled)", "per-row greedy and sampled rows swapped"),
    slip("inference.sampling", "return jax.random.categorical(key, warp(logits, sampling), axis=-1).astype(jnp.int32)",
         "return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)",
         "generate samples the unwarped logits"),

    # ---- inference: generate -------------------------------------------------------------------------------------
    slip("inference.generate", "jax.random.fold_in(base_key, step + 1),", "jax.random.fold_in(base_key, step),",
         "generate's decode step i draws with token i - 1's key index"),
    slip("inference.generate", "chosen = jnp.where(finished, pad, chosen)", "chosen = jnp.where(finished, chosen, pad)",
         "finished and running rows' tokens swapped"),
    slip("inference.generate", "done |= np.isin(current, eos_ids)", "done = np.isin(current, eos_ids)",
         "a row that finished earlier is forgotten by the host loop"),

    # ---- inference: the manager ------------------------------------------------------------------------------------
    slip("inference.manager", "eos = tuple(token for token in eos if token >= 0)",
         "eos = tuple(token for token in eos if token > 0)", "an EOS id of 0 filtered out as no EOS"),
    slip("inference.manager", "eos = config.eos_token_id if eos_token_id is None else eos_tuple(eos_token_id)",
         "eos = config.eos_token_id", "a call's eos_token_id ignored"),

    # ---- training: the loop's records and the router-collapse warning ------------------------------------------------
    slip("training.loop", "pending.append(_InFlight(next_index, state.capacity, metrics, next_index in overflowed))",
         "pending.append(_InFlight(next_index, state.capacity, metrics, next_index in overflowed "
         "or next_index - 1 in overflowed))",
         "the step queued behind an overflow is marked replayed too (records disagree with the replays count)"),
    slip("training.loop", "            self.router_watch(record)\n", "",
         "the loop never hands its records to the router-collapse watch"),
    slip("training.router_health", "if self.streaks[layer] >= self.steps:", "if self.streaks[layer] > self.steps:",
         "the collapse warning comes one step after the stated number of steps"),

    # ---- training: evaluation, batch sources, corpora ----------------------------------------------------------------
    slip("training.evaluation",
         'batch.get("attention_mask") if segments is None else segments,',
         'batch.get("attention_mask"),', "the eval loss ignores segment_ids (predictions across documents counted)"),
    slip("training.evaluation",
         'batch.get("attention_mask") if segments is None else segments,',
         "None if segments is None else segments,", "the eval loss ignores attention_mask (padding counted)"),
    slip("training.evaluation", 'segment_ids=segments, positions=batch.get("positions"), adapter=adapter)',
         'segment_ids=None, positions=batch.get("positions"), adapter=adapter)',
         "packed rows evaluated with attention across documents"),
    slip("training.evaluation", "total, tokens = total + ce_sum, tokens + predicted",
         "total, tokens = ce_sum, tokens + predicted", "the eval loss keeps only the last batch's sum"),
    slip("training.evaluation", 'count = max(rows // getattr(data, "rows_per_batch", data.batch_size), 1)',
         'count = max(-(-rows // getattr(data, "rows_per_batch", data.batch_size)), 1)',
         "one pass counts a partial last batch (it wraps into the next epoch)"),
    slip("training.data", "rows = (index * self.batch_size + np.asarray(rows)) % self.num_sequences",
         "rows = (index + np.asarray(rows)) % self.num_sequences", "batch i starts at row i, not i * B"),
    slip("training.data", "rng = np.random.default_rng((self.seed, index))", "rng = np.random.default_rng(self.seed)",
         "every synthetic batch is the same"),
    slip("training.corpus", "segments = np.where(document > 0, np.cumsum(starts, axis=1), 0).astype(np.int32)",
         "segments = np.cumsum(starts, axis=1).astype(np.int32)", "a packed row's padding numbered as a document"),
    slip("training.corpus", "return -(-self.total_tokens // self.seq_len) if self.pack else len(self.documents)",
         "return self.total_tokens // self.seq_len if self.pack else len(self.documents)",
         "the packed corpus drops its last, partly filled row"),
    slip("training.corpus", "ids[row, :len(piece)], mask[row, :len(piece)] = piece, 1",
         "ids[row, :len(piece)], mask[row, :] = piece, 1", "an unpacked row's padding marked real"),
    slip("training.corpus", "order = np.random.default_rng((self.seed, epoch)).permutation(len(self.documents))",
         "order = np.random.default_rng(self.seed).permutation(len(self.documents))",
         "every epoch shuffles the documents the same way"),

    # ---- models: pipeline stages -------------------------------------------------------------------------------------
    slip("models.pipeline", "layer_numbers[stage, repeat, :stop - start] = np.arange(start, stop)",
         "layer_numbers[stage, repeat, :stop - start] = np.arange(stop - start)",
         "stage layer numbers restart at 0 (per-layer randomness reuses stage 0's keys)"),
    slip("models.pipeline", "iterations = work_items + stages - 1", "iterations = work_items + stages - 2",
         "one pipeline iteration too few (the last microbatch never leaves the last stage)"),
    slip("models.pipeline", "jnp.roll(out, 1, axis=0)", "jnp.roll(out, -1, axis=0)",
         "stages hand their output to the previous stage (the same as the next at pp_size=2)"),
    slip("models.pipeline", "kept = _where(counted, slot_sums, jax.tree.map(jnp.zeros_like, slot_sums))",
         "kept = slot_sums", "bubble iterations' router sums reach the aux loss"),

    # ---- distributed: the capacity ladder -----------------------------------------------------------------------------
    slip("distributed.capacity", "if lower is None or required > lower + 1e-6:",
         "if lower is None or required >= lower:", "a call needing exactly the lower rung never lets it step down"),
    slip("distributed.capacity", "if calm_calls >= self.patience:", "if calm_calls > self.patience:",
         "one calm call more than patience before stepping down"),
    slip("distributed.capacity", "rung_above = self.ladder[self.ladder.index(self.check(ran_at)) + 1]",
         "rung_above = self.ladder[self.ladder.index(self.check(ran_at))]",
         "a replay after a drop may run at the capacity that dropped"),
    slip("distributed.capacity", "index = jnp.minimum(jnp.sum(busiest_rows > rows), len(ladder) - 1)",
         "index = jnp.minimum(jnp.sum(busiest_rows >= rows), len(ladder) - 1)",
         "a call filling a rung's buffers exactly requires the next rung"),

    # ---- target compile: host offload written for abstract GPUs --------------------------------------------------
    slip("target_compile.host_placement", 'moved = _placement(argument, "device", ir.InsertionPoint(start))',
         'moved = _placement(argument, HOST_MEMORY, ir.InsertionPoint(start))',
         "an offloaded argument is never moved to the device (a second move to the host)"),
    slip("target_compile.host_placement", "and parameter_sharding_of(path[1:], leaf, names, shapes, False))",
         ")", "the optimizer's replicated count is declared in host memory with the moments"),
    slip("target_compile.host_placement", "module = ir.Module.parse(original.operation.get_asm(enable_debug_info=True))",
         "module = original", "the lowered program JAX caches is patched in place, not a copy"),

    # ---- training: the expert load window, the launcher's signals ------------------------------------------------
    slip("training.step", "state.expert_load_window * jnp.where(applied, LOAD_WINDOW_DECAY, 1.0)",
         "state.expert_load_window", "the load window sums its steps (the latest no longer weighs most)"),
    slip("cli.launch", "            if received and child.index not in forwarded:\n                forward(child, received[0])\n",
         "", "a signal handled while a process starts never reaches it"),

    # ---- expert placement, the train state's memory, the planner's ranking, preemption ---------------------------
    slip("distributed.eplb", "takes = busiest[1] < busiest[0] * (1 - 1e-9)", "takes = busiest[1] <= busiest[0]",
         "a re-placement that ties the placement in force moves slots anyway"),
    slip("distributed.eplb", "replica = jnp.remainder(positions[:, None], count[ids])", "replica = jnp.zeros_like(ids)",
         "every token of a replicated expert goes to its first replica"),
    slip("distributed.eplb", "return where[ids, jnp.remainder(turn + block, count[ids])].astype(jnp.int32)",
         "return where[ids, jnp.remainder(block, count[ids])].astype(jnp.int32)",
         "every pair of an expert in a token shard goes to one of its replicas"),
    slip("distributed.placement_search",
         "return np.stack([expected_rank_load(placement, load, ep_size).max(1) for load in loads]).max(0)",
         "return np.stack([expected_rank_load(placement, load, ep_size).max(1) for load in loads]).mean(0)",
         "a placement for several loads judged by their mean busiest share, not the worst"),
    slip("training.loop", "        if self.rebalance_every > 1:\n", "        if True:\n",
         "the window joins the next batch's load when that batch's step is the only one before the next re-placement",
         ("tests/training/test_rebalance.py",)),
    slip("training.load_probe", 'return total + terms["expert_load"], None', 'return terms["expert_load"], None',
         "the next batch's load is its last micro-batch's"),
    slip("training.memory", "host = (parameters if kinds[0] else 0) + (memory.per_device[\"optimizer state\"] if kinds[1] else 0)",
         "host = (parameters if kinds[1] else 0) + (memory.per_device[\"optimizer state\"] if kinds[0] else 0)",
         "--offload-optimizer counts the parameters in host memory, and the other way round"),
    slip("planning.estimate", "return (0, self.step_seconds, self.memory.total)",
         "return (0, self.memory.total, self.step_seconds)", "fitting layouts ranked by memory, not step time"),
    slip("training.preemption", "        return self.signal_name is not None\n", "        return False\n",
         "a one-process run never stops at the step boundary after a signal"),

    # ---- serving: speculative decoding's acceptance, prefix caching's keys ---------------------------------------
    slip("inference.speculative", "accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1)",
         "accepted = jnp.sum(accept, axis=1)", "drafts after a rejected one still accepted"),
    slip("inference.speculative", "tokens = jnp.where(jnp.arange(length)[None, :] <= accepted[:, None], drawn, -1)",
         "tokens = jnp.where(jnp.arange(length)[None, :] < accepted[:, None], drawn, -1)",
         "the target's own token after the accepted drafts dropped"),
    slip("inference.prefix_cache", "reusable = (len(request.prompt_ids) - 1) // self.page_size",
         "reusable = len(request.prompt_ids) // self.page_size",
         "a prompt whose last token ends a page takes that page from the cache (nothing left to prefill)"),
    slip("inference.prefix_cache", 'f"\\x01adapter {adapter}" if adapter else None,', "None,",
         "one adapter's cached pages served to another adapter's requests"),
]


# ---- checking the entries against the code --------------------------------------------------------------------------
def problems(entry: Slip, root: Path) -> list[str]:
    """Why `entry` cannot be planted in the tree at `root` (empty: it can)."""
    found = []
    for edit in entry.edits:
        path = root / edit.path
        if not path.is_file():
            found.append(f"{edit.path}: no such file")
            continue
        count = path.read_text().count(edit.original)
        if count != 1:
            found.append(f"{edit.path}: the original text occurs {count} times, not once "
                         f"({'the code moved: update the entry' if count == 0 else 'make it longer'}): "
                         f"{edit.original!r}")
    found += [f"{test}: no such test file" for test in entry.tests if not (root / test).is_file()]
    return found


def chosen_slips(modules: list[str] | None) -> list[Slip]:
    if not modules:
        return list(SLIPS)
    names = [name for value in modules for name in value.split(",") if name]
    picked = [entry for entry in SLIPS
              if any(entry.module == name or entry.module.startswith(name + ".") for name in names)]
    if not picked:
        known = sorted({entry.module for entry in SLIPS})
        raise SystemExit(f"--module {', '.join(names)}: no slip there; modules: {', '.join(known)}")
    return picked


# ---- one worker's copy of the repository ------------------------------------------------------------------------------
def pytest_environment(copy: Path) -> dict[str, str]:
    """The environment of the pytest runs: this one, the copy first on PYTHONPATH, no bytecode written (a file
    restored in the same second as its slipped version, with the same size, would otherwise load the slipped
    bytecode), and glibc's huge pages for XLA:CPU's buffers as tests/conftest.py gives its subprocesses."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [environment.get("PYTHONPATH")])])
    environment["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.path.insert(0, str(ROOT))
    try:
        from moe_jax.host_memory import huge_page_tunables
    finally:
        sys.path.pop(0)
    tunables = huge_page_tunables(environment)
    if tunables is not None:
        environment["GLIBC_TUNABLES"] = tunables
    return environment


class Copy:
    """A copy of the repository where slips are planted and the tests run."""

    def __init__(self, directory: Path):
        self.root = directory / "repo"
        shutil.copytree(ROOT, self.root, ignore=shutil.ignore_patterns(*COPY_IGNORED), symlinks=True)
        self.environment = pytest_environment(self.root)
        imported = subprocess.run([sys.executable, "-c", "import moe_jax, converters; print(moe_jax.__file__); "
                                   "print(converters.__file__)"], cwd=self.root, env=self.environment,
                                  capture_output=True, text=True)
        paths = imported.stdout.split()
        if imported.returncode != 0 or len(paths) != 2 or not all(Path(p).is_relative_to(self.root) for p in paths):
            raise SystemExit(f"the copy's packages are not the ones imported there ({imported.stdout.strip()} "
                             f"{imported.stderr.strip()[-500:]}): the check would test the working tree instead.")

    def run(self, tests: tuple[str, ...], timeout: float) -> tuple[str, str, float]:
        """Run pytest on `tests` -> (outcome: "passed" / "failed" / "timeout" / "error", detail, seconds)."""
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *tests]
        start = time.monotonic()
        try:
            result = subprocess.run(command, cwd=self.root, env=self.environment, capture_output=True, text=True,
                                    timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", f"no result after {timeout:.0f} s", time.monotonic() - start
        seconds = time.monotonic() - start
        output = result.stdout + result.stderr
        if result.returncode == 0:
            return "passed", "", seconds
        if result.returncode in (1, 2):   # tests failed, or collection failed (an import error is caught too)
            failed = [line.split(" - ")[0].split(" ", 1)[1] for line in output.splitlines()
                      if line.startswith(("FAILED ", "ERROR "))]
            return "failed", failed[0] if failed else output.strip().splitlines()[-1], seconds
        return "error", f"pytest exited {result.returncode}: {output.strip()[-300:]}", seconds

    def plant(self, entry: Slip) -> dict[Path, tuple[str, tuple[int, int]]]:
        saved = {}
        for edit in entry.edits:
            path = self.root / edit.path
            if path not in saved:
                stat = path.stat()
                saved[path] = (path.read_text(), (stat.st_atime_ns, stat.st_mtime_ns))
            path.write_text(path.read_text().replace(edit.original, edit.replacement, 1))
        return saved

    @staticmethod
    def restore(saved: dict[Path, tuple[str, tuple[int, int]]]) -> None:
        for path, (text, times) in saved.items():
            path.write_text(text)
            os.utime(path, ns=times)


# ---- the run ----------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    entry: Slip
    outcome: str       # "caught", "survived", "error"
    detail: str
    seconds: float


def run_all(entries: list[Slip], workers: int, timeout: float, baseline: bool) -> list[Result]:
    results: list[Result] = []
    lock = threading.Lock()
    total = len(entries)
    with tempfile.TemporaryDirectory(prefix="moe_jax_mutation_") as scratch:
        copies = []
        for index in range(workers):
            (Path(scratch) / str(index)).mkdir()
            copies.append(Copy(Path(scratch) / str(index)))
        free = list(copies)

        def take() -> Copy:
            with lock:
                return free.pop()

        def give(copy: Copy) -> None:
            with lock:
                free.append(copy)

        failing: dict[str, str] = {}   # test file -> why it fails without any slip
        if baseline:
            def check(test: str) -> None:
                copy = take()
                try:
                    outcome, detail, seconds = copy.run((test,), timeout)
                finally:
                    give(copy)
                print(f"baseline  {outcome:8s} {test} ({seconds:.0f} s)", flush=True)
                if outcome != "passed":
                    failing[test] = f"{test} fails without any slip ({outcome}: {detail})"

            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(check, sorted({test for entry in entries for test in entry.tests})))

        def one(entry: Slip) -> Result:
            broken = [failing[test] for test in entry.tests if test in failing]
            if broken:
                result = Result(entry, "error", "; ".join(broken), 0.0)
            else:
                copy = take()
                try:
                    saved = copy.plant(entry)
                    try:
                        outcome, detail, seconds = copy.run(entry.tests, timeout)
                    finally:
                        copy.restore(saved)
                finally:
                    give(copy)
                verdict = {"passed": "survived", "failed": "caught", "timeout": "caught"}.get(outcome, "error")
                result = Result(entry, verdict, ("hangs: " if outcome == "timeout" else "") + detail, seconds)
            with lock:
                results.append(result)
                print(f"[{len(results):2d}/{total}] {result.outcome:8s} {entry.module:22s} {entry.description} "
                      f"({result.seconds:.0f} s{'; ' + result.detail if result.detail else ''})", flush=True)
            return result

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, entries))
    order = {id(entry): index for index, entry in enumerate(entries)}
    return sorted(results, key=lambda result: order[id(result.entry)])


def summary(results: list[Result], errors: list[tuple[Slip, list[str]]], seconds: float) -> str:
    lines = []
    survivors = [result for result in results if result.outcome == "survived"]
    if survivors:
        lines.append("\nSurvivors (no test fails with the slip planted):")
        for result in survivors:
            for edit in result.entry.edits:
                lines.append(f"  {result.entry.module}: {result.entry.description}\n"
                             f"      {edit.path}: {edit.original!r} -> {edit.replacement!r}")
    failed = [(result.entry, [result.detail]) for result in results if result.outcome == "error"] + errors
    if failed:
        lines.append("\nErrors (not judged):")
        for entry, reasons in failed:
            lines += [f"  {entry.module}: {entry.description}"] + [f"      {reason}" for reason in reasons]
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for result in results:
        if result.outcome == "error":
            continue
        for name in (result.entry.module, result.entry.area):
            counts[name][0] += result.outcome == "caught"
            counts[name][1] += 1
    lines.append("\nCaught / judged:")
    for name in sorted(counts, key=lambda name: (name.split(".")[0], "." in name, name)):
        caught, judged = counts[name]
        lines.append(f"  {'    ' if '.' in name else ''}{name:24s} {caught:3d} / {judged:<3d} {100 * caught / judged:5.1f}%")
    caught = sum(result.outcome == "caught" for result in results)
    judged = sum(result.outcome != "error" for result in results)
    lines.append(f"  {'all':24s} {caught:3d} / {judged:<3d} {100 * caught / max(judged, 1):5.1f}%"
                 f"   ({len(failed)} not judged; {seconds / 60:.1f} min wall time)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", action="append", metavar="NAME",
                        help="only the slips of this module or its prefix (inference, training.corpus, ...); "
                             "repeat or separate with commas")
    parser.add_argument("--list", action="store_true", help="list the slips and their tests, run nothing")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="copies and slips run at a time (default 1)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per pytest run (default 1200)")
    parser.add_argument("--no-baseline", action="store_true", help="skip running each slip's tests unmodified first")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"-j {args.jobs} must be >= 1")
    entries = chosen_slips(args.module)
    errors = [(entry, found) for entry in entries if (found := problems(entry, ROOT))]
    if args.list:
        for entry in entries:
            found = problems(entry, ROOT)
            print(f"{entry.module:22s} {entry.description}{'   [CANNOT PLANT]' if found else ''}")
            for edit in entry.edits:
                print(f"{'':22s}   {edit.path}: {edit.original!r} -> {edit.replacement!r}")
            print(f"{'':22s}   tests: {' '.join(entry.tests)}")
            for reason in found:
                print(f"{'':22s}   ! {reason}")
        print(f"{len(entries)} slips in {len({entry.module for entry in entries})} modules; {len(errors)} cannot be "
              "planted")
        return 1 if errors else 0
    for entry, reasons in errors:
        print(f"error    {entry.module:22s} {entry.description}: {'; '.join(reasons)}", flush=True)
    plantable = [entry for entry in entries if all(entry is not bad for bad, _ in errors)]
    start = time.monotonic()
    results = run_all(plantable, args.jobs, args.timeout, not args.no_baseline) if plantable else []
    print(summary(results, errors, time.monotonic() - start))
    return 0 if not errors and all(result.outcome == "caught" for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
