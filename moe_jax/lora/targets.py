"""Which weights of a model a `LoraConfig` adapts, matched as PEFT matches them.

`target_modules` names `torch.nn.Linear` modules: a list entry matches a module whose name equals it or ends
with "." + it, a string is a regular expression the whole module name must match, "all-linear" is every
linear module but the output layer. `target_parameters` names parameters (`module.parameter`) the same way, and
adapts 2-D weights and the fused 3-D expert weights ([E, ...], one adapter per expert). A name that matches
nothing, or matches something PEFT cannot adapt that way, is refused naming the closest valid name.

PEFT nests one `ParamWrapper` per targeted parameter of a module, the module's first declared parameter
innermost; its file keys say how deep (`.base_layer` once per wrapper outside), kept here as `wrappers_outside`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from ..models.family import Family
from ..module_tree import ModuleTree
from .config import LoraConfig

# HF's routers that are not `torch.nn.Linear` (a router class holding a `weight` parameter): PEFT's
# target_modules cannot adapt them, its target_parameters can (`mlp.gate.weight`). Llama 4's router is a Linear.
ROUTERS_NOT_LINEAR: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("mlp.gate",), "qwen2_moe": ("mlp.gate",), "olmoe": ("mlp.gate",), "mixtral": ("mlp.gate",),
    "deepseek_v3": ("mlp.gate",), "gpt_oss": ("mlp.router",),
}
EMBEDDING_MODULES = ("embed_tokens",)
OUTPUT_LAYER = "lm_head"
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Target:
    """One adapted weight. parameter: its HF name; module / name: where it lives; experts: E for a fused [E, ...]
    expert weight (one adapter per expert), None for a 2-D weight; in_features / out_features: PEFT's (A is
    [r, I], B [O, r], per expert); transposed: PEFT reads the [E, ...] weight as [E, I, O] (HF's
    `is_transposed`); wrappers_outside: PEFT's `.base_layer` segments in its file key."""

    parameter: str
    module: str
    name: str
    experts: int | None
    in_features: int
    out_features: int
    transposed: bool = False
    wrappers_outside: int = 0

    def factor_shapes(self, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of A and B as moe_jax stores them: [r, I] / [O, r], or [E, r, I] / [E, O, r]."""
        if self.experts is None:
            return (r, self.in_features), (self.out_features, r)
        return (self.experts, r, self.in_features), (self.experts, self.out_features, r)


def linear_modules(tree: ModuleTree) -> dict[str, tuple[int, ...]]:
    """Module -> weight shape of every `torch.nn.Linear` of the tree: a 2-D `weight` (and at most a `bias`, and
    the scale of a quantised weight, `weight_scale_inv` / `weight_scale`: QLoRA's frozen quantised base),
    embeddings left out."""
    params = dict(tree.named_parameters())
    found = {}
    for name, spec in params.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(spec.shape) != 2 or module.rpartition(".")[2] in EMBEDDING_MODULES:
            continue
        others = [other for other in params if other.startswith(module + ".") and other != name]
        if all(other in (module + ".bias", module + ".weight_scale_inv", module + ".weight_scale") for other in others):
            found[module] = spec.shape
    return found


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _closest(wanted: str, names: list[str]) -> str:
    """The valid names closest to `wanted`, said for an error."""
    suffixes = sorted({".".join(name.split(".")[-depth:]) for name in names for depth in (1, 2, 3)})
    close = difflib.get_close_matches(wanted, suffixes, n=3, cutoff=0.4)
    return f"closest: {', '.join(close)}" if close else f"e.g. {', '.join(suffixes[:3])}"


def _not_linear(model_type: str, module: str) -> bool:
    return any(module.endswith("." + router) for router in ROUTERS_NOT_LINEAR.get(model_type, ()))


def module_targets(config: LoraConfig, tree: ModuleTree, model_type: str) -> list[Target]:
    """The `target_modules` targets: one 2-D weight each."""
    wanted = config.target_modules
    if not wanted:
        return []
    linear = linear_modules(tree)
    modules = [module for module in tree.named_modules() if module]
    if wanted == ALL_LINEAR:
        matched = [module for module in linear if module != OUTPUT_LAYER and not _not_linear(model_type, module)]
    elif isinstance(wanted, str):
        pattern = re.compile(wanted)
        matched = [module for module in modules if pattern.fullmatch(module)]
        if not matched:
            raise ValueError(f"target_modules={wanted!r} (a regular expression over whole module names) matches "
                             f"no module of this model ({_closest(wanted, list(linear))}).")
    else:
        matched = []
        for target in wanted:
            hits = [module for module in modules if _matches(module, target)]
            if not hits:
                raise ValueError(f"target_modules entry {target!r} matches no module of this model "
                                 f"({_closest(target, list(linear))}).")
            matched += hits
    targets = []
    for module in dict.fromkeys(matched):
        if module not in linear or _not_linear(model_type, module):
            raise ValueError(_not_adaptable_module(module, model_type, tree))
        out_features, in_features = linear[module]
        targets.append(Target(f"{module}.weight", module, "weight", None, in_features, out_features))
    return targets


def _not_adaptable_module(module: str, model_type: str, tree: ModuleTree) -> str:
    leaf = module.rpartition(".")[2]
    if leaf in EMBEDDING_MODULES:
        return f"target_modules matched {module}, an embedding: LoRA on embeddings is not supported."
    if _not_linear(model_type, module):
        return (f"target_modules matched {module}, HF's router, which is not a torch.nn.Linear (PEFT cannot adapt it "
                f"as a module either); target its weight instead: target_parameters=['{module.split('.')[-2]}."
                f"{leaf}.weight'].")
    fused = [name for name, spec in tree.named_parameters() if name.startswith(module + ".") and len(spec.shape) == 3]
    if fused:
        names = sorted({".".join(name.split(".")[-3:]) for name in fused})
        return (f"target_modules matched {module}, which is not a torch.nn.Linear: adapt its fused expert weights "
                f"with target_parameters={names}.")
    return f"target_modules matched {module}, which is not a torch.nn.Linear; name linear modules (q_proj, ...)."


def parameter_targets(config: LoraConfig, tree: ModuleTree, family: Family) -> list[Target]:
    """The `target_parameters` targets: 2-D linear weights and fused 3-D expert weights."""
    wanted = config.target_parameters
    if not wanted:
        return []
    linear = linear_modules(tree)
    params = [(name, spec) for name, spec in tree.named_parameters() if not spec.buffer]
    names = [name for name, _ in params]
    for target in wanted:
        if not any(_matches(name, target) for name in names):
            raise ValueError(f"target_parameters entry {target!r} matches no parameter of this model "
                             f"({_closest(target, names)}).")
    chosen = [(name, spec) for name, spec in params if any(_matches(name, target) for target in wanted)]
    per_module: dict[str, list[str]] = {}
    for name, _ in chosen:
        per_module.setdefault(name.rpartition(".")[0], []).append(name)
    targets = []
    for name, spec in chosen:
        module, _, leaf = name.rpartition(".")
        outside = len(per_module[module]) - 1 - per_module[module].index(name)
        if len(spec.shape) == 3:
            experts, first, second = spec.shape
            transposed = family.experts_transposed
            in_features, out_features = (first, second) if transposed else (second, first)
            targets.append(Target(name, module, leaf, experts, in_features, out_features, transposed, outside))
        elif len(spec.shape) == 2 and leaf == "weight" and (module in linear
                                                            or _not_linear(family.model_type, module)):
            targets.append(Target(name, module, leaf, None, spec.shape[1], spec.shape[0], False, outside))
        else:
            raise ValueError(f"target_parameters matched {name} {list(spec.shape)}: only 2-D linear weights and "
                             "3-D fused expert weights can be adapted.")
    return targets


def find_targets(config: LoraConfig, tree: ModuleTree, family: Family) -> list[Target]:
    """Every weight `config` adapts on a model of `family` declared by `tree`, in declaration order."""
    targets = module_targets(config, tree, family.model_type) + parameter_targets(config, tree, family)
    seen: dict[str, Target] = {}
    for target in targets:
        if target.parameter in seen:
            raise ValueError(f"{target.parameter} is adapted twice (by target_modules and by target_parameters); "
                             "name it in one of them.")
        seen[target.parameter] = target
    order = {name: index for index, (name, _) in enumerate(tree.named_parameters())}
    return sorted(targets, key=lambda target: order[target.parameter])
