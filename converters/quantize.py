"""Weight-only quantisation as a plain checkpoint is read (`from_pretrained(..., quantize="int8" | "fp8")`), and
the key maps of a model that holds such weights.

A quantised parameter is two parameters, codes and scale, each read by its own rule from the same hub tensors
(the plain rule's, with a quantising step): a device asks for its block of codes or of scales, and only the rows
(int8) or 128 x 128 blocks (fp8) covering that block are read and quantised, so no device ever holds the
full-precision weight.

    int8   per output row:  scale = amax(|w[o, :]|) / 127         codes = clip(rint(w / scale), -127, 127)
    fp8    per block:       scale_inv = amax(|w[block]|) / 448     codes = float8_e4m3fn(w / scale_inv)
    (a row or block of zeros gets scale 1: codes 0)

fp8 quantises each hub matrix before the experts are stacked and gate joined to up (DeepSeek's per-expert
blocks); int8's per-row scales are the same before or after, so it runs on the fused parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .fp8 import DequantizeFP8
from .key_maps import KeyMap, KeyRule
from .lazy_tensors import LayoutError, LazyTensor
from .transforms import OneWayTransform

INT8_MAX = 127.0
FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_BLOCK = (128, 128)
SCALE_SUFFIXES = {"int8": "_scale", "fp8": "_scale_inv"}


def _safe(scale: np.ndarray) -> np.ndarray:
    return np.where(scale == 0, np.float32(1), scale).astype(np.float32)


def quantize_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """weight: [..., O, H] -> (int8 codes [..., O, H], float32 scale [..., O])."""
    weight = weight.astype(np.float32)
    scale = _safe(np.abs(weight).max(axis=-1) / np.float32(INT8_MAX))
    codes = np.clip(np.rint(weight / scale[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes, scale


def quantize_fp8(weight: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """weight: [R, C] -> (float8_e4m3fn codes [R, C], float32 scale_inv [ceil(R / bR), ceil(C / bC)])."""
    weight = weight.astype(np.float32)
    rows, columns = weight.shape
    grid = (-(-rows // block[0]), -(-columns // block[1]))
    padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
    padded[:rows, :columns] = np.abs(weight)
    amax = padded.reshape(grid[0], block[0], grid[1], block[1]).max(axis=(1, 3))
    scale_inv = _safe(amax / np.float32(FP8_MAX))
    expanded = np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)[:rows, :columns]
    return (weight / expanded).astype(ml_dtypes.float8_e4m3fn), scale_inv


class Int8Part(LazyTensor):
    """The int8 codes [..., O, H] or scales [..., O] of `source` [..., O, H]: whole rows are read."""

    def __init__(self, source: LazyTensor, part: str):
        self.source, self.part = source, part
        self.shape = tuple(source.shape) if part == "codes" else tuple(source.shape[:-1])
        self.dtype = np.dtype(np.int8) if part == "codes" else np.dtype(np.float32)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        rows = index if self.part == "scale" else index[:-1]
        codes, scale = quantize_int8(self.source.read((*rows, slice(0, self.source.shape[-1]))))
        return codes[..., index[-1]] if self.part == "codes" else scale

    def describe(self) -> str:
        return f"int8_{self.part}({self.source.describe()})"


class FP8Part(LazyTensor):
    """The fp8 codes [R, C] or scale_inv [ceil(R / bR), ceil(C / bC)] of `source` [R, C]: whole blocks are read."""

    def __init__(self, source: LazyTensor, part: str, block: tuple[int, int] = FP8_BLOCK):
        if len(source.shape) != 2:
            raise LayoutError("shape", f"fp8 quantises [out, in] matrices; got {source.describe()}")
        self.source, self.part, self.block = source, part, tuple(block)
        rows, columns = source.shape
        grid = (-(-rows // block[0]), -(-columns // block[1]))
        self.shape = tuple(source.shape) if part == "codes" else grid
        self.dtype = np.dtype(ml_dtypes.float8_e4m3fn) if part == "codes" else np.dtype(np.float32)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        if self.part == "codes":
            blocks = tuple(slice(wanted.start // size, -(-wanted.stop // size)) for wanted, size in zip(index, self.block))
        else:
            blocks = index
        region = tuple(slice(b.start * size, min(b.stop * size, extent))
                       for b, size, extent in zip(blocks, self.block, self.source.shape))
        codes, scale_inv = quantize_fp8(self.source.read(region), self.block)
        if self.part == "scale":
            return scale_inv
        return codes[tuple(slice(wanted.start - covered.start, wanted.stop - covered.start)
                           for wanted, covered in zip(index, region))]

    def describe(self) -> str:
        return f"fp8_{self.part}({self.source.describe()}, block {list(self.block)})"


@dataclass(frozen=True)
class QuantizeWeights(OneWayTransform):
    """Each tensor (or per-expert list) -> its `part` ("codes" or "scale") under `scheme` ("int8", "fp8")."""

    scheme: str
    part: str

    def load(self, values: list) -> list:
        build = (lambda tensor: Int8Part(tensor, self.part)) if self.scheme == "int8" else (
            lambda tensor: FP8Part(tensor, self.part))
        return [[build(tensor) for tensor in value] if isinstance(value, list) else build(value) for value in values]


def _layer_pattern(name: str) -> str:
    return re.sub(r"^model\.layers\.\d+\.", "model.layers.{layer}.", name)


def quantizing_key_map(base: KeyMap, quantized: list[str], scheme: str) -> KeyMap:
    """`base` with each of the `quantized` parameters read as codes plus `{param}{suffix}` scales: the rule that
    builds it gets a quantising step (first for fp8: per hub matrix; last for int8: per row of the parameter);
    a parameter stored under its own name gets a rule reading that name."""
    suffix = SCALE_SUFFIXES[scheme]
    codes_step, scale_step = QuantizeWeights(scheme, "codes"), QuantizeWeights(scheme, "scale")

    def quantized_rules(param: str, hub, structural) -> list[KeyRule]:
        place = (lambda step: (step, *structural)) if scheme == "fp8" else (lambda step: (*structural, step))
        return [KeyRule(param=param, hub=hub, transforms=place(codes_step)),
                KeyRule(param=param + suffix, hub=hub, transforms=place(scale_step))]

    remaining = set(quantized)
    rules: list[KeyRule] = []
    shared: list[tuple[str, str]] = []
    for rule in base.rules:
        matched = {name for name in remaining if rule.param.match(name) is not None}
        if matched:
            rules += quantized_rules(str(rule.param), rule.hub, rule.transforms)
            shared.append((str(rule.param), str(rule.param) + suffix))
            remaining -= matched
        else:
            rules.append(rule)
    for pattern in sorted({_layer_pattern(name) for name in remaining}):
        rules += quantized_rules(pattern, (pattern,), ())
        shared.append((pattern, pattern + suffix))
    return KeyMap(base.architecture, tuple(rules), ignored=base.ignored, hub_prefix=base.hub_prefix,
                  shared_reads=tuple(shared))


def dequantizing_fp8_key_map(base: KeyMap, linear_weights: list[str], block: tuple[int, int]) -> KeyMap:
    """`base` reading an FP8 checkpoint (Transformers' FineGrainedFP8: `weight` + `weight_scale_inv` per linear and
    per expert matrix) dequantised, for a family without its own FP8 table: each rule building a parameter from
    hub `weight`s gains a load-only twin reading each with its scales, and each of `linear_weights` (stored under
    its own name) one; a weight the checkpoint holds unquantised loads by the plain rule."""
    twins = tuple(
        KeyRule(param=rule.param, hub=tuple(key for pattern in rule.hub for key in (str(pattern), f"{pattern}_scale_inv")),
                transforms=(DequantizeFP8(tuple(block)), *rule.transforms))
        for rule in base.rules if all(str(pattern).endswith(".weight") for pattern in rule.hub)
    )
    own = tuple(KeyRule(param=pattern, hub=(pattern, f"{pattern}_scale_inv"), transforms=(DequantizeFP8(tuple(block)),))
                for pattern in sorted({_layer_pattern(name) for name in linear_weights}))
    return KeyMap(base.architecture, base.rules, load_only=base.load_only + twins + own, ignored=base.ignored,
                  hub_prefix=base.hub_prefix)
