"""The tiny Qwen3-MoE of the plan fixtures, as the real model class (abstract: no devices, no params).

`tests/fixtures/reference_plans.json` records the same tiny model built by transformers
(scripts/fixtures/make_reference_fixtures.py), so plan tests compare our composition with the reference's.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_jax.causal_lm import Qwen3MoeForCausalLM

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "reference_plans.json").read_text())


class TinyQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    """`Qwen3MoeForCausalLM` on the fixture's config; named as the HF class so error texts match."""

    def __init__(self, **config_changes):
        super().__init__({**FIXTURE["model_config"], **config_changes}, abstract=True)


TinyQwen3MoeForCausalLM.__name__ = "Qwen3MoeForCausalLM"
TinyQwen3MoeForCausalLM.__qualname__ = "Qwen3MoeForCausalLM"
