"""Per-architecture tables: which hub (Hugging Face checkpoint) keys make which moe_jax parameter.

Each rule reads "parameter `param` is built from the hub tensors `hub` by `transforms`" (load direction);
export runs the same rule backwards (see `converters.transforms`). A parameter no rule names is stored under
its own name, unchanged: attention, norms, embeddings, routers, and checkpoints already in the fused
in-memory layout (`...experts.gate_up_proj`).

    qwen3_moe, layer 1 (E experts, moe_intermediate_size I, hidden_size H):
    hub  model.layers.1.mlp.experts.{j}.gate_proj.weight [I, H]  \\  StackExperts, ConcatGateUp
    hub  model.layers.1.mlp.experts.{j}.up_proj.weight   [I, H]  /  -> model.layers.1.mlp.experts.gate_up_proj [E, 2I, H]
    hub  model.layers.1.mlp.experts.{j}.down_proj.weight [H, I]  StackExperts
                                                                 -> model.layers.1.mlp.experts.down_proj [E, H, I]

These are the transforms of transformers 5.23's `conversion_mapping.py` (`MergeModulelist(dim=0)` then
`Concatenate(dim=1)`) for `qwen2_moe` (which `qwen3_moe` and `olmoe` reuse) and `mixtral`.

When several rules name the same parameter, a checkpoint may use any one of them (two at once is a
duplicate); export writes the first.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .fp8 import DEFAULT_BLOCK, DequantizeFP8
from .key_patterns import KeyPattern
from .lazy_tensors import LayoutError, LazyTensor
from .mxfp4 import DequantizeMXFP4
from .transforms import ConcatGateUp, StackExperts, Transform, is_tensor_value

EXPERT = "expert"  # the placeholder numbering per-expert hub tensors


@dataclass(frozen=True)
class KeyRule:
    """Parameter `param` <- hub tensors `hub` through `transforms` (applied in order on load).

    `param` and every `hub` pattern share placeholders (e.g. `{layer}`); hub patterns may add `{expert}`,
    which needs a `StackExperts` step. A rule without transforms is a renaming.
    """

    param: KeyPattern
    hub: tuple[KeyPattern, ...]
    transforms: tuple[Transform, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "param", _pattern(self.param))
        hub = (self.hub,) if isinstance(self.hub, (str, KeyPattern)) else tuple(self.hub)
        object.__setattr__(self, "hub", tuple(_pattern(pattern) for pattern in hub))
        object.__setattr__(self, "transforms", tuple(self.transforms))
        stacks = any(transform.stacks_experts for transform in self.transforms)
        for pattern in self.hub:
            extra = set(pattern.placeholders) - set(self.param.placeholders)
            lacking = set(self.param.placeholders) - set(pattern.placeholders)
            if lacking:
                raise ValueError(f"Hub pattern {pattern} lacks placeholders {sorted(lacking)} of {self.param}.")
            if extra - {EXPERT} or (extra and not stacks):
                raise ValueError(
                    f"Hub pattern {pattern} adds placeholders {sorted(extra)} that rule {self.param} cannot fill; "
                    "only {expert} is allowed, together with a StackExperts step."
                )

    @property
    def invertible(self) -> bool:
        return all(transform.invertible for transform in self.transforms)

    def per_expert(self, hub_position: int) -> bool:
        return EXPERT in self.hub[hub_position].placeholders

    def hub_keys(self, bindings: dict[str, int], num_experts: int) -> list[list[str] | str]:
        """The hub keys this rule reads for one parameter, per hub pattern (lists for per-expert patterns)."""
        keys: list[list[str] | str] = []
        for position, pattern in enumerate(self.hub):
            if self.per_expert(position):
                keys.append([pattern.format(**bindings, **{EXPERT: e}) for e in range(num_experts)])
            else:
                keys.append(pattern.format(**bindings))
        return keys

    def build(self, leaves: list[list[LazyTensor] | LazyTensor]) -> LazyTensor:
        """Run the load transforms on the hub tensors (as `hub_keys` orders them); raises `LayoutError`."""
        values = list(leaves)
        for transform in self.transforms:
            values = transform.load(values)
        if len(values) != 1 or not is_tensor_value(values[0]):
            raise LayoutError("shape", f"rule {self.param} does not reduce its hub tensors to one parameter")
        return values[0]

    def export(self, param_name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """`(hub key, array)` pairs for one parameter: shared patterns first, then expert by expert."""
        bindings = self.param.match(param_name)
        if bindings is None:
            raise KeyError(f"{param_name} is not an instance of {self.param}.")
        values: list = [array]
        for transform in reversed(self.transforms):
            values = transform.export(values)
        if len(values) != len(self.hub):
            raise ValueError(f"Rule {self.param} exported {len(values)} values for {len(self.hub)} hub patterns.")
        pairs = [
            (pattern.format(**bindings), value)
            for position, (pattern, value) in enumerate(zip(self.hub, values))
            if not self.per_expert(position)
        ]
        per_expert = [(pattern, value) for position, (pattern, value) in enumerate(zip(self.hub, values))
                      if self.per_expert(position)]
        # Expert-major order keeps one expert's gate and up next to each other, usually in the same shard.
        num_experts = len(per_expert[0][1]) if per_expert else 0
        for expert in range(num_experts):
            pairs.extend((pattern.format(**bindings, **{EXPERT: expert}), value[expert]) for pattern, value in per_expert)
        return pairs


def rename(hub: str, param: str) -> KeyRule:
    """A rule that only renames: hub key `hub` holds parameter `param` unchanged."""
    return KeyRule(param=param, hub=(hub,))


@dataclass(frozen=True)
class KeyMap:
    """An architecture's rules; parameters no rule names are stored under their own name.

    `load_only` rules are further hub layouts a checkpoint may use (quantised tensors, dequantised by a
    one-way transform); they are read, never written: export uses `rules`, else the parameter's own name.
    A layout may extend another (an FP8 weight is the plain weight's key plus its `weight_scale_inv`): it is
    recognised by the keys the other lacks (`markers`). `ignored` are regular expressions of hub keys that
    belong to no parameter on purpose (DeepSeek-V3's multi-token-prediction layers of a model that does not hold
    them): loading skips them.
    `hub_prefix` is stripped from hub keys on load (a multimodal checkpoint's `language_model.`); exports
    write the text model's own keys, without it. `shared_reads` name parameters read from the same hub tensors.
    """

    architecture: str
    rules: tuple[KeyRule, ...]
    load_only: tuple[KeyRule, ...] = ()
    ignored: tuple[str, ...] = ()
    hub_prefix: str = ""
    # Pairs of parameter patterns that read the same hub tensors on purpose (a weight quantised as it is read:
    # its codes and its scales both come from the plain weight).
    shared_reads: tuple[tuple[str, str], ...] = ()

    def reads_together(self, first: str, second: str) -> bool:
        """Whether parameters `first` and `second` may both read a hub tensor (`shared_reads`)."""
        return any(KeyPattern(a).match(first) is not None and KeyPattern(b).match(second) is not None
                   for a, b in self.shared_reads)

    @property
    def load_rules(self) -> tuple[KeyRule, ...]:
        return self.rules + self.load_only

    def markers(self, position: int) -> tuple[KeyPattern, ...]:
        """The hub patterns of load rule `position` whose keys show that a checkpoint uses its layout: all of
        them, less those of a layout it extends (the parameter's own name, a rule with fewer patterns)."""
        rule = self.load_rules[position]
        own = {str(pattern) for pattern in rule.hub}
        # A rule reading only the parameter's own key (a weight quantised as it is read) is marked by that key.
        extended = {str(rule.param)} if own != {str(rule.param)} else set()
        for other in self.load_rules:
            other_patterns = {str(pattern) for pattern in other.hub}
            if str(other.param) == str(rule.param) and other_patterns < own:
                extended |= other_patterns
        return tuple(pattern for pattern in rule.hub if str(pattern) not in extended)

    def is_ignored(self, key: str) -> bool:
        return any(re.fullmatch(pattern, key) for pattern in self.ignored)

    def rules_for(self, param_name: str, *, loading: bool = True) -> list[tuple[int, KeyRule, dict[str, int]]]:
        """Every rule that can produce `param_name` (with `loading=False`, only those export may use):
        `(rule position, rule, placeholder values)`."""
        found = []
        for position, rule in enumerate(self.load_rules if loading else self.rules):
            bindings = rule.param.match(param_name)
            if bindings is not None:
                found.append((position, rule, bindings))
        return found

    def to_hub(self, param_name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """One parameter in hub layout: `(hub key, array)` pairs (views of `array`, no copies)."""
        matches = self.rules_for(param_name, loading=False)
        if not matches:
            return [(param_name, array)]
        _, rule, _ = matches[0]
        if not rule.invertible:
            one_way = [type(t).__name__ for t in rule.transforms if not t.invertible]
            raise TypeError(
                f"Cannot export {param_name}: rule {rule.param} of key map {self.architecture!r} uses one-way "
                f"transform(s) {one_way}. Export with a key map whose rule for it is invertible."
            )
        return rule.export(param_name, array)


def _pattern(value: str | KeyPattern) -> KeyPattern:
    return value if isinstance(value, KeyPattern) else KeyPattern(value)


# Tables. `{layer}` and `{expert}` stand for ModuleList indices.

QWEN2_MOE = KeyMap(
    "qwen2_moe",
    (
        KeyRule(
            param="model.layers.{layer}.mlp.experts.gate_up_proj",  # [E, 2I, H]
            hub=(
                "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",  # [I, H]
                "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",  # [I, H]
            ),
            transforms=(StackExperts(), ConcatGateUp()),
        ),
        KeyRule(
            param="model.layers.{layer}.mlp.experts.down_proj",  # [E, H, I]
            hub=("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",),  # [H, I]
            transforms=(StackExperts(),),
        ),
    ),
)

MIXTRAL = KeyMap(
    "mixtral",
    (
        KeyRule(
            param="model.layers.{layer}.mlp.experts.gate_up_proj",  # [E, 2I, H]
            hub=(
                "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",  # gate [I, H]
                "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",  # up [I, H]
            ),
            transforms=(StackExperts(), ConcatGateUp()),
        ),
        KeyRule(
            param="model.layers.{layer}.mlp.experts.down_proj",  # [E, H, I]
            hub=("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",),  # [H, I]
            transforms=(StackExperts(),),
        ),
        rename("model.layers.{layer}.block_sparse_moe.gate.weight", "model.layers.{layer}.mlp.gate.weight"),
    ),
)

# gpt-oss's bf16 hub checkpoints hold the in-memory layout (fused, transposed experts with biases): every
# parameter under its own name. The released MXFP4 checkpoints hold `{proj}_blocks` + `{proj}_scales`
# instead, dequantised on load (converters/mxfp4.py); exports write the plain layout.
GPT_OSS = KeyMap(
    "gpt_oss",
    rules=(),
    load_only=tuple(
        KeyRule(param=f"model.layers.{{layer}}.mlp.experts.{proj}",
                hub=(f"model.layers.{{layer}}.mlp.experts.{proj}_blocks",
                     f"model.layers.{{layer}}.mlp.experts.{proj}_scales"),
                transforms=(DequantizeMXFP4(),))
        for proj in ("gate_up_proj", "down_proj")
    ),
)

# DeepSeek-V3's FP8 hub checkpoints quantise every linear layer but the router and lm_head: `{module}.weight`
# float8 plus `{module}.weight_scale_inv`, per expert for the routed experts (converters/fp8.py). These rules
# are load-only; exports write the plain per-expert bf16/fp32 layout of QWEN2_MOE's rules.
DEEPSEEK_V3_FP8_LINEARS = (
    "self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
)


def fp8_rules(linear_modules: tuple[str, ...], block: tuple[int, int]) -> tuple[KeyRule, ...]:
    """Load-only rules reading FP8 `weight` + `weight_scale_inv` pairs: each of `linear_modules` (under
    `model.layers.{layer}.`) and the per-expert `gate_proj`/`up_proj`/`down_proj` of the routed experts."""
    layer = "model.layers.{layer}"
    experts = f"{layer}.mlp.experts.{{expert}}"
    quantised = lambda module: (f"{module}.weight", f"{module}.weight_scale_inv")  # noqa: E731
    plain = tuple(
        KeyRule(param=f"{layer}.{module}.weight", hub=quantised(f"{layer}.{module}"),
                transforms=(DequantizeFP8(block),))
        for module in linear_modules
    )
    return plain + (
        KeyRule(param=f"{layer}.mlp.experts.gate_up_proj",
                hub=quantised(f"{experts}.gate_proj") + quantised(f"{experts}.up_proj"),
                transforms=(DequantizeFP8(block), StackExperts(), ConcatGateUp())),
        KeyRule(param=f"{layer}.mlp.experts.down_proj", hub=quantised(f"{experts}.down_proj"),
                transforms=(DequantizeFP8(block), StackExperts())),
    )


def mtp_layers_ignored(num_hidden_layers: int, mtp_layers: int, held_mtp_layers: int = 0) -> tuple[str, ...]:
    """The hub keys of the multi-token-prediction layers a model does not hold: layers L + held .. L + mtp_layers - 1
    of the `mtp_layers` stored after the L decoder layers (the model holds the first `held_mtp_layers`)."""
    return tuple(rf"model\.layers\.{num_hidden_layers + i}\..*" for i in range(held_mtp_layers, mtp_layers))


def deepseek_v3_key_map(num_hidden_layers: int, mtp_layers: int, block: tuple[int, int] = DEFAULT_BLOCK,
                        held_mtp_layers: int = 0) -> KeyMap:
    """DeepSeek-V3's table: Qwen2-MoE's per-expert rules (the reference aliases its conversion), the FP8 layout
    in blocks of `block` (quantization_config.weight_block_size), and the `mtp_layers` multi-token-prediction
    layers stored after the last decoder layer ignored, but for the first `held_mtp_layers` that the model holds
    (their tensors are parameters under their own names; their blocks' experts and FP8 weights follow the same
    rules as a decoder layer's). The reference ignores `model.layers.61.*`, right only for 61-layer models; here
    the layers ignored are those of the config."""
    return KeyMap("deepseek_v3", QWEN2_MOE.rules, load_only=fp8_rules(DEEPSEEK_V3_FP8_LINEARS, tuple(block)),
                  ignored=mtp_layers_ignored(num_hidden_layers, mtp_layers, held_mtp_layers))


KEY_MAPS: dict[str, KeyMap] = {
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": KeyMap("qwen3_moe", QWEN2_MOE.rules),
    "olmoe": KeyMap("olmoe", QWEN2_MOE.rules),
    "mixtral": MIXTRAL,
    "gpt_oss": GPT_OSS,
    # Without its config: no MTP layer skipped (`checkpoint_key_map` with the config knows its layers).
    "deepseek_v3": deepseek_v3_key_map(0, 0),
    # Llama 4's text checkpoints hold the in-memory layout (fused [E, H, 2I] experts): no renaming.
    "llama4_text": KeyMap("llama4_text", ()),
    # A multimodal Llama 4 checkpoint (Scout, Maverick): the text model under `language_model.`; the vision
    # tower and its projector are not read.
    "llama4": KeyMap("llama4", (), ignored=(r"vision_model\..*", r"multi_modal_projector\..*"),
                     hub_prefix="language_model."),
}


# Families whose table depends on their config: model_type -> (the model's config object -> KeyMap). Here,
# not on the model classes, so models/ never imports converters/ (the import layers of tests/test_layering.py).
# Each builder takes (config, held_mtp_layers): how many of the config's MTP layers the model holds.
CONFIG_KEY_MAPS: dict[str, Callable[[Any, int], KeyMap]] = {
    # The FP8 block of quantization_config; the MTP layers after the config's last layer skipped unless held.
    "deepseek_v3": lambda config, held_mtp_layers=0: deepseek_v3_key_map(
        config.num_hidden_layers, config.num_nextn_predict_layers, config.weight_block_size, held_mtp_layers),
}


def with_fp8_scales(base: KeyMap) -> KeyMap:
    """`base` for a model holding FP8 codes: each rule building a parameter from hub `weight`s gains a twin
    building `{param}_scale_inv` from the hub's `weight_scale_inv`s by the same steps (experts stacked, gate
    joined to up); a linear's `weight_scale_inv` is stored under its own name, as its codes."""
    scale_rules = tuple(
        KeyRule(param=f"{rule.param}_scale_inv",
                hub=tuple(f"{pattern}_scale_inv" for pattern in rule.hub), transforms=rule.transforms)
        for rule in base.rules if all(str(pattern).endswith(".weight") for pattern in rule.hub)
    )
    return KeyMap(base.architecture, base.rules + scale_rules, ignored=base.ignored, hub_prefix=base.hub_prefix)


def deepseek_v3_kept_fp8_key_map(num_hidden_layers: int, mtp_layers: int, held_mtp_layers: int = 0) -> KeyMap:
    """DeepSeek-V3 with its FP8 weights kept (`dequantize=False`): the codes and their `weight_scale_inv` both ways
    under their hub names; the routed experts' per-expert codes and scales stacked and gate/up joined, as the
    plain layout's weights are. MTP layers as `deepseek_v3_key_map`'s."""
    ignored = mtp_layers_ignored(num_hidden_layers, mtp_layers, held_mtp_layers)
    return with_fp8_scales(KeyMap("deepseek_v3", QWEN2_MOE.rules, ignored=ignored))


# (model_type, quant_method) -> the table of a model that keeps that checkpoint's weights quantised
# (`from_pretrained(..., dequantize=False)`); absent: the family's usual table (gpt-oss's MXFP4 tensors are
# parameters under their own names there).
KEPT_KEY_MAPS: dict[tuple[str, str], Callable[[Any, int], KeyMap]] = {
    ("deepseek_v3", "fp8"): lambda config, held_mtp_layers=0: deepseek_v3_kept_fp8_key_map(
        config.num_hidden_layers, config.num_nextn_predict_layers, held_mtp_layers),
}


def checkpoint_key_map(model_type: str, config: Any, kept_quantization: str | None = None,
                       held_mtp_layers: int = 0) -> KeyMap:
    """How a model of `model_type` with `config` (its config object) maps its parameters to hub keys: the
    kept-quantised table when it keeps `kept_quantization` weights (`KEPT_KEY_MAPS`), the family's config-built
    table (`CONFIG_KEY_MAPS`), else its fixed one (`KEY_MAPS`). held_mtp_layers: the multi-token-prediction
    layers the model holds (read and written; the config's others are skipped)."""
    kept = KEPT_KEY_MAPS.get((model_type, kept_quantization))
    if kept is not None:
        return kept(config, held_mtp_layers)
    build = CONFIG_KEY_MAPS.get(model_type)
    if build is not None:
        return build(config, held_mtp_layers)
    if held_mtp_layers:
        raise ValueError(f"{model_type} checkpoints hold no multi-token-prediction layers (held_mtp_layers="
                         f"{held_mtp_layers}).")
    return key_map_for(model_type)


def key_map_for(key_map: KeyMap | str) -> KeyMap:
    """A `KeyMap`, or the table of an architecture name (a config's `model_type`)."""
    if isinstance(key_map, KeyMap):
        return key_map
    try:
        return KEY_MAPS[key_map]
    except KeyError:
        raise KeyError(
            f"No key map for architecture {key_map!r}; known: {', '.join(sorted(KEY_MAPS))}. "
            "Pass a KeyMap built from KeyRule entries for other architectures."
        ) from None


def describe_rule_keys(rule: KeyRule, bindings: dict[str, int]) -> str:
    """`model.layers.1.mlp.experts.{expert}.gate_proj.weight + ...` for messages."""
    return " + ".join(str(pattern.bind(**bindings)) for pattern in rule.hub)
