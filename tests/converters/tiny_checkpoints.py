"""Tiny Qwen3-MoE / Mixtral trees, parameters and hub checkpoints written with numpy alone (no torch).

The hub layout is spelled out here by hand (per-expert slicing written directly), independently of the
converters' key maps, so tests compare the converters against an independent statement of the format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from converters.lazy_tensors import LazyTensor
from converters.transforms import OneWayTransform
from moe_jax import DistributedConfig
from moe_jax.distributed.mesh import build_mesh
from moe_jax.distributed.plans import resolve_parallel_plans
from moe_jax.distributed.sharding import parameter_shardings
from moe_jax.module_tree import ModuleTree
from tests.distributed.tiny_qwen3_moe import TinyQwen3MoeForCausalLM

QWEN3_CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    mlp_only_layers=[0], decoder_sparse_step=1, tie_word_embeddings=False,
)
MIXTRAL_CONFIG = dict(
    vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
)
SPARSE_LAYER = "model.layers.1"  # layer 0 is dense in QWEN3_CONFIG (mlp_only_layers=[0])


def qwen3_tree(dtype: str = "float32", **changes) -> ModuleTree:
    tree = TinyQwen3MoeForCausalLM(**{**QWEN3_CONFIG, **changes}).module_tree
    if dtype != "float32":
        for name, spec in tree.params.items():
            tree.params[name] = type(spec)(spec.shape, dtype, spec.init)
    return tree


def mixtral_tree(config: dict = MIXTRAL_CONFIG) -> ModuleTree:
    """Mixtral's in-memory names (transformers 5.23): `mlp.gate`, `mlp.experts.gate_up_proj [E, 2I, H]`."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, experts, inter = hidden // heads, config["num_local_experts"], config["intermediate_size"]
    tree = ModuleTree()
    with tree.module("model"):
        with tree.module("embed_tokens"):
            tree.param("weight", (config["vocab_size"], hidden))
        with tree.module("layers"):
            for index in range(config["num_hidden_layers"]):
                with tree.module(index):
                    with tree.module("self_attn"):
                        for name, shape in (("q_proj", (heads * head_dim, hidden)),
                                            ("k_proj", (kv_heads * head_dim, hidden)),
                                            ("v_proj", (kv_heads * head_dim, hidden)),
                                            ("o_proj", (hidden, heads * head_dim))):
                            with tree.module(name):
                                tree.param("weight", shape)
                    with tree.module("mlp"):
                        with tree.module("gate"):
                            tree.param("weight", (experts, hidden))
                        with tree.module("experts"):
                            tree.param("gate_up_proj", (experts, 2 * inter, hidden))
                            tree.param("down_proj", (experts, hidden, inter))
                    for name in ("input_layernorm", "post_attention_layernorm"):
                        with tree.module(name):
                            tree.param("weight", (hidden,))
        with tree.module("norm"):
            tree.param("weight", (hidden,))
    with tree.module("lm_head"):
        tree.param("weight", (config["vocab_size"], hidden))
    return tree


def random_params(tree: ModuleTree, seed: int = 0) -> dict[str, np.ndarray]:
    """In-memory layout values of the declared dtypes, all distinct so misplaced slices show up."""
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(spec.shape, dtype=np.float32).astype(np.dtype(spec.dtype))
        for name, spec in tree.named_parameters()
    }


def qwen3_hub_tensors(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF hub layout of Qwen2/3-MoE and OLMoE: experts split into per-expert gate/up/down Linear weights."""
    return _hub_tensors(params, experts_module="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def mixtral_hub_tensors(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF hub layout of Mixtral: `block_sparse_moe.experts.{j}.w1/w3/w2` and `block_sparse_moe.gate`."""
    hub = _hub_tensors(params, experts_module="block_sparse_moe", gate="w1", up="w3", down="w2")
    return {key.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight"): value for key, value in hub.items()}


def _hub_tensors(params, *, experts_module, gate, up, down):
    hub = {}
    for name, value in params.items():
        layer, _, leaf = name.partition(".mlp.experts.")
        if leaf == "gate_up_proj":
            half = value.shape[1] // 2
            for expert in range(value.shape[0]):
                hub[f"{layer}.{experts_module}.experts.{expert}.{gate}.weight"] = value[expert, :half]
                hub[f"{layer}.{experts_module}.experts.{expert}.{up}.weight"] = value[expert, half:]
        elif leaf == "down_proj":
            for expert in range(value.shape[0]):
                hub[f"{layer}.{experts_module}.experts.{expert}.{down}.weight"] = value[expert]
        else:
            hub[name] = value
    return hub


def write_checkpoint(directory: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int | None = None) -> Path:
    """A checkpoint as `save_pretrained` lays it out: one file, or shards + index when over the size."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, value in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = np.ascontiguousarray(value)
        size += value.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def read_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, read with safetensors itself (independent of converters)."""
    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as file:
            for key in file.keys():
                tensors[key] = file.get_tensor(key)
    return tensors


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def shardings_for(num_devices, **layout):
    """Each parameter's NamedSharding as the library derives it from a DistributedConfig."""
    config = DistributedConfig(**layout)
    model = TinyQwen3MoeForCausalLM(**QWEN3_CONFIG)
    specs = parameter_shardings(model.module_tree, resolve_parallel_plans(model, config), config)
    mesh = build_mesh(config, jax.devices()[:num_devices])
    return model.module_tree, {name: NamedSharding(mesh, sharding.spec) for name, sharding in specs.items()}


class DequantizedTensor(LazyTensor):
    def __init__(self, quantized: LazyTensor, scale: float):
        self.quantized, self.scale = quantized, scale
        self.shape, self.dtype = quantized.shape, np.dtype(np.float32)

    def read(self, index):
        return self.quantized.read(index).astype(np.float32) * self.scale

    def describe(self):
        return f"dequantized {self.quantized.describe()}"


@dataclass(frozen=True)
class ScaleFromInt8(OneWayTransform):
    """A toy dequantisation (int8 * scale): information is lost, so it cannot be exported."""

    scale: float = 0.5

    def load(self, values):
        (quantized,) = values
        return [DequantizedTensor(quantized, self.scale)]
