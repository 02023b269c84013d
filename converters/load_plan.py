"""Matching a checkpoint's keys to a model's declared parameters, strictly, before any data is read.

For every declared parameter the checkpoint must offer exactly one layout: the hub keys of a rule of the
key map (e.g. per-expert `gate_proj`/`up_proj` for `experts.gate_up_proj`), or a tensor under the
parameter's own name (the fused in-memory layout, and every parameter no rule names). Everything wrong is
collected and raised as one `CheckpointMismatchError`:

    missing      no layout is present, or a layout lacks some keys (expert 3's up_proj, say)
    unexpected   checkpoint keys no parameter reads (a 9th expert, a stray tensor)
    duplicated   two layouts of one parameter present at once (fused and per-expert), or a key read twice
    shape/dtype  a layout whose assembled shape or dtype differs from the declared one
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import CheckpointMismatchError
from .key_maps import EXPERT, KeyMap, KeyRule, describe_rule_keys
from .key_patterns import natural_key
from .lazy_tensors import CheckpointTensor, LayoutError, LazyTensor
from .safetensors_io import SafetensorsCheckpoint

if TYPE_CHECKING:  # converters depend on no moe_jax module at import time
    from moe_jax.module_tree import ModuleTree, ParamSpec


@dataclass(frozen=True)
class ParamSource:
    """One parameter's lazy value and the checkpoint keys it reads."""

    name: str
    tensor: LazyTensor
    hub_keys: tuple[str, ...]
    stacked_layers: bool = False  # axis 0 is a scanned run's layer axis (`load.stack_layer_sources`)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape


@dataclass
class _Problems:
    missing: list[str]
    unexpected: list[str]
    duplicated: list[str]
    shape: list[str]
    dtype: list[str]


def plan_load(
    tree: ModuleTree, checkpoint: SafetensorsCheckpoint, key_map: KeyMap, casts: bool = False
) -> dict[str, ParamSource]:
    """`{parameter name: ParamSource}` in declaration order, or one error listing every mismatch.

    Without `casts` each checkpoint tensor's dtype must equal the declared `ParamSpec.dtype`; with it the
    loader casts, so any dtype is accepted.
    """
    problems = _Problems([], [], [], [], [])
    present = _rule_layouts_present(checkpoint.tensors, key_map)
    claimed: dict[str, str] = {}  # checkpoint key -> parameter that reads it
    sources: dict[str, ParamSource] = {}
    for name, spec in tree.named_parameters():
        source, keys = _plan_param(name, spec, checkpoint, key_map, present, problems, casts)
        # A parameter's keys count as used even when it has a problem, so they are not also "unexpected".
        for key in keys:
            if key in claimed and not key_map.reads_together(claimed[key], name):
                problems.duplicated.append(f"{key}: read by both {claimed[key]} and {name}")
            claimed[key] = name
        if source is not None:
            sources[name] = source
    problems.unexpected.extend(sorted((k for k in checkpoint.tensors if k not in claimed and not key_map.is_ignored(k)),
                                      key=natural_key))
    error = CheckpointMismatchError(
        str(checkpoint.directory),
        missing=problems.missing,
        unexpected=problems.unexpected,
        duplicated=problems.duplicated,
        shape_mismatches=problems.shape,
        dtype_mismatches=problems.dtype,
    )
    if error.has_problems:
        raise error
    return sources


def _rule_layouts_present(tensors, key_map: KeyMap) -> set[tuple[str, int]]:
    """`(parameter name, rule position)` for every rule with at least one of its `KeyMap.markers` keys in the
    checkpoint.

    One pass over the checkpoint's keys (each matched against the few hub patterns), so planning stays
    linear in the number of keys however many parameters there are.
    """
    present = set()
    markers = [key_map.markers(position) for position in range(len(key_map.load_rules))]
    for key in tensors:
        for rule_position, rule in enumerate(key_map.load_rules):
            for pattern in markers[rule_position]:
                values = pattern.match(key)
                if values is not None:
                    values.pop(EXPERT, None)
                    present.add((rule.param.format(**values), rule_position))
    return present


def _plan_param(
    name: str, spec: ParamSpec, checkpoint, key_map: KeyMap, present, problems: _Problems, casts: bool
) -> tuple[ParamSource | None, list[str]]:
    """The parameter's source (None after recording a problem) and the checkpoint keys that belong to it."""
    rules = key_map.rules_for(name)
    present_rules = [(position, rule, b) for position, rule, b in rules if (name, position) in present]
    num_experts = spec.shape[0] if spec.shape else 0
    # (description, its keys in the checkpoint, (rule, bindings) or None for the parameter's own name)
    layouts = [
        (f"hub keys {describe_rule_keys(rule, b)}", _present(_flatten(rule.hub_keys(b, num_experts)), checkpoint),
         (rule, b))
        for _, rule, b in present_rules
    ]
    # A rule that reads the parameter's own key through transforms replaces reading it as it is.
    transforms_itself = any(keys == [name] for _, keys, _ in layouts)
    if name in checkpoint.tensors and not transforms_itself:
        layouts.append((f"{name} itself", [name], None))
    # A layout that extends another (FP8 weight + scales over the plain weight) is the one in use.
    layouts = [layout for layout in layouts if not any(set(layout[1]) < set(other[1]) for other in layouts)]
    if not layouts:
        alternatives = [describe_rule_keys(rule, bindings) for _, rule, bindings in rules]
        if alternatives:
            problems.missing.append(f"{name} (neither it nor {' or '.join(alternatives)} is in the checkpoint)")
        else:
            problems.missing.append(name)
        return None, []
    if len(layouts) > 1:
        problems.duplicated.append(f"{name}: given as " + " and as ".join(text for text, _, _ in layouts)
                                   + "; keep one layout")
        return None, [key for _, keys, _ in layouts for key in keys]
    _, keys, chosen_rule = layouts[0]

    try:
        if chosen_rule is not None:
            rule, bindings = chosen_rule
            tensor = _tensor_from_rule(name, rule, bindings, num_experts, checkpoint, problems)
            if tensor is None:
                return None, keys
        else:
            info = checkpoint.tensors[name]
            tensor = CheckpointTensor(checkpoint, name, info.shape, info.dtype)
    except LayoutError as error:
        (problems.dtype if error.kind == "dtype" else problems.shape).append(f"{name}: {error}")
        return None, keys

    if tensor.shape != spec.shape:
        problems.shape.append(
            f"{name}: checkpoint gives {list(tensor.shape)} ({tensor.describe()}), the model declares {list(spec.shape)}"
        )
        return None, keys
    if not casts and tensor.dtype != np.dtype(spec.dtype):
        problems.dtype.append(
            f"{name}: checkpoint stores {tensor.dtype} ({tensor.describe()}), the model declares {spec.dtype}"
        )
        return None, keys
    return ParamSource(name, tensor, tuple(keys)), keys


def _tensor_from_rule(name, rule: KeyRule, bindings, num_experts: int, checkpoint, problems: _Problems):
    """The lazy tensor of a rule, or None after recording the hub keys it lacks."""
    expected = rule.hub_keys(bindings, num_experts)
    absent = [key for key in _flatten(expected) if key not in checkpoint.tensors]
    if absent:
        problems.missing.extend(f"{key} (for {name})" for key in absent)
        return None

    def leaf(key: str) -> CheckpointTensor:
        info = checkpoint.tensors[key]
        return CheckpointTensor(checkpoint, key, info.shape, info.dtype)

    return rule.build([[leaf(key) for key in keys] if isinstance(keys, list) else leaf(keys) for keys in expected])


def _present(keys: list[str], checkpoint) -> list[str]:
    return [key for key in keys if key in checkpoint.tensors]


def _flatten(keys: list[list[str] | str]) -> list[str]:
    flat: list[str] = []
    for entry in keys:
        flat.extend(entry if isinstance(entry, list) else [entry])
    return flat
