"""Every family's plans equal the reference's, on the tiny models of the parity tests.

`tests/fixtures/reference_plans.json` ("family_plan_cases", recorded from transformers 5.23 by
scripts/fixtures/make_reference_fixtures.py) holds, per family, the composed `tp_plan` / `ep_plan` / `fsdp_plan` and
the plans `_resolve_parallel_plans` returns (composition, precedence and wildcard expansion to concrete
module and parameter names, in order) on a few layouts, or the reference's error. A TP style swapped in a
family's plan (`rowwise` <-> `colwise` on one projection) gives correct logits on every layout, since our
sharded matmuls are exact either way; only this comparison sees it, for every family, without torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import moe_jax.models  # noqa: F401  (registers the families)
from moe_jax import DistributedConfig
from moe_jax.causal_lm.families import MODEL_CLASSES

from .tiny_qwen3_moe import FIXTURE

FAMILIES = FIXTURE["family_plan_cases"]
# [quirk] (docs/design.md, Llama 4): the reference's Llama4ForCausalLM has base_model_prefix="language_model",
# so its composed plans also carry the base-model rules unprefixed ("layers.*.self_attn.q_proj"), which match
# nothing (it warns so) and drop out of the resolved plans; ours leave them out.
UNPREFIXED_RULES_DROPPED = {"llama4_text"}
CASES = [(family, layout) for family, case in FAMILIES.items() for layout in case["layouts"]]


def _ours(family: str, kwargs: dict) -> dict:
    """Our resolved plans for `family`'s tiny model on the layout `kwargs`, as the fixture records them."""
    try:
        config = DistributedConfig(**kwargs)
        model = MODEL_CLASSES[family](FAMILIES[family]["model_config"], config, abstract=True)
    except (ValueError, OSError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    plans = model.resolved_plans
    return {"tp": [list(item) for item in plans.tp.items()], "ep": [list(item) for item in plans.ep.items()],
            "fsdp": [list(item) for item in plans.fsdp.items()]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_composed_plans_match_reference_including_order(family):
    """The family's plans after composing the base-model and ForCausalLM rules: a style swapped or a rule
    missing or added in `moe_jax/models/<family>.py` fails here even for a plan no layout below activates."""
    model = MODEL_CLASSES[family](FAMILIES[family]["model_config"], abstract=True)
    for kind, expected in FAMILIES[family]["plans"].items():
        expected = list(expected.items())
        if family in UNPREFIXED_RULES_DROPPED:
            expected = [(key, style) for key, style in expected if key.startswith(("model.", "lm_head"))]
        assert list(getattr(model, kind).items()) == expected, kind


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{family}-{layout}" for family, layout in CASES])
def test_resolved_plans_match_reference(family, layout):
    """tp / ep / fsdp plans expanded to every module and parameter, in order, equal the reference's; an
    empty plan must be empty on both sides (gpt-oss has no TP plan but `lm_head`), and where the reference
    refuses the layout (Llama 4 has no EP plan) we raise its error text. Catches a swapped TP style, a wrong
    EP-over-TP precedence, or an FSDP rule that wraps the wrong modules, in any family."""
    expected = dict(FAMILIES[family]["layouts"][layout])
    ours = _ours(family, expected.pop("kwargs"))
    assert ours.keys() == expected.keys(), ours.get("error")
    for kind in expected:  # one kind at a time, so a failure names the first differing rule
        assert ours[kind] == expected[kind], kind


@pytest.fixture(scope="module")
def fixture_script():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if transformers.__version__ != FIXTURE["transformers_version"]:
        pytest.skip(f"fixture recorded with transformers {FIXTURE['transformers_version']}")
    script = Path(__file__).resolve().parents[2] / "scripts" / "fixtures" / "make_reference_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_reference_fixtures", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.reference
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_fixture_is_current_with_installed_transformers(family, fixture_script):
    """Recompute the family's entry with the installed reference (its live `_resolve_parallel_plans`) and with
    the current tiny config of tests/models/hf_reference.py: a stale fixture fails here."""
    import json

    live = fixture_script.family_plan_case(family, fixture_script.family_configs()[family])
    assert json.loads(json.dumps(live)) == FAMILIES[family]
