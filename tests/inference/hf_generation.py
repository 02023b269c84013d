"""The prompts and settings of the generation fixtures, and Transformers' `generate` on them (torch only
where called)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "fixtures" / "models"
FIXTURES = ROOT / "tests" / "fixtures" / "generation"
FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "llama4_text")
NEW_TOKENS = 20


def prompts(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids, attention_mask: [3, 7], left-padded rows of 7, 4 and 2 real tokens (pad id 0)."""
    rng = np.random.default_rng(0)
    input_ids = rng.integers(3, vocab_size, (3, 7)).astype(np.int64)
    attention_mask = np.ones_like(input_ids)
    attention_mask[1, :3] = 0
    attention_mask[2, :5] = 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def hf_generate(model_type: str, **kwargs) -> dict[str, np.ndarray]:
    """Transformers' fp32 greedy generation of NEW_TOKENS on the fixture prompts; then again with an EOS
    id that row 0 produces at its 4th new token (rows stop there and are padded with 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODELS / model_type, dtype=torch.float32).eval()
    input_ids, attention_mask = prompts(model.config.vocab_size)
    with torch.no_grad():
        greedy = model.generate(torch.tensor(input_ids), attention_mask=torch.tensor(attention_mask),
                                max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs).numpy()
        eos = int(greedy[0, input_ids.shape[1] + 3])
        with_eos = model.generate(torch.tensor(input_ids), attention_mask=torch.tensor(attention_mask),
                                  max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0,
                                  **kwargs).numpy()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "greedy": greedy,
            "eos_token_id": np.asarray(eos), "with_eos": with_eos}
