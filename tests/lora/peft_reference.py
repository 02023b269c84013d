"""PEFT's side of the LoRA comparisons: a tiny Transformers model with a PEFT adapter (torch, peft), its
logits and gradients. Import only under tests marked `peft`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..models import hf_reference
from ..models.hf_reference import tiny_hf_model

# Every family's tiny config (tests/models/hf_reference.py) by model type.
TINY_CONFIGS = {
    "qwen3_moe": hf_reference.TINY_QWEN3_MOE, "mixtral": hf_reference.TINY_MIXTRAL,
    "deepseek_v3": hf_reference.TINY_DEEPSEEK_V3, "gpt_oss": hf_reference.TINY_GPT_OSS,
    "llama4_text": hf_reference.TINY_LLAMA4,
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Attention projections (DeepSeek-V3's latent ones) and, for DeepSeek-V3, its shared expert's Linear layers.
ATTENTION = {"deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
DEFAULT_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_targets(model_type: str) -> dict:
    """target_modules / target_parameters of the comparisons: every attention projection and the fused experts."""
    return {"target_modules": ATTENTION.get(model_type, DEFAULT_ATTENTION), "target_parameters": list(EXPERTS)}


def peft_model(model_type: str, r: int = 4, lora_alpha: float = 8, seed: int = 0, use_rslora: bool = False,
               **targets):
    """(the base HF model's state dict, a PEFT model over a copy of it) with every lora_B drawn from N(0, 0.1^2):
    PEFT initialises B to zero, which would hide a wrong layout."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = tiny_hf_model(model_type, TINY_CONFIGS[model_type])
    state = hf_reference.hf_state_dict(base)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=use_rslora, **(targets or lora_targets(model_type)))
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return state, model.eval()


def peft_logits(model, input_ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.as_tensor(input_ids)).logits.float().numpy()


def peft_loads(base_model_type: str, base_state: dict, adapter_dir: Path):
    """`PeftModel.from_pretrained` of `adapter_dir` over a Transformers model holding `base_state`."""
    import torch
    from peft import PeftModel

    base = tiny_hf_model(base_model_type, TINY_CONFIGS[base_model_type])
    base.load_state_dict({name: torch.as_tensor(value) for name, value in base_state.items()})
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def input_ids(vocab_size: int = 128, shape=(8, 10), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab_size, shape).astype(np.int32)


def saved_peft_adapter(model_type: str, directory: Path, targets: dict | None = None):
    """(base state dict, the directory PEFT saved its adapter to, input ids, PeftModel's logits for them)."""
    state, model = peft_model(model_type, **(targets or {}))
    model.save_pretrained(str(directory))
    ids = input_ids()
    return state, directory, ids, peft_logits(model, ids)
