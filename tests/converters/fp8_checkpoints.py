"""Block-quantised FP8 copies of a checkpoint, as DeepSeek-V3's hub release stores them (test data only:
moe_jax reads FP8, it never writes it)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from converters.key_maps import DEEPSEEK_V3_FP8_LINEARS

FP8_MAX = 448.0  # the largest float8_e4m3fn
QUANTISED = re.compile(r"model\.layers\.\d+\.(?:" + "|".join(re.escape(m) for m in DEEPSEEK_V3_FP8_LINEARS)
                       + r"|mlp\.experts\.\d+\.(?:gate|up|down)_proj)\.weight")


def quantize_fp8(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """weight: [R, C] float32 -> (float8_e4m3fn [R, C], weight_scale_inv [ceil(R / bR), ceil(C / bC)] float32),
    each block scaled so its largest magnitude is the largest float8 value."""
    rows, columns = weight.shape
    grid = (-(-rows // block[0]), -(-columns // block[1]))
    scales = np.ones(grid, np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scales[i, j] = max(float(np.abs(tile).max()), 1e-12) / FP8_MAX
    expanded = np.repeat(np.repeat(scales, block[0], 0), block[1], 1)[:rows, :columns]
    return (weight / expanded).astype(ml_dtypes.float8_e4m3fn), scales


def write_fp8_checkpoint(source: Path, destination: Path, block: tuple[int, int], extra: dict | None = None) -> dict:
    """Copy the single-file checkpoint `source` to `destination` with every DeepSeek-V3 linear weight (attention,
    dense and shared MLPs, per-expert projections) quantised, config.json saying so; `extra` tensors are added
    as they are. Returns `{key: (float8 weight, scales)}` of the quantised tensors."""
    shutil.copytree(source, destination)
    tensors = load_file(source / "model.safetensors")
    quantised = {}
    for key in [key for key in tensors if QUANTISED.fullmatch(key)]:
        weight, scales = quantize_fp8(tensors[key], block)
        tensors[key], tensors[f"{key}_scale_inv"] = weight, scales
        quantised[key] = (weight, scales)
    tensors.update(extra or {})
    save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    return quantised
