"""One engine step's inputs: the host arrays the scheduler fills row by row, their packing into two arrays for the
transfer, and their unpacking inside the compiled step. The layout lives here only.

    inputs = host_inputs(rows, tokens, pages)      # ids, mask [rows, S]; page_table [rows, pages]; per-row scalars
    ints, floats = packed(inputs, width)           # [rows, 2S + W + 5] int32, [rows, 2] float32
    unpacked(ints, floats, tokens)                 # on device: the same names, page_table [rows, W]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The per-row scalars after ids, mask and the page table, in the int array's order.
INT_SCALARS = ("lengths", "do_sample", "top_k", "seeds", "counters")


def host_inputs(rows: int, tokens: int, pages: int) -> dict[str, np.ndarray]:
    """Blank inputs for `rows` rows of `tokens` tokens (an idle row: no real token, greedy, stores nothing)."""
    return dict(ids=np.zeros((rows, tokens), np.int32), mask=np.zeros((rows, tokens), np.int32),
                page_table=np.zeros((rows, pages), np.int32), lengths=np.zeros(rows, np.int32),
                do_sample=np.zeros(rows, bool), temperature=np.ones(rows, np.float32),
                top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
                seeds=np.zeros(rows, np.uint32), counters=np.zeros(rows, np.int32))


def write_sampling(inputs: dict, row: int, settings, drawn: int) -> None:
    """Row `row` samples by `settings` (a `RequestSettings`), its next token the request's `drawn`-th (the key is
    `fold_in(key(seed), drawn)`). Raises OverflowError / ValueError when a setting does not fit its array."""
    inputs["do_sample"][row] = settings.do_sample
    inputs["temperature"][row] = settings.temperature
    inputs["top_k"][row] = settings.top_k or 0
    inputs["top_p"][row] = settings.top_p
    inputs["seeds"][row] = settings.seed % (1 << 32)
    inputs["counters"][row] = drawn


def blank_row(inputs: dict, row: int) -> None:
    """Row `row` idle again (a request that failed while its row was written)."""
    blank = host_inputs(1, inputs["ids"].shape[1], inputs["page_table"].shape[1])
    for name, values in inputs.items():
        values[row] = blank[name][0]


def packed(inputs: dict[str, np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """The host inputs as two arrays (one transfer each, not ten): ints [rows, 2S + W + 5] (ids, mask, page table
    cut to `width`, then INT_SCALARS) and floats [rows, 2] (temperature, top_p)."""
    scalars = dict(inputs, do_sample=inputs["do_sample"].astype(np.int32), seeds=inputs["seeds"].view(np.int32))
    ints = np.concatenate([inputs["ids"], inputs["mask"], inputs["page_table"][:, :width],
                           np.stack([scalars[name] for name in INT_SCALARS], axis=1)], axis=1)
    floats = np.stack([inputs["temperature"], inputs["top_p"]], axis=1).astype(np.float32)
    return ints.astype(np.int32), floats


def packed_width(ints_columns: int, tokens: int) -> int:
    """The page-table width of a packed int array of `ints_columns` columns for rows of `tokens` tokens."""
    return ints_columns - 2 * tokens - len(INT_SCALARS)


def unpacked(ints: jax.Array, floats: jax.Array, tokens: int) -> dict[str, jax.Array]:
    """`packed`'s arrays, inside the step -> the inputs by name (ids, mask [rows, S]; page_table [rows, W]; the
    per-row scalars [rows])."""
    width = packed_width(ints.shape[1], tokens)
    columns = [tokens, tokens, width] + [1] * len(INT_SCALARS)
    ids, mask, page_table, *scalars = jnp.split(ints, np.cumsum(columns)[:-1], axis=1)
    per_row = {name: column[:, 0] for name, column in zip(INT_SCALARS, scalars)}
    return dict(ids=ids, mask=mask, page_table=page_table, lengths=per_row["lengths"],
                do_sample=per_row["do_sample"] > 0, top_k=per_row["top_k"],
                seeds=jax.lax.bitcast_convert_type(per_row["seeds"], jnp.uint32), counters=per_row["counters"],
                temperature=floats[:, 0], top_p=floats[:, 1])
