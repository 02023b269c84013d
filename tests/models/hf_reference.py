"""Tiny random HF models (torch) and their logits, for parity tests. Import only under `reference` tests."""

from __future__ import annotations

import numpy as np

TINY_QWEN3_MOE = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
    max_position_embeddings=256,
)


def tiny_hf_model(model_type: str, config_values: dict, seed: int = 0):
    import torch
    import transformers

    config_class = transformers.AutoConfig.for_model(model_type).__class__
    torch.manual_seed(seed)
    config = config_class(**config_values)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Spread the router so top-k choices are far from ties (a tie could flip between implementations).
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.mul_(20.0)
    return model


def hf_state_dict(model) -> dict[str, np.ndarray]:
    return {name: tensor.detach().cpu().numpy() for name, tensor in model.state_dict().items()}


def hf_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    import torch

    with torch.no_grad():
        output = model(
            input_ids=torch.as_tensor(input_ids),
            attention_mask=None if attention_mask is None else torch.as_tensor(attention_mask),
        )
    return output.logits.float().numpy()
