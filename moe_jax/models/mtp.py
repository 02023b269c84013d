"""Multi-token prediction (MTP) layers, as DeepSeek-V3's checkpoints store them after the last decoder layer.

D = `mtp_layers` layers, L = num_hidden_layers; depth k = 1..D runs layer L + k - 1 (`model.layers.{L + k - 1}`):

    h^0     = the main model's last hidden states, before its final norm
    h'_i    = eh_proj([enorm(embed_tokens(t_{i+k})); hnorm(h^{k-1}_i)])     embeddings first (vLLM's, SGLang's order)
    h^k     = the layer's decoder block over h' (MLA, then MoE or dense as the layer's index says: the hub's
              layer 61 of DeepSeek-V3 is an MoE layer), causal, at the main model's positions
    logits^k_i = shared_head.head(shared_head.norm(h^k_i))                  predicts token t_{i+k+1}

Each MTP layer holds its own `embed_tokens` and `shared_head.head`: hub checkpoints store copies of the main
model's embedding and lm_head there, and they stay separate parameters here (loaded and written back as stored,
trained as their own). A model holds MTP layers only when built with `mtp_layers > 0`; `from_pretrained` does so
when the checkpoint holds them (`held_mtp_layers`): Transformers' configs default to num_nextn_predict_layers=1
while its checkpoints hold none. Unlike vLLM's drafter, the embedding at position 0 is not zeroed.

`mtp_step` is one layer on any positions: with S = 1 and the layer's own KV cache (`layer_cache`, `kv_view`: its
latents and rope keys per position, stored and read as a decoder layer's) it drafts one token after another. The
model's KV cache (`moe_jax.kv_cache`) holds no entry for the MTP layers yet; `return_mtp_logits` runs them without
a cache over whole sequences.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..module_tree import ModuleTree
from ..nn.embedding import embed
from ..nn.linear import linear
from ..nn.norms import rms_norm
from .family import Family
from .step_options import REMAT_POLICIES, StepOptions

# The tensors of an MTP layer beside its decoder block: a checkpoint holds the layer when it holds these.
MTP_OWN_PARAMS = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                  "shared_head.norm.weight", "shared_head.head.weight")


def mtp_layer_indices(config, mtp_layers: int) -> range:
    """The `model.layers` indices of the MTP layers: L, L + 1, ... (L = num_hidden_layers)."""
    return range(config.num_hidden_layers, config.num_hidden_layers + mtp_layers)


def declare_mtp_layer(tree: ModuleTree, config) -> None:
    """The MTP layer's own modules (inside its `model.layers.{index}` module; its decoder block beside them)."""
    hidden = config.hidden_size
    with tree.module("embed_tokens"):
        tree.param("weight", (config.vocab_size, hidden))
    tree.norm("enorm", hidden)
    tree.norm("hnorm", hidden)
    tree.linear("eh_proj", hidden, 2 * hidden)
    with tree.module("shared_head"):
        tree.norm("norm", hidden)
        tree.linear("head", config.vocab_size, hidden)


def held_mtp_layers(config, keys) -> int:
    """How many MTP layers (from layer L on, in order, at most the config's `num_nextn_predict_layers`) a checkpoint
    whose tensor names are `keys` holds: those with every tensor of `MTP_OWN_PARAMS`. A checkpoint with none of
    them, or only some (a stripped copy), holds none: those keys are skipped on load."""
    keys = set(keys)
    held = 0
    for layer in mtp_layer_indices(config, getattr(config, "num_nextn_predict_layers", 0) or 0):
        if not all(f"model.layers.{layer}.{name}" in keys for name in MTP_OWN_PARAMS):
            break
        held += 1
    return held


def check_mtp_layers(family: Family, config, mtp_layers: int) -> int:
    """`mtp_layers` as an int, after checking that the family and its config allow that many."""
    mtp_layers = int(mtp_layers)
    allowed = family.max_mtp_layers(config)
    if not 0 <= mtp_layers <= allowed:
        raise ValueError(f"mtp_layers={mtp_layers}: a {family.model_type} model with this config holds 0 to "
                         f"{allowed} multi-token-prediction layers (num_nextn_predict_layers of the config; families "
                         "without MTP layers: 0).")
    return mtp_layers


def mtp_sparse_layers(family: Family, config, mtp_layers: int) -> list[int]:
    """The MTP layers whose block is an MoE block (each has its experts module, as a sparse decoder layer)."""
    return [layer for layer in mtp_layer_indices(config, mtp_layers) if family.is_sparse(config, layer)]


class MtpStepOutput(NamedTuple):
    """hidden: [B, S, H] h^k (the next depth's previous hidden states); head_input: [B, S, H]
    shared_head.norm(h^k); logits: [B, S, V] or None (not asked); router_logits: [B*S, E] or None (dense block);
    statistics: the block's dispatch statistics or None; cache: the layer's cache arrays, or None."""

    hidden: jax.Array
    head_input: jax.Array
    logits: jax.Array | None
    router_logits: jax.Array | None
    statistics: Any
    cache: Any


def mtp_step(family: Family, config, weights: dict, layer: int, previous_hidden, next_ids, rope: tuple,
             attention_mask, step: StepOptions, *, logits: bool = True, layer_cache=None, kv_view=None
             ) -> MtpStepOutput:
    """One MTP layer (`model.layers.{layer}`, nested `weights`) at any positions.

    previous_hidden: [B, S, H] h^{k-1} at positions i (the main model's last hidden states before its final norm
    for the first layer); next_ids: [B, S] the token t_{i+k} at each position i (the token the previous depth, the
    main model for k = 1, predicts there); rope: (cos, sin) [B, S, D] of positions i; attention_mask: [B, S] (replaced
    by the cache's mask with a cache). layer_cache / kv_view: the layer's cache arrays and their view, as
    `decoder.decoder_layer` takes them (None: attention over these S positions only)."""
    from .decoder import decoder_layer  # the decoder skeleton imports this module for its declarations

    eps = config.rms_norm_eps
    embedded = embed(weights["embed_tokens"], next_ids)
    if step.compute_dtype is not None:
        embedded = embedded.astype(step.compute_dtype)
    joined = jnp.concatenate([rms_norm(weights["enorm"], embedded, eps),
                              rms_norm(weights["hnorm"], previous_hidden, eps).astype(embedded.dtype)], axis=-1)
    x = step.layouts.constrain(linear(weights["eh_proj"], joined), ("batch", "sequence", "embed"))
    block = partial(decoder_layer, family, config, layer=layer, rope=rope, attention_mask=attention_mask, step=step,
                    kv_view=kv_view)
    if step.remat != "none":
        block = jax.checkpoint(block, policy=REMAT_POLICIES[step.remat])
    x, router_logits, statistics, layer_cache = block(weights, x, layer_index=layer, layer_cache=layer_cache,
                                                      cache_row=0)
    head_input = rms_norm(weights["shared_head"]["norm"], x, eps)
    return MtpStepOutput(x, head_input, mtp_head_logits(weights, head_input) if logits else None, router_logits,
                         statistics, layer_cache)


def mtp_head_logits(weights: dict, head_input):
    """weights: one MTP layer's (nested); head_input: [B, S, H] (`MtpStepOutput.head_input`) -> logits [B, S, V]."""
    return linear(weights["shared_head"]["head"], head_input)


def shift_left(ids, shift: int, fill: int = 0):
    """ids: [B, S] -> [B, S] with ids[:, i + shift] at position i, `fill` past the end."""
    ids = jnp.asarray(ids)
    if shift == 0:
        return ids
    pad = jnp.full((ids.shape[0], min(shift, ids.shape[1])), fill, ids.dtype)
    return jnp.concatenate([ids[:, shift:], pad], axis=1)


def mtp_forward(family: Family, config, model: dict, last_hidden, input_ids, rope: tuple, attention_mask,
                step: StepOptions, mtp_layers: int, *, logits: bool = True):
    """Every depth over a whole sequence: model: params["model"] (nested); last_hidden: [B, S, H] the main model's
    last hidden states before its final norm; input_ids: [B, S] -> (stacked [D, B, S, V] logits, or [D, B, S, H]
    head inputs when `logits` is False, and the dispatch statistics of the MoE blocks). Depth k reads
    input_ids shifted left by k (token 0 past the end: positions whose target lies past the sequence)."""
    hidden, outputs, statistics = last_hidden, [], []
    for depth, layer in enumerate(mtp_layer_indices(config, mtp_layers), start=1):
        out = mtp_step(family, config, model["layers"][str(layer)], layer, hidden, shift_left(input_ids, depth),
                       rope, attention_mask, step, logits=logits)
        hidden = out.hidden
        outputs.append(out.logits if logits else out.head_input)
        if out.statistics is not None:
            statistics.append(out.statistics)
    return jnp.stack(outputs), statistics
