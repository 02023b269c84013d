"""`/metrics`' latency summaries count every gap between tokens (not one per request)."""

from __future__ import annotations

from types import SimpleNamespace

from moe_jax.serving.metrics import LatencyStats, prometheus_text


def test_the_inter_token_summary_counts_each_gap():
    stats = LatencyStats(window=10)
    stats.record(SimpleNamespace(time_to_first_token=0.5, inter_token_latencies=[0.25, 0.25, 0.5]))
    stats.record(SimpleNamespace(time_to_first_token=1.0, inter_token_latencies=[1.0, 2.0]))
    stats.record(SimpleNamespace(time_to_first_token=None, inter_token_latencies=[]))
    summaries = stats.summaries()
    assert summaries["inter_token_latency_seconds"] == (5, 4.0, [0.25, 0.25, 0.5, 1.0, 2.0])
    assert summaries["time_to_first_token_seconds"] == (2, 1.5, [0.5, 1.0])
    text = prometheus_text({}, stats, "m")
    assert "moe_jax_inter_token_latency_seconds_count 5\n" in text
    assert "moe_jax_inter_token_latency_seconds_sum 4.0\n" in text
    assert "moe_jax_time_to_first_token_seconds_count 2\n" in text
