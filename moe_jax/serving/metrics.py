"""`/metrics` in Prometheus' text format: the manager's gauges and counters, and latency summaries.

    moe_jax_slots_in_use / _slots_total, moe_jax_pages_free / _pages_total, moe_jax_requests_waiting /
    _requests_running, moe_jax_requests_finished_total, moe_jax_generated_tokens_total,
    moe_jax_tokens_per_second (the last seconds), moe_jax_prefill_steps_total, moe_jax_decode_steps_total,
    moe_jax_mixed_steps_total, moe_jax_compiled_programs, the prefix cache's moe_jax_prompt_tokens_total,
    moe_jax_prompt_tokens_cached_total, moe_jax_prefix_cache_hit_rate (their ratio) and moe_jax_pages_cached,
    speculative decoding's moe_jax_verify_steps_total, moe_jax_spec_draft_tokens_total,
    moe_jax_spec_accepted_tokens_total and moe_jax_spec_acceptance_rate, and two summaries, moe_jax_time_to_first_token_seconds and
    moe_jax_inter_token_latency_seconds: count and sum since the start, quantiles 0.5 and 0.99 over the
    latest requests (`LatencyStats.window`). Where experts are dispatched over ep, per sparse layer (labelled by its
    index in the model): moe_jax_ep_rank_pairs_total{layer, rank}, the real (token, expert) pairs each ep rank
    computed since the start, and moe_jax_ep_rank_load_max_over_mean{layer}, the busiest rank's pairs over the
    mean since the last expert re-placement (`rebalance_every`; since the start without one): 1 is even, ep is
    one rank doing it all, NaN before a step under the placement.
"""

from __future__ import annotations

import math
import threading
from collections import deque

# (metric, manager.metrics() key, type, help)
MANAGER_METRICS = (
    ("slots_in_use", "slots_in_use", "gauge", "Slots (decode rows) holding a request."),
    ("slots_total", "slots_total", "gauge", "Slots (decode rows) of the decode program."),
    ("pages_free", "pages_free", "gauge", "KV-cache pages free."),
    ("pages_total", "pages_total", "gauge", "KV-cache pages in all pools."),
    ("page_size", "page_size", "gauge", "Tokens per KV-cache page."),
    ("requests_waiting", "requests_waiting", "gauge", "Requests waiting for a slot and pages."),
    ("requests_running", "requests_running", "gauge", "Requests prefilling or decoding."),
    ("requests_finished_total", "requests_finished", "counter", "Requests finished (any reason)."),
    ("generated_tokens_total", "generated_tokens", "counter", "Tokens generated."),
    ("tokens_per_second", "tokens_per_s", "gauge", "Tokens generated per second over the last seconds."),
    ("prefill_steps_total", "prefill_steps", "counter", "Prefill steps run."),
    ("decode_steps_total", "decode_steps", "counter", "Decode steps run."),
    ("mixed_steps_total", "mixed_steps", "counter", "Steps that prefilled a prompt chunk and decoded in one program."),
    ("compiled_programs", "compiled_programs", "gauge",
     "Programs compiled (mixed or prefill, and decode; per page-table width)."),
    ("prompt_tokens_total", "prompt_tokens", "counter", "Prompt tokens of the requests admitted."),
    ("prompt_tokens_cached_total", "cached_prompt_tokens", "counter",
     "Prompt tokens whose keys and values came from the prefix cache (not prefilled)."),
    ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "gauge",
     "Prompt tokens served from the prefix cache / prompt tokens, since the start."),
    ("pages_cached", "pages_cached", "gauge", "KV-cache pages holding a cached prefix (in use or idle)."),
    ("verify_steps_total", "verify_steps", "counter", "Decode steps that verified speculative drafts."),
    ("spec_draft_tokens_total", "draft_tokens", "counter", "Speculative draft tokens verified."),
    ("spec_accepted_tokens_total", "accepted_draft_tokens", "counter", "Speculative draft tokens kept."),
    ("spec_acceptance_rate", "acceptance_rate", "gauge",
     "Speculative draft tokens kept / verified, since the start."),
)
QUANTILES = (0.5, 0.99)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (NaN for no values, as Prometheus clients report an empty summary)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class LatencyStats:
    """Time to first token and inter-token latencies of finished requests (thread-safe: recorded on the
    engine's thread, read by /metrics)."""

    def __init__(self, window: int = 1000):
        self.window = window
        self._lock = threading.Lock()
        self._first: deque[float] = deque(maxlen=window)
        self._gaps: deque[list[float]] = deque(maxlen=window)
        self.first_count = self.first_sum = 0
        self.gap_count = self.gap_sum = 0

    def record(self, output) -> None:
        first, gaps = output.time_to_first_token, [float(gap) for gap in output.inter_token_latencies]
        with self._lock:
            if first is not None:
                self._first.append(float(first))
                self.first_count += 1
                self.first_sum += float(first)
            if gaps:
                self._gaps.append(gaps)
                self.gap_count += len(gaps)
                self.gap_sum += sum(gaps)

    def summaries(self) -> dict[str, tuple[int, float, list[float]]]:
        with self._lock:
            return {"time_to_first_token_seconds": (self.first_count, self.first_sum, list(self._first)),
                    "inter_token_latency_seconds": (self.gap_count, self.gap_sum,
                                                    [gap for gaps in self._gaps for gap in gaps])}


def _number(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return repr(value) if math.isfinite(value) else ("+Inf" if value > 0 else "-Inf")
    return str(int(value))


def prometheus_text(manager_metrics: dict, stats: LatencyStats, model_name: str) -> str:
    lines = ["# HELP moe_jax_model_info The served model.", "# TYPE moe_jax_model_info gauge",
             f'moe_jax_model_info{{model="{_label(model_name)}"}} 1']
    for name, key, kind, help_text in MANAGER_METRICS:
        if key in manager_metrics:
            lines += [f"# HELP moe_jax_{name} {help_text}", f"# TYPE moe_jax_{name} {kind}",
                      f"moe_jax_{name} {_number(manager_metrics[key])}"]
    if "ep_rank_load_total" in manager_metrics:
        lines += ep_rank_lines(manager_metrics)
    helps = {"time_to_first_token_seconds": "From a request's arrival to its first token.",
             "inter_token_latency_seconds": "Between consecutive tokens of a request."}
    for name, (count, total, recent) in stats.summaries().items():
        lines += [f"# HELP moe_jax_{name} {helps[name]} Quantiles over the latest requests.",
                  f"# TYPE moe_jax_{name} summary"]
        lines += [f'moe_jax_{name}{{quantile="{q}"}} {_number(quantile(recent, q))}' for q in QUANTILES]
        lines += [f"moe_jax_{name}_sum {_number(float(total))}", f"moe_jax_{name}_count {count}"]
    return "\n".join(lines) + "\n"


def ep_rank_lines(manager_metrics: dict) -> list[str]:
    """The ep ranks' counters and each sparse layer's busiest-rank share (`manager.metrics()`'s ep_rank_load_*)."""
    layers = manager_metrics["sparse_layers"]
    lines = ["# HELP moe_jax_ep_rank_pairs_total Real (token, expert) pairs each expert-parallel rank computed, per "
             "sparse layer.", "# TYPE moe_jax_ep_rank_pairs_total counter"]
    lines += [f'moe_jax_ep_rank_pairs_total{{layer="{layer}",rank="{rank}"}} {int(pairs)}'
              for layer, row in zip(layers, manager_metrics["ep_rank_load_total"]) for rank, pairs in enumerate(row)]
    lines += ["# HELP moe_jax_ep_rank_load_max_over_mean Per sparse layer, the busiest expert-parallel rank's pairs "
              "over the mean since the last expert re-placement (1: even).",
              "# TYPE moe_jax_ep_rank_load_max_over_mean gauge"]
    for layer, row in zip(layers, manager_metrics["ep_rank_load_placed"]):
        row = [int(pairs) for pairs in row]
        mean = sum(row) / len(row)
        share = float(max(row)) / mean if mean > 0 else float("nan")
        lines.append(f'moe_jax_ep_rank_load_max_over_mean{{layer="{layer}"}} {_number(share)}')
    return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
