"""`generate_batch`: a list of prompts through continuous batching, in the caller's thread.

    outputs = model.generate_batch([[1, 2, 3], [4, 5]], max_new_tokens=16)   # {"req_0": GenerationOutput, ...}

Transformers' `generate_batch`: the result maps request ids ("req_0", "req_1", ... in input order) to
`GenerationOutput`s whose `generated_tokens` are what `generate` gives each prompt alone (greedy), EOS
included when one ends it. Unless a `ContinuousBatchingConfig` says otherwise, the engine is sized for this
call: up to 32 slots and a context of the longest prompt plus the new tokens.
"""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from ..kv_cache import bucket_length
from .continuous import ContinuousBatchingConfig, GenerationOutput, Request
from .generation_config import GenerationConfig
from .manager import request_settings

DEFAULT_MAX_SLOTS = 32


def batch_config(model, inputs: list[list[int]], new_tokens: int, **fields) -> ContinuousBatchingConfig:
    """Slots for every prompt (up to DEFAULT_MAX_SLOTS, a multiple of the data-parallel size) and a context for
    the longest prompt plus `new_tokens` (bucketed, so nearby calls reuse the compiled programs); fields: more
    `ContinuousBatchingConfig` fields (speculative, num_speculative_tokens, ...)."""
    groups = model.data_parallel_size
    slots = -(-min(len(inputs), DEFAULT_MAX_SLOTS) // groups) * groups
    length = bucket_length(max(len(ids) for ids in inputs) + new_tokens + 1)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None:
        length = min(length, limit)
    # Drafting with MTP layers runs them in separate prefill and decode programs.
    fields = {"mixed_steps": fields.get("speculative") != "mtp", **fields}
    return ContinuousBatchingConfig(max_slots=slots, page_size=16, max_model_len=length,
                                    prefill_chunk=min(128, length), **fields)


def generate_batch(model, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   continuous_batching_config: ContinuousBatchingConfig | None = None, *,
                   progress_bar: bool = False, params=None, speculative: str | None = None,
                   num_speculative_tokens: int = 4, **kwargs) -> dict[str, GenerationOutput]:
    """inputs: prompts as token-id lists -> {request id: GenerationOutput}, in input order. kwargs: max_new_tokens,
    eos_token_id, do_sample, temperature, top_k, top_p, seed (request i samples with seed + i), stop, and the logits
    controls of `RequestSettings` (logprobs, logit_bias, penalties, min_tokens, stop_token_ids). speculative,
    num_speculative_tokens: speculative decoding (`ContinuousBatchingConfig`'s; ignored when
    `continuous_batching_config` is given)."""
    if not inputs:
        return {}
    seed = kwargs.pop("seed", 0)
    generation_config = generation_config or model.generation_config
    settings = [request_settings(generation_config, prompt_length=len(ids), seed=seed + i, **kwargs)
                for i, ids in enumerate(inputs)]
    config = continuous_batching_config or batch_config(
        model, inputs, max(s.max_new_tokens for s in settings),
        **({} if speculative is None else dict(speculative=speculative, num_speculative_tokens=num_speculative_tokens)))
    engine = model.continuous_batching_engine(config, params=params)
    requests = [Request(f"req_{i}", [int(t) for t in ids], s) for i, (ids, s) in
                enumerate(zip(inputs, settings))]
    for request in requests:
        engine.check(request)
    for request in requests:
        engine.add(request)
    with tqdm(total=len(requests), disable=not progress_bar, desc=f"Solving {len(requests)} requests",
              unit="request") as bar:
        while engine.has_work():
            bar.update(sum(event.finished for event in engine.step()))
    return {request.request_id: request.output for request in requests}


def speculative_sequences(model, input_ids: np.ndarray, attention_mask: np.ndarray, config: GenerationConfig, *,
                          speculative: str, num_speculative_tokens: int, seed: int = 0, params=None,
                          return_routing: bool = False):
    """`generate` with speculative decoding, through continuous batching: input_ids, attention_mask [B, S]
    (left-padded) -> numpy [B, S + n], the prompts then each row's new tokens, `pad_token_id` after a row's end
    (n: the most new tokens of any row), as `generate` returns them; return_routing: (them, routing [B, L, S + n,
    K], each request's `GenerationOutput.routing` at its tokens' columns, -1 elsewhere)."""
    prompts = [[int(t) for t, m in zip(row, mask) if m] for row, mask in zip(np.asarray(input_ids),
                                                                              np.asarray(attention_mask))]
    outputs = generate_batch(model, prompts, config, params=params, seed=seed, speculative=speculative,
                             num_speculative_tokens=num_speculative_tokens, return_routing=return_routing)
    new = [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    width = max(map(len, new))
    tail = np.full((len(prompts), width), config.padding_token(), np.int32)
    for row, tokens in enumerate(new):
        tail[row, :len(tokens)] = tokens
    sequences = np.concatenate([np.asarray(input_ids, np.int32), tail], axis=1)
    if not return_routing:
        return sequences
    first = outputs["req_0"].routing
    routing = np.full((len(prompts), first.shape[0], sequences.shape[1], first.shape[2]), -1, first.dtype)
    columns = input_ids.shape[1]
    for row, prompt in enumerate(prompts):
        recorded = outputs[f"req_{row}"].routing                      # [L, prompt + new, K]
        routing[row, :, columns - len(prompt):columns + len(new[row])] = recorded
    return sequences, routing
