"""Plan composition, overrides, errors, precedence and expansion match the reference (fixture recorded
from transformers 5.23 by scripts/fixtures/make_reference_fixtures.py)."""

import logging
import warnings

import pytest

from moe_jax import DistributedConfig
from moe_jax.distributed.plans import (
    expand_parallel_plan,
    parameter_plan,
    replace_layer_number_by_wildcard,
    resolve_parallel_plans,
)

from .test_config import LIFTED_REFUSALS
from .tiny_qwen3_moe import FIXTURE, TinyQwen3MoeForCausalLM

ALL_CASES = {**FIXTURE["plan_cases"], **FIXTURE["all_sparse_plan_cases"]}


def _config(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return DistributedConfig(**kwargs)


def resolve_case(case: dict, caplog) -> dict:
    model = TinyQwen3MoeForCausalLM(**case["model_config_changes"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moe_jax.distributed.plans"):
        try:
            plans = resolve_parallel_plans(model, _config(case["kwargs"]))
            result = {"tp": list(plans.tp.items()), "ep": list(plans.ep.items()), "fsdp": list(plans.fsdp.items())}
        except (ValueError, OSError) as error:
            result = {"error": f"{type(error).__name__}: {error}"}
    result["warnings"] = [record.getMessage() for record in caplog.records]
    result["model_plans_after"] = {
        "tp_plan": model.tp_plan, "ep_plan": model.ep_plan, "fsdp_plan": model.fsdp_plan,
    }
    return result


def _as_lists(expected: dict) -> dict:
    out = {key: value for key, value in expected.items() if key not in ("kwargs", "model_config_changes")}
    for kind in ("tp", "ep", "fsdp"):
        if kind in out:
            out[kind] = [tuple(item) for item in out[kind]]
    return out


def _tuples(result: dict) -> dict:
    for kind in ("tp", "ep", "fsdp"):
        if kind in result:
            result[kind] = [tuple(item) for item in result[kind]]
    return result


def test_declared_tree_has_the_reference_names_in_order():
    model = TinyQwen3MoeForCausalLM()
    assert model.module_tree.named_modules() == FIXTURE["modules"]
    assert [[name, list(spec.shape)] for name, spec in model.module_tree.named_parameters()] == FIXTURE["parameters"]
    sparse = TinyQwen3MoeForCausalLM(mlp_only_layers=[])
    assert sparse.module_tree.named_modules() == FIXTURE["all_sparse_modules"]


def test_composed_model_plans_match_reference_including_order():
    model = TinyQwen3MoeForCausalLM()
    for kind in ("tp_plan", "ep_plan", "fsdp_plan"):
        assert list(getattr(model, kind).items()) == list(FIXTURE["plans"][kind].items()), kind
    assert next(iter(model.tp_plan.items())) == ("lm_head", "colwise_gather_output")
    assert model.tp_plan["model.embed_tokens"] == "embedding_rowwise"


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_resolved_plans_match_reference(case, caplog):
    expected = ALL_CASES[case]
    result = _tuples(resolve_case(expected, caplog))
    if expected.get("error", "").startswith(LIFTED_REFUSALS):
        # A refusal moe_jax lifts (token dispatch with pipeline stages): the plans resolve.
        assert "error" not in result and "ep_dispatch_experts" in dict(result["ep"]).values(), result
        return
    assert result == _as_lists(expected)


def test_explicit_embedding_rule_wins_over_automatic_one():
    class WithEmbeddingRule(TinyQwen3MoeForCausalLM):
        def init_parallel_plans(self, base_model_plans):
            base_model_plans = dict(base_model_plans)
            base_model_plans["tp"] = {"embed_tokens": "embedding_colwise", **base_model_plans["tp"]}
            super().init_parallel_plans(base_model_plans)

    assert WithEmbeddingRule().tp_plan["model.embed_tokens"] == "embedding_colwise"


def test_unknown_override_raises_before_plans_change():
    model = TinyQwen3MoeForCausalLM()
    before = dict(model.tp_plan)
    with pytest.raises(ValueError, match=r"`tp_plan` keys \['model.layers.\*.mlp.nothing'\] match nothing"):
        resolve_parallel_plans(model, DistributedConfig(tp_size=2, tp_plan={"model.layers.*.mlp.nothing": "colwise"}))
    assert model.tp_plan == before


def test_overrides_persist_on_the_model():
    model = TinyQwen3MoeForCausalLM()
    resolve_parallel_plans(model, DistributedConfig(tp_size=2, tp_plan={"model.layers.*.self_attn.o_proj": "rowwise_rep"}))
    assert model.tp_plan["model.layers.*.self_attn.o_proj"] == "rowwise_rep"
    assert model.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise"


def test_ep_over_tp_precedence_drops_expert_tp_rules():
    model = TinyQwen3MoeForCausalLM()
    plans = resolve_parallel_plans(model, DistributedConfig(tp_size=2, ep_size=2))
    assert not any(".mlp.experts" in name for name in plans.tp)
    assert plans.ep["model.layers.1.mlp.experts.gate_up_proj"] == "grouped_gemm"
    tp_only = resolve_parallel_plans(TinyQwen3MoeForCausalLM(), DistributedConfig(tp_size=2))
    assert tp_only.tp["model.layers.1.mlp.experts"] == "moe_tp_experts"
    assert tp_only.tp["model.layers.1.mlp.experts.gate_up_proj"] == "packed_colwise"


def test_plans_are_active_only_when_their_size_is_above_one():
    plans = resolve_parallel_plans(TinyQwen3MoeForCausalLM(), DistributedConfig(fsdp_size=8))
    assert plans.tp == {} and plans.ep == {} and plans.fsdp


def test_plan_setters_validate_like_reference(caplog):
    model = TinyQwen3MoeForCausalLM()
    with pytest.raises(ValueError, match="Can only set a dictionary as `tp_plan`"):
        model.tp_plan = "auto"
    with pytest.raises(ValueError, match=r"Unsupported `ep_plan` styles: \{'bogus'\}"):
        model.ep_plan = {"model.layers.*.mlp.experts": "bogus"}
    with pytest.raises(ValueError, match=r"Unsupported `fsdp_plan` styles: \{'colwise'\}"):
        model.fsdp_plan = {"model.norm": "colwise"}
    model.tp_plan = None
    assert model.tp_plan == {}
    with caplog.at_level(logging.WARNING, logger="moe_jax.distributed.plans"):
        model.ep_plan = {"model.nowhere": "grouped_gemm"}
    assert "`ep_plan` rules ['model.nowhere'] match nothing in Qwen3MoeForCausalLM" in caplog.text


def test_wildcards_replace_only_dot_delimited_numbers():
    assert replace_layer_number_by_wildcard("model.layers.12.mlp.experts.3") == "model.layers.*.mlp.experts.*"
    assert replace_layer_number_by_wildcard("block.w1.weight") == "block.w1.weight"


def test_parameter_rule_beats_module_rule_for_that_parameter():
    plan = {"a.*.proj": "colwise", "a.*.proj.bias": "replicate"}
    assert parameter_plan("a.3.proj.weight", plan) == "colwise"
    assert parameter_plan("a.3.proj.bias", plan) == "replicate"
    assert parameter_plan("a.3.proj", plan, is_weight=False) == "colwise"
    assert parameter_plan("a.3.proj.weight", {"a.*.proj": "colwise"}, is_weight=False) is None


def test_expansion_lists_parameters_before_their_module():
    tree = TinyQwen3MoeForCausalLM().module_tree
    expanded = list(expand_parallel_plan(tree, {"model.layers.*.mlp.experts": "ep_dispatch_experts",
                                                "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}))
    assert expanded[:3] == [
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.1.mlp.experts",
    ]


@pytest.mark.reference
def test_fixture_is_current_with_installed_transformers():
    """Recompute the fixture with the installed reference and compare (run with torch installed)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "fixtures" / "make_reference_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_reference_fixtures", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if transformers.__version__ != FIXTURE["transformers_version"]:
        pytest.skip(f"fixture recorded with transformers {FIXTURE['transformers_version']}")
    import json

    live = json.loads(json.dumps(module.build_fixture()))
    assert live == FIXTURE
