"""From the sampler's outputs to the train step's batch: prompts and completions right-padded to one length, the
completion tokens as the only labels, and per position the sampler's log probability and the sample's advantage
(aligned with the predictions: position t carries what belongs to the token at t + 1), with the sampler's routing
where it recorded one (`routing_replay`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..training.loss import IGNORE_INDEX


def rollout_batch(outputs: Sequence, advantages, *, length: int, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """outputs: N `GenerationOutput`s (prompt_ids, generated_tokens, logprobs; `routing` [L, P + G, K] when the
    sampler recorded it) -> the batch of a train step with a policy objective (`rl.ClippedPolicyObjective`):
    input_ids, attention_mask, labels (the completion's tokens, -100 elsewhere), old_logprobs and advantages, all
    [N, length] (a fixed length keeps one compiled step), and routing [N, L, length, K] (-1 where nothing was
    recorded) when every output carries one. advantages: [N], one per output."""
    advantages = np.asarray(advantages, np.float32)
    if advantages.shape != (len(outputs),):
        raise ValueError(f"advantages has shape {list(advantages.shape)}: give one per output ({len(outputs)}).")
    input_ids = np.full((len(outputs), length), pad_token_id, np.int32)
    attention_mask = np.zeros((len(outputs), length), np.int32)
    labels = np.full((len(outputs), length), IGNORE_INDEX, np.int32)
    old_logprobs = np.zeros((len(outputs), length), np.float32)
    for row, output in enumerate(outputs):
        prompt, completion = list(output.prompt_ids), list(output.generated_tokens)
        tokens = prompt + completion
        if len(tokens) > length:
            raise ValueError(f"{output.request_id}: {len(prompt)} prompt and {len(completion)} generated tokens do "
                             f"not fit length={length}; raise it to the longest prompt plus max_new_tokens.")
        if len(output.logprobs) != len(completion):
            raise ValueError(f"{output.request_id}: {len(output.logprobs)} logprobs for {len(completion)} generated "
                             "tokens: sample with logprobs=True.")
        input_ids[row, :len(tokens)] = tokens
        attention_mask[row, :len(tokens)] = 1
        labels[row, len(prompt):len(tokens)] = completion
        # Position t predicts token t + 1: the first completion token's prediction sits at the prompt's last.
        old_logprobs[row, len(prompt) - 1:len(tokens) - 1] = output.logprobs
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
             "old_logprobs": old_logprobs, "advantages": np.repeat(advantages[:, None], length, axis=1)}
    routings = [getattr(output, "routing", None) for output in outputs]
    if routings and all(routing is not None for routing in routings):
        batch["routing"] = padded_routing(routings, length)
    return batch


def padded_routing(routings: Sequence, length: int) -> np.ndarray:
    """routings: N arrays [L, T_n, K] (T_n <= length) -> [N, L, length, K] int32, -1 past each one's tokens."""
    layers, _, top_k = np.shape(routings[0])
    out = np.full((len(routings), layers, length, top_k), -1, np.int32)
    for row, routing in enumerate(routings):
        routing = np.asarray(routing)
        out[row, :, :routing.shape[1]] = routing
    return out


def routing_mismatch(recorded, recomputed) -> float:
    """recorded, recomputed: [N, L, S, K] expert ids (-1 in recorded: no record) -> the share of recorded (token,
    layer) rows whose set of experts the recomputation changed (the order within the top k does not count)."""
    recorded, recomputed = np.sort(np.asarray(recorded), axis=-1), np.sort(np.asarray(recomputed), axis=-1)
    if recorded.shape != recomputed.shape:
        raise ValueError(f"recorded routing {list(recorded.shape)} and recomputed {list(recomputed.shape)} differ in "
                         "shape: both are [N, L, S, K].")
    kept = (recorded >= 0).all(axis=-1)
    changed = (recorded != recomputed).any(axis=-1)
    return float((changed & kept).sum() / max(kept.sum(), 1))
