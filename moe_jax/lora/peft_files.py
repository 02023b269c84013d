"""PEFT's adapter files both ways: `adapter_config.json` + `adapter_model.safetensors`, PEFT's key names.

    base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight            [r, H]      lora.Linear
    base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight      [E*r, H]    ParamWrapper (gate_up_proj)
    base_model.model.model.layers.1.mlp.experts.lora_B.weight                 [H, r*E]    ParamWrapper (down_proj)

PEFT wraps each targeted parameter of a module in its own `ParamWrapper`, the first declared innermost, and
writes `.base_layer` once per wrapper outside it (`Target.wrappers_outside`). A wrapper's A is a Linear
`[E*r, I]` whose rows run expert-major (row e*r + j is expert e's rank j), its B a Linear `[O, r*E]` whose
columns run rank-major (column j*E + e): PEFT's `get_delta_weight` reshapes them so. moe_jax keeps [E, r, I] and
[E, O, r], which shard over experts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import load_file, save_file

from .config import LoraConfig
from .layout import AdapterLayout, factor_names
from .targets import Target

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_key(target: Target, factor: str) -> str:
    """PEFT's file key of a target's factor ("A" or "B")."""
    return f"{PREFIX}{target.module}{'.base_layer' * target.wrappers_outside}.lora_{factor}.weight"


def to_peft(target: Target, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """moe_jax's A, B of one layer -> PEFT's: [E, r, I] -> [E*r, I]; [E, O, r] -> [O, r*E] (rank-major)."""
    if target.experts is None:
        return a, b
    experts, out_features, rank = b.shape
    return a.reshape(-1, a.shape[-1]), np.transpose(b, (1, 2, 0)).reshape(out_features, rank * experts)


def from_peft(target: Target, a: np.ndarray, b: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's A, B of one layer -> moe_jax's (the inverse of `to_peft`)."""
    if target.experts is None:
        return a, b
    experts = target.experts
    return (a.reshape(experts, rank, a.shape[-1]),
            np.transpose(b.reshape(b.shape[0], rank, experts), (2, 0, 1)))


def _host(array) -> np.ndarray:
    """A global array's values on this host (gathered from the other processes when they hold parts of it)."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(jax.device_get(array))


def peft_tensors(layout: AdapterLayout, adapter: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """The adapter (storage layout) as PEFT's state dict, one entry per target and factor."""
    per_layer = layout.per_layer(adapter)
    tensors = {}
    for target in layout.targets:
        a_name, b_name = factor_names(target)
        a, b = to_peft(target, _host(per_layer[a_name]), _host(per_layer[b_name]))
        tensors[peft_key(target, "A")] = np.ascontiguousarray(a)
        tensors[peft_key(target, "B")] = np.ascontiguousarray(b)
    return tensors


def save_adapter_files(directory, layout: AdapterLayout, adapter: Mapping[str, jax.Array]) -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` (process 0 writes; every process gathers)."""
    directory = Path(directory)
    tensors = peft_tensors(layout, adapter)
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        (directory / CONFIG_FILE).write_text(json.dumps(layout.config.to_peft_dict(), indent=2, sort_keys=True) + "\n")
    return directory


def read_adapter_config(directory) -> LoraConfig:
    """The `LoraConfig` of the PEFT adapter in `directory` (FileNotFoundError / ValueError naming the problem)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}; pass a directory written by PEFT's save_pretrained "
                                "or moe_jax's save_adapter.")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error}).") from None
    return LoraConfig.from_peft_dict(values, str(path))


def read_adapter_tensors(directory, layout: AdapterLayout) -> dict[str, np.ndarray]:
    """The adapter file's tensors as moe_jax's per-layer arrays for `layout`. An adapter made for another model
    (other layers, other shapes) is refused, listing what differs."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE} (PEFT's adapter weights).")
    tensors = load_file(str(path))
    tensors = {key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): value
               for key, value in tensors.items()}
    expected = {}
    for target in layout.targets:
        a_shape, b_shape = target.factor_shapes(layout.config.r)
        if target.experts is not None:
            a_shape, b_shape = (a_shape[0] * a_shape[1], a_shape[2]), (b_shape[1], b_shape[2] * b_shape[0])
        expected[peft_key(target, "A")] = a_shape
        expected[peft_key(target, "B")] = b_shape
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    wrong = [f"{key}: {list(tensors[key].shape)} in the file, {list(shape)} for this model"
             for key, shape in expected.items() if key in tensors and tuple(tensors[key].shape) != tuple(shape)]
    if missing or unexpected or wrong:
        problems = [f"{len(wrong)} shape mismatch(es): " + "; ".join(wrong[:4]) if wrong else "",
                    f"{len(missing)} missing: " + ", ".join(missing[:3]) if missing else "",
                    f"{len(unexpected)} unexpected: " + ", ".join(unexpected[:3]) if unexpected else ""]
        made_for = layout.config.base_model_name_or_path
        raise ValueError(f"{path} does not fit this model" + (f" (it was made for {made_for})" if made_for else "")
                         + ": " + " | ".join(problem for problem in problems if problem)
                         + ". Load an adapter made for this model's architecture and size.")
    per_layer = {}
    for target in layout.targets:
        a_name, b_name = factor_names(target)
        per_layer[a_name], per_layer[b_name] = from_peft(target, tensors[peft_key(target, "A")],
                                                         tensors[peft_key(target, "B")], layout.config.r)
    return per_layer
