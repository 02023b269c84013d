"""Record what the PyTorch reference (transformers 5.23) does, as JSON fixtures for the tests.

    pip install torch==2.13.0 transformers==5.23.0
    python scripts/make_reference_fixtures.py

Writes `tests/fixtures/reference_plans.json`: the module and parameter names of a tiny Qwen3-MoE, its
plans, and for each `DistributedConfig` case the resolved + expanded plans (or the error text and the
warnings); and for every family's tiny model (tests/models/hf_reference.py) its composed plans and the
resolved plans (or the error text) on a few representative layouts (`family_plan_cases`). The default test
run reads the fixture, so it needs no torch; `-m reference` tests recompute it live.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "reference_plans.json"

TINY_QWEN3_MOE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
    decoder_sparse_step=1,
    tie_word_embeddings=False,
)

# (case name, DistributedConfig kwargs). Each runs on a fresh model, since overrides persist on it.
PLAN_CASES = [
    ("tp2", dict(tp_size=2)),
    ("tp2_fsdp4_ep4", dict(tp_size=2, fsdp_size=4, ep_size=4)),
    ("fsdp8_ep8", dict(fsdp_size=8, ep_size=8)),
    ("fsdp4_ep2", dict(fsdp_size=4, ep_size=2)),
    ("tp2_ep2", dict(tp_size=2, ep_size=2)),
    ("hsdp_2x2_tp2_ep2", dict(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=2)),
    ("fsdp8", dict(fsdp_size=8)),
    ("tp2_tp_plan_empty", dict(tp_size=2, tp_plan={})),
    ("tp2_fsdp2_tp_plan_empty", dict(tp_size=2, fsdp_size=2, tp_plan={})),
    ("tp2_tp_plan_auto", dict(tp_size=2, tp_plan="auto")),
    (
        "tp2_override_o_proj",
        dict(tp_size=2, tp_plan={"model.layers.*.self_attn.o_proj": "rowwise_split_input"}),
    ),
    (
        "tp2_override_new_key",
        dict(tp_size=2, tp_plan={"model.layers.*.mlp.gate": "replicate"}),
    ),
    ("tp2_override_unknown_key", dict(tp_size=2, tp_plan={"model.layers.*.mlp.nothing": "colwise"})),
    (
        "tp2_override_concrete_layer_key",
        dict(tp_size=2, tp_plan={"model.layers.0.self_attn.q_proj": "colwise"}),
    ),
    ("tp2_unsupported_style", dict(tp_size=2, tp_plan={"model.layers.*.self_attn.q_proj": "diagonal"})),
    ("tp2_ep2_ep_plan_empty", dict(tp_size=2, ep_size=2, ep_plan={})),
    (
        "tp2_ep2_ep_router",
        dict(tp_size=2, ep_size=2, ep_plan={"model.layers.*.mlp.gate": "ep_router"}),
    ),
    (
        "tp2_ep2_moe_tp_experts_in_ep",
        dict(tp_size=2, ep_size=2, ep_plan={"model.layers.*.mlp.experts": "moe_tp_experts"}),
    ),
    (
        "fsdp2_ep2_param_override",
        dict(fsdp_size=2, ep_size=2, ep_plan={"model.layers.*.mlp.experts.down_proj": "replicate"}),
    ),
    ("fsdp4_fsdp_plan_override", dict(fsdp_size=4, fsdp_plan={"model.norm": "free_full_weight"})),
    ("fsdp4_fsdp_plan_empty", dict(fsdp_size=4, fsdp_plan={})),
    ("fsdp4_fsdp_plan_bad_style", dict(fsdp_size=4, fsdp_plan={"model.norm": "colwise"})),
    ("fsdp4_fsdp_plan_unknown", dict(fsdp_size=4, fsdp_plan={"model.nowhere": "free_full_weight"})),
    (
        "tp2_warn_unmatched_model_rule",
        dict(tp_size=2, tp_plan={"lm_head": "colwise_gather_output"}),
    ),
    ("ep2_legacy_flag_tp2", dict(tp_size=2, enable_expert_parallel=True)),
    ("pp2_ep2_dispatch", dict(pp_size=2, tp_size=2, ep_size=2)),
]

# The same cases on a model whose layers are all sparse: the dense-MLP rules then match nothing (warning).
ALL_SPARSE = {"mlp_only_layers": []}
ALL_SPARSE_PLAN_CASES = [
    ("all_sparse_tp2", dict(tp_size=2)),
    ("all_sparse_tp2_fsdp4_ep4", dict(tp_size=2, fsdp_size=4, ep_size=4)),
]

# DistributedConfig constructions: (case name, kwargs, env WORLD_SIZE or None).
CONFIG_CASES = [
    ("defaults", {}, None),
    ("tp2_fsdp4_ep4", dict(tp_size=2, fsdp_size=4, ep_size=4), None),
    ("tp4_fsdp2_ep2", dict(tp_size=4, fsdp_size=2, ep_size=2), None),
    ("fsdp4_ep8", dict(fsdp_size=4, ep_size=8), None),
    ("ep2_alone", dict(ep_size=2), None),
    ("tp0", dict(tp_size=0), None),
    ("fsdp_negative", dict(fsdp_size=-1), None),
    ("dp_replicate0", dict(dp_replicate_size=0), None),
    ("pp0", dict(pp_size=0), None),
    ("ep0", dict(ep_size=0), None),
    ("tp_plan_world8", dict(tp_plan="auto"), "8"),
    ("tp_plan_world8_fsdp2", dict(tp_plan={}, fsdp_size=2), "8"),
    ("tp_plan_world6_fsdp4", dict(tp_plan="auto", fsdp_size=4), "6"),
    ("tp_plan_world_unset", dict(tp_plan="auto"), ""),
    ("legacy_flag", dict(enable_expert_parallel=True, tp_size=4, fsdp_size=1), None),
    ("legacy_flag_explicit_ep", dict(enable_expert_parallel=True, tp_size=2, ep_size=2, fsdp_size=1), None),
    ("legacy_flag_keeps_tp_plan", dict(enable_expert_parallel=True, tp_size=2, tp_plan="auto"), None),
    ("ep_plan_auto", dict(ep_plan="auto"), None),
    ("fsdp_plan_str", dict(fsdp_plan="auto"), None),
    ("fsdp2_pp2", dict(fsdp_size=2, pp_size=2), None),
    ("replicate2_pp2", dict(dp_replicate_size=2, pp_size=2), None),
    ("tp2_pp2", dict(tp_size=2, pp_size=2), None),
    ("hsdp", dict(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=2), None),
    ("ep_eq_fsdp_tp", dict(tp_size=2, fsdp_size=4, ep_size=8), None),
    ("tp_plan_invalid_type", dict(tp_size=2, tp_plan=3), None),
    ("ep_implementation_not_checked", dict(ep_implementation="nonsense"), None),
]


# Every family's plans on these layouts (tests/distributed/test_family_plans.py): TP with and without FSDP,
# TP + FSDP + EP, EP over all of TP, EP over all of FSDP. A family the reference gives no plan of some kind
# records that plan empty (gpt-oss's TP), or the reference's error (Llama 4 has no EP plan).
FAMILY_PLAN_LAYOUTS = [
    ("tp2", dict(tp_size=2)),
    ("tp2_fsdp4", dict(tp_size=2, fsdp_size=4)),
    ("tp2_fsdp4_ep4", dict(tp_size=2, fsdp_size=4, ep_size=4)),
    ("tp8_ep8", dict(tp_size=8, ep_size=8)),
    ("fsdp8_ep8", dict(fsdp_size=8, ep_size=8)),
]


def family_configs() -> dict[str, dict]:
    """{model_type: tiny config} of every family, as the model fixtures and parity tests build them."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.models.hf_reference import (
        TINY_DEEPSEEK_V3,
        TINY_GPT_OSS,
        TINY_LLAMA4,
        TINY_MIXTRAL,
        TINY_OLMOE,
        TINY_QWEN2_MOE,
        TINY_QWEN3_MOE,
    )

    return {"qwen3_moe": TINY_QWEN3_MOE, "qwen2_moe": TINY_QWEN2_MOE, "olmoe": TINY_OLMOE,
            "mixtral": TINY_MIXTRAL, "gpt_oss": TINY_GPT_OSS, "deepseek_v3": TINY_DEEPSEEK_V3,
            "llama4_text": TINY_LLAMA4}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _tiny_model(**config_changes):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **config_changes}))


def _run_config_case(kwargs, world_size):
    import os
    import warnings

    from transformers.distributed.configuration_utils import DistributedConfig

    saved = os.environ.pop("WORLD_SIZE", None)
    if world_size:
        os.environ["WORLD_SIZE"] = world_size
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                config = DistributedConfig(**kwargs)
            except (ValueError, OSError) as error:
                return {"error": f"{type(error).__name__}: {error}"}
        return {
            "to_dict": config.to_dict(),
            "efsdp_size": config.efsdp_size,
            "dp_size": config.dp_size,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        }
    finally:
        os.environ.pop("WORLD_SIZE", None)
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved


def _run_plan_case(kwargs, config_changes):
    import warnings

    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.utils import logging as hf_logging

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DistributedConfig(**kwargs)
    model = _tiny_model(**config_changes)
    handler = _Records()
    hf_logger = hf_logging.get_logger("transformers.distributed.mixin")
    hf_logger.addHandler(handler)
    try:
        tp, ep, fsdp = model._resolve_parallel_plans(config)
        result = {"tp": list(tp.items()), "ep": list(ep.items()), "fsdp": list(fsdp.items())}
    except (ValueError, OSError) as error:
        result = {"error": f"{type(error).__name__}: {error}"}
    finally:
        hf_logger.removeHandler(handler)
    result["warnings"] = handler.messages
    result["model_plans_after"] = {
        "tp_plan": dict(model.tp_plan),
        "ep_plan": dict(model.ep_plan),
        "fsdp_plan": dict(model.fsdp_plan),
    }
    return result


def _family_model(model_type: str, config_values: dict):
    import torch
    import transformers

    config_class = transformers.AutoConfig.for_model(model_type).__class__
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config_class(**config_values))


def family_plan_case(model_type: str, config_values: dict) -> dict:
    """One family's tiny model: its config, composed plans, and per layout the resolved + expanded plans
    {"tp" | "ep" | "fsdp": [[name, style], ...]} or {"error": text}, each layout on a fresh model."""
    import warnings

    from transformers.distributed.configuration_utils import DistributedConfig

    model = _family_model(model_type, config_values)
    layouts = {}
    for name, kwargs in FAMILY_PLAN_LAYOUTS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = DistributedConfig(**kwargs)
        try:
            tp, ep, fsdp = _family_model(model_type, config_values)._resolve_parallel_plans(config)
            result = {"tp": list(tp.items()), "ep": list(ep.items()), "fsdp": list(fsdp.items())}
        except (ValueError, OSError) as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        layouts[name] = {"kwargs": kwargs, **result}
    return {
        "model_config": config_values,
        "plans": {kind: dict(getattr(model, kind)) for kind in ("tp_plan", "ep_plan", "fsdp_plan")},
        "layouts": layouts,
    }


def build_family_plan_cases() -> dict:
    return {model_type: family_plan_case(model_type, values)
            for model_type, values in family_configs().items()}


def build_fixture() -> dict:
    import transformers

    # Building a model imports the styles in the order a user's program does; the registry's order shows
    # in the "Unsupported styles" error text.
    model = _tiny_model()
    from transformers.distributed.fsdp import ALL_FSDP_STYLES
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return {
        "transformers_version": transformers.__version__,
        "model_config": TINY_QWEN3_MOE,
        "modules": [name for name, _ in model.named_modules()],
        "parameters": [[name, list(param.shape)] for name, param in model.named_parameters()],
        "plans": {
            "tp_plan": dict(model.tp_plan),
            "ep_plan": dict(model.ep_plan),
            "fsdp_plan": dict(model.fsdp_plan),
        },
        "parallel_styles": list(ALL_PARALLEL_STYLES),
        "fsdp_styles": list(ALL_FSDP_STYLES),
        "config_cases": {name: {"kwargs": kwargs, "world_size": world, **_run_config_case(kwargs, world)}
                         for name, kwargs, world in CONFIG_CASES},
        "all_sparse_modules": [name for name, _ in _tiny_model(**ALL_SPARSE).named_modules()],
        "all_sparse_parameters": [
            [name, list(param.shape)] for name, param in _tiny_model(**ALL_SPARSE).named_parameters()
        ],
        "plan_cases": {
            name: {"kwargs": kwargs, "model_config_changes": {}, **_run_plan_case(kwargs, {})}
            for name, kwargs in PLAN_CASES
        },
        "all_sparse_plan_cases": {
            name: {"kwargs": kwargs, "model_config_changes": ALL_SPARSE, **_run_plan_case(kwargs, ALL_SPARSE)}
            for name, kwargs in ALL_SPARSE_PLAN_CASES
        },
        "family_plan_cases": build_family_plan_cases(),
    }


def main() -> int:
    fixture = build_fixture()
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=False) + "\n")
    print(f"wrote {FIXTURE} ({len(fixture['plan_cases'])} plan cases, {len(fixture['config_cases'])} config "
          f"cases, {len(fixture['family_plan_cases'])} families x {len(FAMILY_PLAN_LAYOUTS)} layouts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
