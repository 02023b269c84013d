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


def test_attention_reads_no_padding_mask_when_the_caller_gave_none(monkeypatch):
    """Without an attention mask every key is real: attention gets no padding mask (a GPU's fused kernel then takes
    the causal mask alone), and the logits equal those under an all-ones mask."""
    import jax
    import numpy as np

    from moe_jax.causal_lm import Qwen3MoeForCausalLM
    from moe_jax.nn import attention

    masks, attend = [], attention.attend

    def recording(q, k, v, **options):
        masks.append(options["key_padding_mask"] is None)
        return attend(q, k, v, **options)

    monkeypatch.setattr(attention, "attend", recording)
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                  max_position_embeddings=64)
    model = Qwen3MoeForCausalLM(config, devices=jax.devices()[:1])
    model.init_params(seed=0)
    ids = np.random.default_rng(0).integers(0, 64, (2, 12))
    unmasked, masked = np.asarray(model(ids)), np.asarray(model(ids, np.ones_like(ids)))
    assert masks == [True, False]
    np.testing.assert_allclose(unmasked, masked, rtol=1e-6, atol=1e-6)
