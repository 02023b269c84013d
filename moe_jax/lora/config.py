"""`LoraConfig`: PEFT's LoRA settings with PEFT's meaning, and its `adapter_config.json` both ways.

    LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

Fields as PEFT's `peft.LoraConfig` (>= 0.17): `r` the rank, `lora_alpha` the scale numerator (scaling
alpha / r, or alpha / sqrt(r) with `use_rslora`), `target_modules` the `torch.nn.Linear` modules to adapt (a list
of names or name suffixes, or one regular expression matched against the whole module name, or "all-linear"),
`target_parameters` the parameters to adapt directly (the fused [E, ...] expert weights). A bad value fails
here, naming the value and the fix; what PEFT offers and this library does not (dropout, DoRA, biases, per-layer
ranks, ...) fails the same way rather than being ignored.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PEFT_TYPE = "LORA"

# PEFT fields this library cannot honour: field -> (the value that means "off", what to say). An adapter that
# sets one to anything else is refused, naming it.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA (use_dora=True) is not supported; train plain LoRA (use_dora=False)"),
    "bias": ("none", "LoRA biases (bias != 'none') are not supported; use bias='none'"),
    "lora_bias": (False, "lora_bias=True is not supported; use lora_bias=False"),
    "fan_in_fan_out": (False, "fan_in_fan_out=True (Conv1D-style weights) is not supported"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern) are not supported; use one r"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern) are not supported; use one lora_alpha"),
    "layers_to_transform": (None, "layers_to_transform is not supported; every matching layer is adapted"),
    "layers_pattern": (None, "layers_pattern is not supported"),
    "modules_to_save": (None, "modules_to_save (fully trained copies of modules) is not supported; freeze or train "
                              "base parameters with make_train_step(trainable=...) instead"),
    "exclude_modules": (None, "exclude_modules is not supported; list the modules to adapt in target_modules"),
    "trainable_token_indices": (None, "trainable_token_indices is not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
    "use_qalora": (False, "QA-LoRA (use_qalora=True) is not supported"),
    "use_bdlora": (None, "use_bdlora is not supported"),
    "megatron_config": (None, "megatron_config is not supported"),
    "velora_config": (None, "velora_config is not supported"),
    "kasa_config": (None, "kasa_config is not supported"),
    "arrow_config": (None, "arrow_config is not supported"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens) is not supported"),
}
# Initialisations this library makes: PEFT's default (A kaiming-uniform with a = sqrt(5), B zeros).
SUPPORTED_INITS = (True,)


@dataclass(frozen=True)
class LoraConfig:
    """A LoRA adapter's settings, PEFT's fields and defaults (see the module docstring)."""

    r: int = 8
    lora_alpha: float = 8
    target_modules: list[str] | str | None = None
    target_parameters: list[str] | None = None
    use_rslora: bool = False
    lora_dropout: float = 0.0
    use_dora: bool = False
    bias: str = "none"
    init_lora_weights: bool | str = True
    base_model_name_or_path: str | None = None
    task_type: str | None = "CAUSAL_LM"
    unsupported: dict = field(default_factory=dict, repr=False)  # other PEFT fields as given (refused if set)

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRA rank r={self.r!r} must be a positive integer (PEFT's `r`, e.g. 8).")
        if not isinstance(self.lora_alpha, (int, float)) or self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha={self.lora_alpha!r} must be a positive number (scaling = lora_alpha / r).")
        if self.lora_dropout:
            raise ValueError(f"lora_dropout={self.lora_dropout} is not supported: moe_jax trains LoRA without "
                             "dropout (PEFT cannot apply it to target_parameters either); pass lora_dropout=0.")
        if self.init_lora_weights not in SUPPORTED_INITS:
            raise ValueError(f"init_lora_weights={self.init_lora_weights!r} is not supported: only PEFT's default "
                             "(True: A kaiming-uniform, B zeros). Load an adapter made with another init instead.")
        settings = {"use_dora": self.use_dora, "bias": self.bias, **self.unsupported}
        for name, value in settings.items():
            if _is_set(name, value):
                raise ValueError(f"{UNSUPPORTED_FIELDS[name][1]} (got {name}={value!r}).")
        object.__setattr__(self, "target_modules", _names(self.target_modules, "target_modules", regex=True))
        object.__setattr__(self, "target_parameters", _names(self.target_parameters, "target_parameters"))
        if not self.target_modules and not self.target_parameters:
            raise ValueError("a LoraConfig needs target_modules (e.g. ['q_proj', 'v_proj']) or target_parameters "
                             "(e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']).")

    @property
    def scaling(self) -> float:
        """What B A is multiplied by: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (PEFT's)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_peft_dict(self) -> dict:
        """`adapter_config.json` as PEFT writes it, with PEFT's defaults for every field this library leaves off."""
        return {
            "peft_type": PEFT_TYPE, "task_type": self.task_type, "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.r, "lora_alpha": self.lora_alpha, "lora_dropout": 0.0, "use_rslora": self.use_rslora,
            "target_modules": self.target_modules, "target_parameters": self.target_parameters,
            "init_lora_weights": True, "inference_mode": True, "bias": "none", "lora_bias": False,
            "use_dora": False, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
            "modules_to_save": None, "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None,
            "revision": None,
        }

    @classmethod
    def from_peft_dict(cls, values: Mapping[str, Any], source: str = "adapter_config.json") -> LoraConfig:
        """A PEFT `adapter_config.json`'s settings. Dropout only acts in training and the initialisation only
        before it, so an adapter that was trained with either still loads (dropout said, not applied)."""
        if values.get("peft_type", PEFT_TYPE) != PEFT_TYPE:
            raise ValueError(f"{source}: peft_type {values.get('peft_type')!r} is not LoRA; only LoRA adapters load.")
        if values.get("lora_dropout"):
            warnings.warn(f"{source}: lora_dropout={values['lora_dropout']} is not applied (moe_jax has no LoRA "
                          "dropout); inference is unaffected.", UserWarning, stacklevel=2)
        unsupported = {name: values[name] for name in UNSUPPORTED_FIELDS
                       if name not in ("use_dora", "bias") and _is_set(name, values.get(name))}
        return cls(r=values.get("r", 8), lora_alpha=values.get("lora_alpha", 8),
                   target_modules=values.get("target_modules"), target_parameters=values.get("target_parameters"),
                   use_rslora=bool(values.get("use_rslora", False)), use_dora=bool(values.get("use_dora", False)),
                   bias=values.get("bias", "none"), base_model_name_or_path=values.get("base_model_name_or_path"),
                   task_type=values.get("task_type", "CAUSAL_LM"), unsupported=unsupported)


def _is_set(name: str, value) -> bool:
    """Whether PEFT field `name` asks for something (is neither its "off" value nor empty)."""
    return value != UNSUPPORTED_FIELDS[name][0] and value not in (None, {}, [], False)


def _names(value, field_name: str, regex: bool = False) -> list[str] | str | None:
    """A list of names (sorted, as PEFT stores them), a regular expression (target_modules only), or None."""
    if value is None:
        return None
    if isinstance(value, str):
        if regex:
            return value
        value = [value]
    if not all(isinstance(name, str) and name for name in value):
        raise ValueError(f"{field_name}={value!r} must be a list of module or parameter names.")
    return sorted(set(value))
