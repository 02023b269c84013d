"""`Family`, the record a family is: the experts function's former field name still builds and reads a family,
with a DeprecationWarning."""

from __future__ import annotations

import dataclasses

import pytest

from moe_jax.models import FAMILIES, Family


def test_the_former_experts_field_name_still_works_with_a_warning():
    qwen3 = FAMILIES["qwen3_moe"]
    fields = {f.name: getattr(qwen3, f.name) for f in dataclasses.fields(qwen3) if f.name != "experts_forward"}
    with pytest.warns(DeprecationWarning, match="experts_forward"):
        family = Family(**fields, experts=qwen3.experts_forward)
    assert family == qwen3
    with pytest.warns(DeprecationWarning, match="experts_forward"):
        assert family.experts is qwen3.experts_forward
    # replace() passes every field by its name: no warning, nothing overridden.
    gpt_oss_forward = FAMILIES["gpt_oss"].experts_forward
    assert dataclasses.replace(qwen3, experts_forward=gpt_oss_forward).experts_forward is gpt_oss_forward
