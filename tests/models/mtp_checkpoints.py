"""A tiny DeepSeek-V3 checkpoint with multi-token-prediction layers, and a PyTorch reference of their math.

Transformers builds no MTP layers: the checkpoint is its tiny model saved, plus random MTP tensors written with
safetensors (each MTP layer's decoder block from a fresh `DeepseekV3DecoderLayer`, the rest drawn here), with
`embed_tokens` / `shared_head.head` as copies of the main model's, as hub checkpoints store them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converters.key_maps import KEY_MAPS

from .hf_reference import TINY_DEEPSEEK_V3, tiny_hf_model

MTP_LAYERS = 2
TINY_MTP = {**TINY_DEEPSEEK_V3, "num_nextn_predict_layers": MTP_LAYERS}


def mtp_tensors(hf_model, seed: int = 3) -> dict[str, np.ndarray]:
    """layer (L, L + 1, ...) -> that MTP layer's tensors in the model's in-memory layout, keyed by their names
    inside the layer (`eh_proj.weight`, `mlp.experts.gate_up_proj`, ...)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config, rng = hf_model.config, np.random.default_rng(seed)
    hidden = config.hidden_size
    state = {name: value.detach().numpy() for name, value in hf_model.state_dict().items()}
    layers = {}
    for depth in range(MTP_LAYERS):
        layer = config.num_hidden_layers + depth
        # A bare layer's parameters are uninitialised (Transformers initialises them in a whole model): drawn here.
        bare = DeepseekV3DecoderLayer(config, layer)
        shapes = {name: tuple(value.shape) for name, value in bare.state_dict().items()}
        tensors = {name: (1 + 0.3 * rng.normal(size=shape) if len(shape) == 1 else 0.1 * rng.normal(size=shape))
                   .astype(np.float32) for name, shape in shapes.items()}
        tensors["mlp.gate.weight"] *= 20.0   # routing far from ties, as `tiny_hf_model` spreads the routers
        tensors.update({
            "embed_tokens.weight": state["model.embed_tokens.weight"].copy(),
            "enorm.weight": (1 + 0.3 * rng.normal(size=hidden)).astype(np.float32),
            "hnorm.weight": (1 + 0.3 * rng.normal(size=hidden)).astype(np.float32),
            "eh_proj.weight": (0.1 * rng.normal(size=(hidden, 2 * hidden))).astype(np.float32),
            "shared_head.norm.weight": (1 + 0.3 * rng.normal(size=hidden)).astype(np.float32),
            "shared_head.head.weight": state["lm_head.weight"].copy(),
        })
        layers[layer] = tensors
    return layers


def write_mtp_checkpoint(directory: Path):
    """(the HF model, its MTP tensors per layer): the model saved to `directory` with its MTP layers added in the
    hub's per-expert layout."""
    from safetensors.numpy import load_file, save_file

    hf_model = tiny_hf_model("deepseek_v3", TINY_MTP)
    hf_model.save_pretrained(directory)
    layers = mtp_tensors(hf_model)
    path = directory / "model.safetensors"
    stored = load_file(path)
    for layer, tensors in layers.items():
        for name, value in tensors.items():
            stored.update(KEY_MAPS["deepseek_v3"].to_hub(f"model.layers.{layer}.{name}", value))
    save_file({key: np.ascontiguousarray(value) for key, value in stored.items()}, path, metadata={"format": "pt"})
    return hf_model, layers


def reference_mtp_logits(hf_model, layers: dict, input_ids: np.ndarray) -> np.ndarray:
    """[D, B, S, V]: each depth by hand (norms, eh_proj, head) around a Transformers decoder layer holding the MTP
    layer's block, on the main model's last hidden states before its final norm (read by a hook)."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = hf_model.config
    eps = config.rms_norm_eps
    ids = torch.as_tensor(input_ids)
    captured = {}
    hook = hf_model.model.norm.register_forward_hook(lambda module, args, output: captured.update(h=args[0]))
    with torch.no_grad():
        hf_model(input_ids=ids)
    hook.remove()

    def rms(weight, x):
        return torch.as_tensor(weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    batch, sequence = input_ids.shape
    positions = torch.arange(sequence)[None].expand(batch, sequence)
    mask = torch.full((sequence, sequence), float("-inf")).triu(1)[None, None]
    hidden, out = captured["h"], []
    with torch.no_grad():
        for depth, (layer, tensors) in enumerate(sorted(layers.items()), start=1):
            block = DeepseekV3DecoderLayer(config, layer_idx=layer).float().eval()
            block.load_state_dict({name: torch.as_tensor(value) for name, value in tensors.items()
                                   if name.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                             "post_attention_layernorm")})
            shifted = torch.cat([ids[:, depth:], torch.zeros((batch, depth), dtype=ids.dtype)], dim=1)
            embedded = torch.as_tensor(tensors["embed_tokens.weight"])[shifted]
            joined = torch.cat([rms(tensors["enorm.weight"], embedded), rms(tensors["hnorm.weight"], hidden)], -1)
            x = joined @ torch.as_tensor(tensors["eh_proj.weight"]).T
            rope = hf_model.model.rotary_emb(x, positions)
            hidden = block(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
            normed = rms(tensors["shared_head.norm.weight"], hidden)
            out.append((normed @ torch.as_tensor(tensors["shared_head.head.weight"]).T).numpy())
    return np.stack(out)
