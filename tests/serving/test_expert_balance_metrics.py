"""Serving with redundant expert slots: `init_continuous_batching(num_redundant_experts=R)` takes the model's R and
refuses another (the slots are fixed when the model is built), and `/metrics` reports each sparse layer's ep ranks:
the real (token, expert) pairs each computed, and the busiest rank's share (tests/serving/live.py's server)."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

import jax  # noqa: E402

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.tokenization import load_checkpoint_tokenizer  # noqa: E402

from .live import CONFIG, NAME, SERVER_FLAGS, serving, write_checkpoint  # noqa: E402


def labelled(text: str, name: str) -> dict[tuple[str, ...], float]:
    """{label values: value} of metric `name`'s lines in Prometheus text."""
    return {tuple(re.findall(r'="([^"]*)"', match[1])): float(match[2])
            for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def test_serving_takes_the_models_slots_and_metrics_show_the_busiest_ep_rank(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "tiny")
    tokenizer = load_checkpoint_tokenizer(checkpoint, instead="-")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, DistributedConfig(fsdp_size=2, ep_size=2),
                                                 devices=jax.devices()[:2], progress=False, num_redundant_experts=2)
    with pytest.raises(ValueError, match=r"num_redundant_experts=4, but this model was built with 2 redundant expert "
                                         r"slots: the slots are fixed when the model is built .* pass "
                                         r"num_redundant_experts=4 to from_pretrained"):
        model.init_continuous_batching(num_redundant_experts=4, **SERVER_FLAGS)
    manager = model.init_continuous_batching(decode=tokenizer.decode, num_redundant_experts=2, **SERVER_FLAGS)
    with serving(model, manager, tokenizer) as served:
        before = httpx.get(f"{served.url}/metrics").text
        prompts = ["Hello there", "abc"]
        for prompt in prompts:
            served.client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0)
        text = httpx.get(f"{served.url}/metrics").text
    sparse = [str(layer) for layer in range(CONFIG["num_hidden_layers"]) if layer not in CONFIG["mlp_only_layers"]]
    assert set(labelled(before, "moe_jax_ep_rank_load_max_over_mean")) == {(layer,) for layer in sparse}
    assert all(np.isnan(share) for share in labelled(before, "moe_jax_ep_rank_load_max_over_mean").values())
    pairs = labelled(text, "moe_jax_ep_rank_pairs_total")
    assert set(pairs) == {(layer, rank) for layer in sparse for rank in ("0", "1")}
    # Every token run (each prompt's, then each new token but the last) went to top-k experts, in every layer.
    tokens = sum(len(tokenizer.encode(prompt)) + 5 - 1 for prompt in prompts)
    shares = labelled(text, "moe_jax_ep_rank_load_max_over_mean")
    for layer in sparse:
        ranks = [pairs[layer, rank] for rank in ("0", "1")]
        assert sum(ranks) == tokens * CONFIG["num_experts_per_tok"]
        assert shares[(layer,)] == pytest.approx(max(ranks) / np.mean(ranks))   # no re-placement: since the start
