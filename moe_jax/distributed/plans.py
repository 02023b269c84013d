"""Sharding plans: composition, user overrides, validation, EP-over-TP precedence and wildcard expansion.

Plans are plain dicts from HF module/parameter names with `*` for layer numbers to style names, exactly as
in Transformers:

    {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.mlp.experts": "ep_dispatch_experts"}

`PlannedModel` gives a model the reference's plan attributes (`tp_plan`, `ep_plan`, `fsdp_plan`,
`pp_plan`, their setters and checks); `resolve_parallel_plans(model, config)` merges a
`DistributedConfig`'s overrides and returns the expanded plans (one entry per concrete module or
parameter), step for step as `DistributedMixin._resolve_parallel_plans` does.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from itertools import chain

from ..module_tree import ModuleTree
from .config import DistributedConfig
from .runtime import is_main_process
from .styles import ALL_FSDP_STYLES, ALL_PARALLEL_STYLES, unsupported_styles_error

logger = logging.getLogger(__name__)

PLAN_KINDS = ("tp", "ep", "fsdp", "pp")

# `PreTrainedConfig.base_model_fsdp_plan`'s default: every config gets it unless it sets its own.
DEFAULT_BASE_MODEL_FSDP_PLAN = {
    "embed_tokens": "free_full_weight",
    "layers.*": "free_full_weight",
    "norm": "keep_full_weight",
}

REMOVED_EP_ROUTER_ERROR = (
    "The `ep_router` style was removed, and `moe_tp_experts` is a tensor-parallel style that belongs in "
    "`tp_plan`. Drop the router rule and shard the experts by expert with `ep_dispatch_experts` and "
    "`grouped_gemm`, e.g. `ep_plan={'layers.*.mlp.experts': 'ep_dispatch_experts', "
    "'layers.*.mlp.experts.gate_up_proj': 'grouped_gemm', 'layers.*.mlp.experts.down_proj': "
    "'grouped_gemm'}` (most MoE models default to this plan, so `ep_plan` can usually be left out). "
    '`DistributedConfig(ep_implementation="all_reduce")` gives the masking and all-reduce of the old '
    "`ep_router` + `moe_tp_experts` plan."
)


@functools.lru_cache(maxsize=1 << 16)   # every plan resolution asks it of every parameter and module name
def replace_layer_number_by_wildcard(name: str) -> str:
    """`model.layers.3.mlp` -> `model.layers.*.mlp`: only dot-delimited numbers, so `w1` stays `w1`."""
    return re.sub(r"\.\d+(\.|$)", lambda match: ".*" + match.group(1), name)


def parameter_plan(name: str, plan: dict[str, str], is_weight: bool = True) -> str | None:
    """The style of a module or parameter: its own wildcarded rule, else (parameters only) its module's."""
    generic_name = replace_layer_number_by_wildcard(name)
    if generic_name in plan:
        return plan[generic_name]
    if is_weight and "." in generic_name:
        module_name = generic_name.rsplit(".", 1)[0]
        if module_name in plan:
            return plan[module_name]
    return None


class PlannedModel:
    """Plan attributes of a model, as `transformers.distributed.DistributedMixin` gives them.

    Subclasses set class-level `_tp_plan`, `_ep_plan`, `_fsdp_plan`, `_pp_plan` (head rules, e.g.
    `{"lm_head": "colwise_gather_output"}`) and `base_model_prefix`; the base model's rules come from
    `base_model_plans` (the HF config's `base_model_{kind}_plan`). Instances must provide `module_tree`.
    """

    _tp_plan: dict[str, str] | None = None
    _ep_plan: dict[str, str] | None = None
    _fsdp_plan: dict[str, str] | None = None
    _pp_plan: dict | None = None
    base_model_prefix: str | None = "model"
    module_tree: ModuleTree
    # Name of the input-embedding module of the base model (relative to it), if it is an embedding.
    base_model_embedding: str | None = "embed_tokens"
    # Names of the input embedding and output head when their weights are tied, else None.
    tied_embedding_modules: tuple[str, str] | None = None

    def init_parallel_plans(self, base_model_plans: dict[str, dict | None]) -> None:
        """Copy the class plans and add the base model's rules under `base_model_prefix`."""
        model_class = type(self)
        plans = {kind: dict(getattr(model_class, f"_{kind}_plan", None) or {}) for kind in PLAN_KINDS}
        base = {kind: dict(base_model_plans.get(kind) or {}) for kind in PLAN_KINDS}
        # Shard the input embeddings on the vocabulary unless the plan already names them.
        if base["tp"] and self.base_model_embedding is not None:
            base["tp"] = {self.base_model_embedding: "embedding_rowwise", **base["tp"]}
        for kind in PLAN_KINDS:
            if self.base_model_prefix:
                plans[kind].update({f"{self.base_model_prefix}.{key}": style for key, style in base[kind].items()})
            else:
                plans[kind].update(base[kind])
            setattr(self, f"_{kind}_plan", plans[kind])

    # Properties and setters behave as the reference's.
    @property
    def tp_plan(self) -> dict[str, str]:
        """The full tensor-parallel plan (wildcard keys)."""
        return self._tp_plan

    @tp_plan.setter
    def tp_plan(self, plan: dict[str, str] | None) -> None:
        self._set_plan("tp_plan", plan, ALL_PARALLEL_STYLES)

    @property
    def ep_plan(self) -> dict[str, str]:
        """The full expert-parallel plan (wildcard keys), kept apart from `tp_plan`."""
        return self._ep_plan

    @ep_plan.setter
    def ep_plan(self, plan: dict[str, str] | None) -> None:
        self._set_plan("ep_plan", plan, ALL_PARALLEL_STYLES)

    @property
    def fsdp_plan(self) -> dict[str, str]:
        return self._fsdp_plan

    @fsdp_plan.setter
    def fsdp_plan(self, plan: dict[str, str] | None) -> None:
        self._set_plan("fsdp_plan", plan, ALL_FSDP_STYLES)

    @property
    def pp_plan(self) -> dict:
        return self._pp_plan

    @pp_plan.setter
    def pp_plan(self, plan: dict | None) -> None:
        self._set_plan("pp_plan", plan, None)

    def merge_plan_overrides(self, config: DistributedConfig) -> None:
        """Merge `config`'s `tp_plan` / `ep_plan` / `fsdp_plan` overrides into this model's plans, key by key
        (an empty `tp_plan={}` clears the TP plan), as the reference's model does; the merged plans stay on
        the model. Keys that match no module or parameter raise."""
        names = self.plan_names()
        for plan_name in ("tp_plan", "ep_plan", "fsdp_plan"):
            override = getattr(config, plan_name)
            if isinstance(override, dict):
                plan = getattr(self, plan_name)
                if unknown := override.keys() - names - plan.keys():
                    raise ValueError(f"`{plan_name}` keys {sorted(unknown)} match nothing in {type(self).__name__}.")
                merged = {} if plan_name == "tp_plan" and not override else plan | override
                setattr(self, f"_{plan_name}", merged)

    def _set_plan(self, plan_name: str, plan: dict | None, styles) -> None:
        if plan is None:
            setattr(self, f"_{plan_name}", {})
            return
        if not isinstance(plan, dict):
            raise ValueError(f"Can only set a dictionary as `{plan_name}`")
        if styles is not None:
            self._validate_parallel_plan(plan, styles, plan_name)
        setattr(self, f"_{plan_name}", plan)

    def plan_names(self) -> set[str]:
        """Every module and parameter name with layer numbers replaced by `*`."""
        tree = self.module_tree
        return {
            replace_layer_number_by_wildcard(name)
            for name in chain(tree.named_modules(), (name for name, _ in tree.named_parameters()))
        }

    def _validate_parallel_plan(self, plan: dict[str, str], styles, plan_name: str, names=None) -> None:
        """Raise on a style the registry does not know; warn on a rule that names nothing in the model."""
        if error := unsupported_styles_error(plan, styles, plan_name):
            raise error
        names = self.plan_names() if names is None else names
        if unused := plan.keys() - names:
            if is_main_process():
                logger.warning(
                    f"`{plan_name}` rules {sorted(unused)} match nothing in {type(self).__name__} "
                    "and will not be applied."
                )


@dataclass(frozen=True)
class ResolvedPlans:
    """Expanded plans: one concrete module or parameter name per entry, in application order."""

    tp: dict[str, str]
    ep: dict[str, str]
    fsdp: dict[str, str]


def expand_parallel_plan(tree: ModuleTree, plan: dict[str, str]) -> dict[str, str]:
    """Replace `*` by layer numbers: FSDP rules list modules; TP/EP rules list a module's own parameters
    (to shard) before the module itself (to run its forward)."""
    params_by_module: dict[str, list[str]] = {}
    for name in tree.params:
        params_by_module.setdefault(name.rpartition(".")[0], []).append(name)
    expanded: dict[str, str] = {}
    for module_name in tree.named_modules():
        module_style = parameter_plan(module_name, plan, is_weight=False)
        if module_style in ALL_FSDP_STYLES:
            expanded[module_name] = module_style
            continue
        for param_name in params_by_module.get(module_name, ()):
            if (param_style := parameter_plan(param_name, plan, is_weight=True)) is not None:
                expanded[param_name] = param_style
        if module_style is not None:
            expanded[module_name] = module_style
    return expanded


def _resolve_tied_embedding_fsdp_plan(model: PlannedModel, fsdp_plan: dict[str, str]) -> dict[str, str]:
    """Tied embedding and head share one weight: the embedding's rule is dropped, and a `keep_full_weight`
    head rule moves to the embedding (the reference wraps the tied weight once)."""
    if not fsdp_plan or model.tied_embedding_modules is None:
        return fsdp_plan
    embedding, head = model.tied_embedding_modules
    adapted = dict(fsdp_plan)
    adapted.pop(embedding, None)
    if fsdp_plan.get(head) == "keep_full_weight":
        adapted.pop(head, None)
        adapted[embedding] = "keep_full_weight"
    return adapted


def resolve_parallel_plans(model: PlannedModel, config: DistributedConfig) -> ResolvedPlans:
    """The TP, EP and FSDP plans `config` applies to `model`, expanded to concrete names.

    Overrides in `config` are first merged into the model's plans (`PlannedModel.merge_plan_overrides`:
    they persist on the model, as in the reference); unknown override keys raise before anything is
    sharded. A module with an EP rule keeps no TP rule. The reference's FSDP2 dtype groups (`_keep_in_fp32_modules`) are a PyTorch wrapping
    constraint with no JAX counterpart and are not added.
    """
    tree = model.module_tree
    names = model.plan_names()
    model.merge_plan_overrides(config)

    tp_plan = dict(model.tp_plan) if config.tp_size > 1 else {}
    ep_plan = dict(model.ep_plan) if config.ep_size > 1 else {}
    fsdp_plan = dict(model.fsdp_plan) if config.dp_size > 1 else {}

    for kind, plan in (("tp", tp_plan), ("ep", ep_plan), ("fsdp", fsdp_plan)):
        size = config.dp_size if kind == "fsdp" else getattr(config, f"{kind}_size")
        if size > 1 and not plan:
            raise ValueError(
                f"`{kind}_size={size}` was requested, but `{type(model).__name__}` has no `{kind}_plan`. Pass "
                f"`{kind}_plan` in `DistributedConfig`, add `base_model_{kind}_plan` to the model's config, "
                f"or set `{kind}_size=1`."
            )

    if "ep_router" in ep_plan.values() or "moe_tp_experts" in ep_plan.values():
        raise ValueError(REMOVED_EP_ROUTER_ERROR)

    # EP rules take precedence: drop TP rules on EP modules and everything under them.
    if ep_plan:
        is_expert = re.compile(rf"(?:{'|'.join(map(re.escape, ep_plan))})(?:\..+)?").fullmatch
        tp_plan = {name: style for name, style in tp_plan.items() if not is_expert(name)}

    model._validate_parallel_plan(tp_plan, ALL_PARALLEL_STYLES, "tp_plan", names)
    model._validate_parallel_plan(ep_plan, ALL_PARALLEL_STYLES, "ep_plan", names)
    model._validate_parallel_plan(fsdp_plan, ALL_FSDP_STYLES, "fsdp_plan", names)
    config.validate_resolved_ep_plan(ep_plan)

    fsdp_plan = _resolve_tied_embedding_fsdp_plan(model, fsdp_plan)

    expanded_fsdp = expand_parallel_plan(tree, fsdp_plan)
    # Children before parents, as FSDP2 needs (stable sort keeps model order within a depth).
    expanded_fsdp = dict(sorted(expanded_fsdp.items(), key=lambda item: item[0].count("."), reverse=True))
    return ResolvedPlans(
        tp=expand_parallel_plan(tree, tp_plan),
        ep=expand_parallel_plan(tree, ep_plan),
        fsdp=expanded_fsdp,
    )
