"""A tiny gpt-oss checkpoint as the hub ships gpt-oss: MXFP4 expert blocks + scales and a quantization_config (test
data only)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from moe_jax.causal_lm import GptOssForCausalLM
from tests.converters.test_mxfp4 import CONFIG, PROJECTIONS, random_mxfp4

QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def write_mxfp4_checkpoint(directory: Path) -> Path:
    """The tiny random gpt-oss of tests/converters/test_mxfp4.py with random MXFP4 experts, at `directory`."""
    model = GptOssForCausalLM(CONFIG, devices=jax.devices()[:1])
    model.init_params(seed=0)
    model.save_pretrained(directory, progress=False)
    tensors = load_file(directory / "model.safetensors")
    rng = np.random.default_rng(0)
    for layer in range(CONFIG["num_hidden_layers"]):
        for proj, (rows, values) in PROJECTIONS.items():
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[key]
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = random_mxfp4(rng, CONFIG["num_local_experts"],
                                                                              rows, values)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    return directory
