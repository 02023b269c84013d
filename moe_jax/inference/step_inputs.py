"""One engine step's inputs: the host arrays the scheduler fills row by row, their packing into two arrays for the
transfer, and their unpacking inside the compiled step. The layout lives here only.

    inputs = host_inputs(rows, tokens, pages, vocab)   # ids, mask [rows, S]; page_table [rows, pages]; per-row scalars
    ints, floats = packed(inputs, width)           # [rows, 2S + W + 11 + B + M] int32, [rows, 5 + B] float32
    unpacked(ints, floats, tokens, vocab)          # on device: the same names, page_table [rows, W]

Each row also carries its request's logits controls (`RequestSettings`): B = `BIAS_WIDTH` (token id, bias) pairs
added to its logits (logit_bias, and -inf on the stop ids while min_tokens holds them back; unused pairs: id 0,
bias 0), its penalties, whether it reports log probabilities, and for the penalties' token counts (kept on the
device per slot, `StepPrograms`) its slot and what its tokens are (`PENALTY_*`). For drafting with MTP layers,
`next_id`: the token after the row's last one when the host knows it (a prompt piece before the prompt's end),
else -1 (the token the step samples); `capacity`: the tokens its pages hold. `allowed`: the tokens its grammar
allows next (structured output, `grammar`), a bitmask of M = ceil(V / 32) int32 words over the model's V ids (bit
v % 32 of word v // 32); -1 words (every token) for a row without a grammar. `adapter`: its request's LoRA
adapter in the model's adapter set (0: none). `routing` (host only, not packed): the row's request records its
routing (the step runs its program's routing variant).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .grammar import mask_words
from .requests import MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOP_IDS

# The per-row scalars after ids, mask and the page table, in the int array's order (then the bias ids).
INT_SCALARS = ("lengths", "do_sample", "top_k", "seeds", "counters", "slots", "penalty", "logprobs", "next_id",
               "capacity", "adapter")
# The per-row scalars of the float array, in its order (then the bias values).
FLOAT_SCALARS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# (token id, bias) pairs per row: a request's logit_bias and the stop ids min_tokens masks.
BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_MIN_TOKENS_STOP_IDS
# A row's `penalty`: no penalty (its slot's counts untouched); a generated token (its input id is counted); a
# prompt piece (its ids are marked as the prompt's); the request's first prompt piece (its slot's counts reset).
PENALTY_OFF, PENALTY_DECODE, PENALTY_PROMPT, PENALTY_FIRST_PROMPT = 0, 1, 2, 3
FLOAT_COLUMNS = len(FLOAT_SCALARS) + BIAS_WIDTH


def host_inputs(rows: int, tokens: int, pages: int, vocab: int) -> dict[str, np.ndarray]:
    """Blank inputs for `rows` rows of `tokens` tokens over a vocabulary of `vocab` ids (an idle row: no real
    token, greedy, stores nothing, every token allowed)."""
    return dict(ids=np.zeros((rows, tokens), np.int32), mask=np.zeros((rows, tokens), np.int32),
                page_table=np.zeros((rows, pages), np.int32), lengths=np.zeros(rows, np.int32),
                do_sample=np.zeros(rows, bool), temperature=np.ones(rows, np.float32),
                top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
                seeds=np.zeros(rows, np.uint32), counters=np.zeros(rows, np.int32), slots=np.zeros(rows, np.int32),
                penalty=np.zeros(rows, np.int32), logprobs=np.zeros(rows, np.int32),
                next_id=np.full(rows, -1, np.int32), capacity=np.zeros(rows, np.int32),
                adapter=np.zeros(rows, np.int32), routing=np.zeros(rows, bool),
                presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
                repetition_penalty=np.ones(rows, np.float32), bias_ids=np.zeros((rows, BIAS_WIDTH), np.int32),
                bias=np.zeros((rows, BIAS_WIDTH), np.float32),
                allowed=np.full((rows, mask_words(vocab)), -1, np.int32))


def write_sampling(inputs: dict, row: int, settings, drawn: int, allowed: np.ndarray | None = None) -> None:
    """Row `row` samples by `settings` (a `RequestSettings`), its next token the request's `drawn`-th (the key is
    `fold_in(key(seed), drawn)`), among the tokens of bitmask `allowed` (its grammar's; None: every token). Raises
    OverflowError / ValueError when a setting does not fit its array."""
    inputs["allowed"][row] = -1 if allowed is None else allowed
    inputs["do_sample"][row] = settings.do_sample
    inputs["temperature"][row] = settings.temperature
    inputs["top_k"][row] = settings.top_k or 0
    inputs["top_p"][row] = settings.top_p
    inputs["seeds"][row] = settings.seed % (1 << 32)
    inputs["counters"][row] = drawn
    inputs["logprobs"][row] = settings.logprobs
    inputs["adapter"][row] = settings.adapter
    inputs["routing"][row] = settings.return_routing
    inputs["presence_penalty"][row] = settings.presence_penalty
    inputs["frequency_penalty"][row] = settings.frequency_penalty
    inputs["repetition_penalty"][row] = settings.repetition_penalty
    held_back = settings.stop_ids() if drawn < settings.min_tokens else ()
    pairs = list(settings.logit_bias) + [(token, -np.inf) for token in held_back]
    if len(pairs) > BIAS_WIDTH:
        raise ValueError(f"{len(pairs)} logit_bias entries and min_tokens stop ids: at most {BIAS_WIDTH}.")
    inputs["bias_ids"][row] = 0
    inputs["bias"][row] = 0
    if pairs:
        inputs["bias_ids"][row, :len(pairs)] = [token for token, _ in pairs]
        inputs["bias"][row, :len(pairs)] = [value for _, value in pairs]


def write_penalty_row(inputs: dict, row: int, slot: int, kind: int) -> None:
    """Row `row` is slot `slot`'s, its tokens of kind `kind` (`PENALTY_DECODE`, `PENALTY_PROMPT`,
    `PENALTY_FIRST_PROMPT`): the step keeps the slot's token counts for its penalties."""
    inputs["slots"][row] = slot
    inputs["penalty"][row] = kind


def blank_row(inputs: dict, row: int) -> None:
    """Row `row` idle again (a request that failed while its row was written)."""
    blank = host_inputs(1, inputs["ids"].shape[1], inputs["page_table"].shape[1], 32 * inputs["allowed"].shape[1])
    for name, values in inputs.items():
        values[row] = blank[name][0]


def packed(inputs: dict[str, np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """The host inputs as two arrays (one transfer each, not twenty): ints [rows, 2S + W + 11 + B + M] (ids, mask,
    page table cut to `width`, INT_SCALARS, the bias ids, then the allowed tokens' bitmask) and floats [rows, 5 + B]
    (FLOAT_SCALARS, then the biases)."""
    scalars = dict(inputs, do_sample=inputs["do_sample"].astype(np.int32), seeds=inputs["seeds"].view(np.int32))
    ints = np.concatenate([inputs["ids"], inputs["mask"], inputs["page_table"][:, :width],
                           np.stack([scalars[name] for name in INT_SCALARS], axis=1), inputs["bias_ids"],
                           inputs["allowed"]], axis=1)
    floats = np.stack([inputs["temperature"], inputs["top_p"]], axis=1).astype(np.float32)
    floats = np.concatenate([floats, np.stack([inputs[name] for name in FLOAT_SCALARS[2:]], axis=1),
                             inputs["bias"]], axis=1, dtype=np.float32)
    return ints.astype(np.int32, copy=False), floats


def packed_width(ints_columns: int, tokens: int, vocab: int) -> int:
    """The page-table width of a packed int array of `ints_columns` columns for rows of `tokens` tokens."""
    return ints_columns - 2 * tokens - len(INT_SCALARS) - BIAS_WIDTH - mask_words(vocab)


def unpacked(ints: jax.Array, floats: jax.Array, tokens: int, vocab: int) -> dict[str, jax.Array]:
    """`packed`'s arrays, inside the step -> the inputs by name (ids, mask [rows, S]; page_table [rows, W]; the
    per-row scalars [rows]; bias_ids, bias [rows, B]; allowed [rows, M])."""
    width = packed_width(ints.shape[1], tokens, vocab)
    columns = [tokens, tokens, width] + [1] * len(INT_SCALARS) + [BIAS_WIDTH]
    ids, mask, page_table, *scalars, bias_ids, allowed = jnp.split(ints, np.cumsum(columns), axis=1)
    per_row = {name: column[:, 0] for name, column in zip(INT_SCALARS, scalars)}
    per_row_floats = {name: floats[:, i] for i, name in enumerate(FLOAT_SCALARS)}
    return dict(per_row, **per_row_floats, ids=ids, mask=mask, page_table=page_table,
                do_sample=per_row["do_sample"] > 0, seeds=jax.lax.bitcast_convert_type(per_row["seeds"], jnp.uint32),
                bias_ids=bias_ids, bias=floats[:, len(FLOAT_SCALARS):], allowed=allowed)
