"""A PEFT adapter of Mixtral (attention projections and the fused experts) gives PeftModel's logits with
`load_adapter`, on one device and on tp2/fsdp2/ep4, fsdp8/ep8 and pipeline stages."""

from __future__ import annotations

import numpy as np
import pytest

from ..models.hf_reference import LOGITS_ATOL
from ..heavy import representative
from .test_peft_files import LAYOUTS, build, layout_id

pytestmark = [pytest.mark.reference, pytest.mark.peft]


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    from .peft_reference import saved_peft_adapter

    return saved_peft_adapter("mixtral", tmp_path_factory.mktemp("mixtral_adapter"))


# The suite runs one device and tp2/fsdp2/ep4 (fsdp8/ep8: tests/lora/test_peft_files.py; stages: DeepSeek-V3's);
# --heavy the rest.
@pytest.mark.parametrize("layout", representative(LAYOUTS, suite=("single", "tp2-fsdp2-ep4"),
                                                  ids=[layout_id(layout) for layout in LAYOUTS]))
def test_a_peft_adapter_gives_peft_s_logits(peft_adapter, layout):
    from .peft_reference import TINY_CONFIGS

    state, directory, ids, expected = peft_adapter
    model = build("mixtral", TINY_CONFIGS["mixtral"], layout, state)
    model.load_adapter(directory)
    np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=LOGITS_ATOL, rtol=0)
