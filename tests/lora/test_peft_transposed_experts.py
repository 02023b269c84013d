"""PEFT adapters of the two families whose fused experts PEFT reads differently give PeftModel's logits:
gpt-oss (experts HF marks transposed, [E, in, out]; biased attention projections) and Llama 4 ([E, in, out] read
as [E, out, in], so the rows meet B first; tensor-parallel experts: it has no EP plan)."""

from __future__ import annotations

import numpy as np
import pytest

from ..heavy import representative
from ..models.hf_reference import LOGITS_ATOL
from .test_peft_files import build, layout_id

pytestmark = [pytest.mark.reference, pytest.mark.peft]

CASES = [
    ("gpt_oss", {}, [None, dict(fsdp_size=8, ep_size=8)]),
    ("llama4_text", {"target_modules": ["q_proj", "v_proj", "o_proj"],
                     "target_parameters": ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]},
     [None, dict(tp_size=2, fsdp_size=4)]),
]


# The suite runs gpt-oss (transposed, biased, interleaved experts); --heavy Llama 4's [E, H, 2I] too.
@pytest.mark.parametrize("model_type, targets, layouts",
                         representative(CASES, suite=("gpt_oss",), ids=[case[0] for case in CASES]))
def test_a_peft_adapter_gives_peft_s_logits(model_type, targets, layouts, tmp_path):
    from .peft_reference import TINY_CONFIGS, saved_peft_adapter

    state, directory, ids, expected = saved_peft_adapter(model_type, tmp_path, targets)
    for layout in layouts:
        model = build(model_type, TINY_CONFIGS[model_type], layout, state)
        model.load_adapter(directory)
        np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=LOGITS_ATOL, rtol=0,
                                   err_msg=f"{model_type} on {layout_id(layout)}")
