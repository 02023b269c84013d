"""Model FLOPs of a training step, from the model's own parameter list: what MFU and TFLOP/s are counted in.

    flops = train_flops_per_token(model, seq_len)         # 6 x active parameters + causal attention
    mfu = tokens_per_s * flops / (devices * peak_flops)

Active parameters are the ones a token's forward pass multiplies by: every matrix except the input embedding,
the routed experts' weights at top_k / num_experts of their size (each token visits top_k of them; shared
experts and the router in full), norms and biases excluded. A training step costs 6 FLOPs per active parameter
per token (2 forward, 4 backward), plus causal attention's scores and weighted values: 6 x 2 x layers x seq_len x
query width per token, halved for the causal mask (PaLM's appendix B counts it unhalved; MaxText halves it).
"""

from __future__ import annotations

import math

ROUTED_EXPERTS = ".experts."   # `mlp.experts.*`, `feed_forward.experts.*`: not `shared_experts`


def active_parameters(model) -> int:
    """Parameters one token's forward pass multiplies by (see the module docstring)."""
    config = model.config
    share = getattr(config, "num_experts_per_tok", 1) / max(getattr(config, "num_experts", 1) or 1, 1)
    total = 0.0
    for name, spec in model.module_tree.named_parameters():
        if len(spec.shape) < 2 or name.endswith("embed_tokens.weight"):
            continue   # norms, biases, sinks; the embedding is a lookup
        size = math.prod(spec.shape)
        total += size * share if ROUTED_EXPERTS in name else size
    if getattr(config, "tie_word_embeddings", False):
        total += config.vocab_size * config.hidden_size   # the head multiplies by the tied embedding
    return int(total)


def attention_width(config) -> int:
    """Query heads x query head width (what each query's scores and value sums run over)."""
    heads = config.num_attention_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // heads
    if hasattr(config, "qk_nope_head_dim"):            # DeepSeek's latent attention
        width = config.qk_nope_head_dim + config.qk_rope_head_dim
    return heads * width


def train_flops_per_token(model, seq_len: int) -> float:
    """FLOPs of one trained token at sequences of `seq_len` (forward + backward)."""
    config = model.config
    attention = 6 * 2 * config.num_hidden_layers * seq_len * attention_width(config) / 2
    return 6.0 * active_parameters(model) + attention
