"""Logits and router loss of every family equal PyTorch's, from committed fixtures (no torch needed).

`tests/fixtures/models/<model_type>/` holds a tiny random checkpoint saved by transformers and the
logits PyTorch computed for it (scripts/fixtures/make_model_fixtures.py). Each is loaded with `from_pretrained`
onto the layouts below and compared on real (non-padding) tokens.
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moe_jax
import moe_jax.causal_lm
from moe_jax import DistributedConfig

from ..distributed.test_mesh import LAYOUTS as ALL_LAYOUTS
from .hf_reference import LOGITS_ATOL

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "llama4_text"]

# One device and tp2/fsdp4/ep4 are also compared live with PyTorch in each family's test file; TP experts
# without EP (tp2/fsdp4) in tests/models/test_gradients.py.
REPRESENTATIVE_LAYOUTS = [
    dict(tp_size=2, fsdp_size=4, ep_size=4),
    dict(fsdp_size=8, ep_size=8),
    dict(tp_size=8, ep_size=8, ep_implementation="all_reduce"),
    dict(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=2, ep_implementation="auto"),
]


def _layout_id(layout):
    return "single" if layout is None else "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items())


def has_ep_plan(model_type: str) -> bool:
    """Whether the family can run with ep_size > 1 (Llama 4 has no EP plan: its experts shard by TP)."""
    return moe_jax.causal_lm.MODEL_CLASSES[model_type].family.ep_plan is not None


def every_layout_and_implementation(model_type: str | None = None):
    """All 26 legal 8-device layouts, with every ep_implementation that applies to each (for a family without
    an EP plan, the layouts without EP)."""
    cases = []
    for tp, fsdp, ep, replicate in ALL_LAYOUTS:
        base = dict(tp_size=tp, fsdp_size=fsdp, ep_size=ep, dp_replicate_size=replicate)
        if ep == 1:
            cases.append(base)
            continue
        if model_type is not None and not has_ep_plan(model_type):
            continue
        names = ["all_to_all", "auto"] + (["all_reduce"] if ep == tp else [])
        cases += [dict(base, ep_implementation=name) for name in names]
    return cases


def fixture_output(model_type: str, layout: dict | None, checkpoint: Path | None = None, **model_kwargs):
    """(`model.forward` on the fixture's inputs, the fixture's arrays); `checkpoint` replaces the committed
    one (for tests that alter it); `model_kwargs` go to the model (e.g. `scan_layers=True`)."""
    reference = np.load(FIXTURES / model_type / "reference.npz")
    model = moe_jax.AutoModelForCausalLM.from_pretrained(
        checkpoint or FIXTURES / model_type, DistributedConfig(**layout) if layout else None, progress=False,
        **model_kwargs,
    )
    return model.forward(reference["input_ids"], reference["attention_mask"]), reference


def logits_difference(output, reference) -> float:
    """Max |ours - PyTorch| over real (non-padding) tokens."""
    real = reference["attention_mask"].astype(bool)
    return float(np.max(np.abs(np.asarray(output.logits)[real] - reference["logits"][real])))


def check_against_fixture(model_type: str, layout: dict | None, **model_kwargs) -> float:
    """Asserts parity on `layout`; returns the max abs logits difference (scripts/checks/check_all_layouts.py
    reports the worst)."""
    output, reference = fixture_output(model_type, layout, **model_kwargs)
    difference = logits_difference(output, reference)
    assert difference <= LOGITS_ATOL, f"{model_type} {layout}: max abs logits difference {difference:.2e}"
    assert abs(float(output.aux_loss) - float(reference["aux_loss"])) < 1e-5
    assert int(output.statistics.dropped) == 0
    return difference


def scale_routed_experts(source: Path, destination: Path, factor: float) -> Path:
    """A copy of the checkpoint `source` with every routed expert's down projection times `factor`."""
    shutil.copytree(source, destination)
    tensors = load_file(destination / "model.safetensors")
    for key, value in tensors.items():
        if ".experts." in key and key.endswith(("down_proj.weight", ".w2.weight")):
            tensors[key] = value * np.asarray(factor, value.dtype)
    save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


# Each family other than Qwen3-MoE on one of the four layouts, each layout once, to keep the suite's time
# (the full grid is the script named below). Qwen3-MoE's fixture logits are checked on tp2/fsdp4/ep4 and
# fsdp8/ep8 by tests/multiprocess/ (one process and two), scanned in test_layer_stack.py, and live in
# test_qwen3_moe.py.
# Llama 4 (no EP plan) runs its experts by TP.
SUITE_CASES = [(family, REPRESENTATIVE_LAYOUTS[i % len(REPRESENTATIVE_LAYOUTS)] if has_ep_plan(family)
                else dict(tp_size=2, fsdp_size=4))
               for i, family in enumerate(FAMILIES[1:])]


@pytest.mark.parametrize("model_type, layout", SUITE_CASES,
                         ids=[f"{family}-{_layout_id(layout)}" for family, layout in SUITE_CASES])
def test_logits_match_pytorch_fixture(model_type, layout):
    """Every family on a representative set of layouts; the whole grid (every legal layout x
    ep_implementation, unrolled and scanned) is `python scripts/checks/check_all_layouts.py`, run before a release
    (its last figures are in docs/benchmarks.md)."""
    check_against_fixture(model_type, layout)


def test_a_one_percent_change_to_routed_experts_fails_parity(tmp_path):
    """The tolerance can see a wrong expert: Qwen2-MoE's shared expert carries most of each MoE output, so its
    routed experts scaled by 1.01 move the logits by only ~4e-5, which the old 1e-4 tolerance let through."""
    checkpoint = scale_routed_experts(FIXTURES / "qwen2_moe", tmp_path / "qwen2_moe", 1.01)
    difference = logits_difference(*fixture_output("qwen2_moe", None, checkpoint))
    assert LOGITS_ATOL < difference < 1e-4, difference
