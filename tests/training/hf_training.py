"""The reference's training run for the loss-curve fixture: a tiny HF Qwen3-MoE trained with torch AdamW.

`scripts/fixtures/make_training_fixtures.py` records it in tests/fixtures/training/; the `reference` tests rerun it
live. Import `reference_training` only where torch is installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHECKPOINT = FIXTURES / "models" / "qwen3_moe"          # the committed tiny Qwen3-MoE checkpoint
CURVE = FIXTURES / "training" / "qwen3_moe_adamw.npz"

# The router loss is added (output_router_logits=True) with a coefficient large enough to show in the curve.
CONFIG_CHANGES = dict(output_router_logits=True, router_aux_loss_coef=0.1)
# lr 3e-3: at 1e-2, float-order differences between layouts grew through Adam into router top-2 flips by
# step 9-10 on 9 of the 48 layout cases (loss off by 1-2e-4; docs/benchmarks.md); at 3e-3 those layouts
# stay within 1.5e-6 of the reference.
SETUP = dict(steps=10, batch_size=8, seq_len=12, learning_rate=3e-3, weight_decay=0.01, grad_clip=1.0)


def training_batches(vocab_size: int, steps: int = SETUP["steps"], batch_size: int = SETUP["batch_size"],
                     seq_len: int = SETUP["seq_len"]) -> tuple[np.ndarray, np.ndarray]:
    """input_ids, attention_mask: [steps, B, S]; rows 1 and 5 of every batch are right-padded (3 and 6 tokens),
    as a training collator pads."""
    rng = np.random.default_rng(7)
    # Ids from a small part of the vocabulary: a distribution the model can learn within 10 steps.
    input_ids = rng.integers(3, min(vocab_size, 24), (steps, batch_size, seq_len)).astype(np.int32)
    attention_mask = np.ones_like(input_ids)
    attention_mask[:, 1, -3:] = 0
    attention_mask[:, 5, -6:] = 0
    return input_ids, attention_mask


def reference_training(checkpoint=CHECKPOINT, setup=SETUP) -> dict[str, np.ndarray]:
    """Train the checkpoint with the reference: labels = input_ids with -100 at padding, torch AdamW,
    clip_grad_norm_ over all parameters. Returns losses, aux_losses, grad_norms [steps] (float64)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **CONFIG_CHANGES)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup["learning_rate"], betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=setup["weight_decay"])
    input_ids, attention_mask = training_batches(model.config.vocab_size, setup["steps"], setup["batch_size"],
                                                 setup["seq_len"])
    losses, aux_losses, grad_norms = [], [], []
    for step in range(setup["steps"]):
        ids, mask = torch.as_tensor(input_ids[step]).long(), torch.as_tensor(attention_mask[step])
        labels = ids.masked_fill(mask == 0, -100)
        output = model(input_ids=ids, attention_mask=mask, labels=labels)
        output.loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), setup["grad_clip"])))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(output.loss.detach()))
        aux_losses.append(float(output.aux_loss.detach()))
    return {"losses": np.asarray(losses), "aux_losses": np.asarray(aux_losses), "grad_norms": np.asarray(grad_norms)}
