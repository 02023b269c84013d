"""A PEFT adapter of DeepSeek-V3 gives PeftModel's logits with `load_adapter`, on one device and on tp2/fsdp2/ep4,
fsdp8/ep8 and pipeline stages: its latent attention projections (q_a / q_b / kv_a_proj_with_mqa / kv_b / o_proj),
the fused experts, and its router's weight through target_parameters (HF's router is not a Linear)."""

from __future__ import annotations

import numpy as np
import pytest

from ..models.hf_reference import LOGITS_ATOL
from ..heavy import representative
from .test_peft_files import LAYOUTS, build, layout_id

pytestmark = [pytest.mark.reference, pytest.mark.peft]

# Not gate_proj / up_proj: PEFT 0.21 rewrites those names on MoE models into a rank_pattern target of the fused
# experts (for adapters of per-expert checkpoints), which moe_jax refuses (one rank per adapter).
TARGETS = {"target_modules": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
           "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]}


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    from .peft_reference import saved_peft_adapter

    return saved_peft_adapter("deepseek_v3", tmp_path_factory.mktemp("deepseek_adapter"), TARGETS)


# The suite runs one device, tp2/fsdp2/ep4 and stages (fsdp8/ep8: tests/lora/test_peft_files.py); --heavy the
# rest.
@pytest.mark.parametrize("layout", representative(LAYOUTS, suite=("single", "tp2-fsdp2-ep4", "pp2-fsdp2-ep2"),
                                                  ids=[layout_id(layout) for layout in LAYOUTS]))
def test_a_peft_adapter_gives_peft_s_logits(peft_adapter, layout):
    from .peft_reference import TINY_CONFIGS

    state, directory, ids, expected = peft_adapter
    model = build("deepseek_v3", TINY_CONFIGS["deepseek_v3"], layout, state)
    model.load_adapter(directory)
    np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=LOGITS_ATOL, rtol=0)
