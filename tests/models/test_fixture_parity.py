"""Logits and router loss of every family equal PyTorch's, from committed fixtures (no torch needed).

`tests/fixtures/models/<model_type>/` holds a tiny random checkpoint saved by transformers and the
logits PyTorch computed for it (scripts/make_model_fixtures.py). Each is loaded with `from_pretrained`
onto the layouts below and compared on real (non-padding) tokens.
"""

from pathlib import Path

import numpy as np
import pytest

import moe_jax
from moe_jax import DistributedConfig

from ..distributed.test_mesh import LAYOUTS as ALL_LAYOUTS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"]

REPRESENTATIVE_LAYOUTS = [
    None,
    dict(tp_size=2, fsdp_size=4, ep_size=4),
    dict(fsdp_size=8, ep_size=8),
    dict(tp_size=8, ep_size=8, ep_implementation="all_reduce"),
    dict(tp_size=2, fsdp_size=4),
    dict(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=2, ep_implementation="auto"),
]


def _layout_id(layout):
    return "single" if layout is None else "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items())


def every_layout_and_implementation():
    """All 26 legal 8-device layouts, with every ep_implementation that applies to each."""
    cases = []
    for tp, fsdp, ep, replicate in ALL_LAYOUTS:
        base = dict(tp_size=tp, fsdp_size=fsdp, ep_size=ep, dp_replicate_size=replicate)
        if ep == 1:
            cases.append(base)
            continue
        names = ["all_to_all", "auto"] + (["all_reduce"] if ep == tp else [])
        cases += [dict(base, ep_implementation=name) for name in names]
    return cases


def check_against_fixture(model_type: str, layout: dict | None):
    directory = FIXTURES / model_type
    reference = np.load(directory / "reference.npz")
    model = moe_jax.AutoModelForCausalLM.from_pretrained(
        directory, DistributedConfig(**layout) if layout else None, progress=False
    )
    output = model.forward(reference["input_ids"], reference["attention_mask"])
    real = reference["attention_mask"].astype(bool)
    difference = np.max(np.abs(np.asarray(output.logits)[real] - reference["logits"][real]))
    assert difference <= 1e-4, f"{model_type} {layout}: max abs logits difference {difference:.2e}"
    assert abs(float(output.aux_loss) - float(reference["aux_loss"])) < 1e-5
    assert int(output.statistics.dropped) == 0


@pytest.mark.parametrize("layout", REPRESENTATIVE_LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("model_type", [family for family in FAMILIES if family != "qwen3_moe"])
def test_logits_match_pytorch_fixture(model_type, layout):
    """Qwen3-MoE runs on every layout below; the other families on a representative set."""
    check_against_fixture(model_type, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", every_layout_and_implementation(), ids=_layout_id)
def test_qwen3_moe_on_every_legal_layout_and_implementation(layout):
    check_against_fixture("qwen3_moe", layout)
