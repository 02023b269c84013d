"""Evaluation: the loss of held-out batches, without gradients, on the layout the model trains on.

    evaluator = Evaluator(model, loss_chunk=512)
    evaluator.run(state.params, eval_data, batches=8)     # {"eval_loss": ..., "eval_perplexity": ..., "eval_tokens": ...}
    evaluator.run(params, eval_data, adapter=adapter)    # with a LoRA adapter's arrays (`TrainStep.weights`)

Its program is its own jit around the model's step (the train step's compiled program is untouched, so
evaluating every N steps recompiles nothing after the first time). Experts run at the largest dispatch
capacity (never drops: the loss is exact whatever the batch), without router noise (`inference=True`). The
loss is the mean cross-entropy over every predicted token of the batches (the router's aux loss is a training
term, not part of it); perplexity is its exponential.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .data import place_batch
from .loss import DEFAULT_LOSS_CHUNK, model_loss, predicted_tokens, prediction_targets


class Evaluator:
    """The eval program of one model (compiled once per batch shape)."""

    def __init__(self, model, *, loss_chunk: int = DEFAULT_LOSS_CHUNK, compute_dtype=None):
        self.model, self.loss_chunk, self.compute_dtype = model, loss_chunk, compute_dtype
        self._jit = jax.jit(self._sums)

    def _sums(self, params, adapter, batch: dict) -> tuple[jax.Array, jax.Array]:
        """batch: input_ids [B, S] (attention_mask, labels, or packed rows' segment_ids / positions, optional) ->
        (cross-entropy sum, predicted tokens)."""
        segments = batch.get("segment_ids")   # packed rows
        targets = prediction_targets(batch["input_ids"], batch.get("attention_mask") if segments is None else segments,
                                     batch.get("labels"))
        _, terms = model_loss(self.model, params, batch["input_ids"], batch.get("attention_mask"), targets,
                              total_tokens=jnp.ones((), jnp.float32), aux_weight=0.0, capacity=None,
                              inference=True, compute_dtype=self.compute_dtype, loss_chunk=self.loss_chunk,
                              segment_ids=segments, positions=batch.get("positions"), adapter=adapter)
        return terms["ce_sum"], predicted_tokens(targets)

    def batch_sums(self, params, batch: dict, adapter=None) -> tuple[float, int]:
        """One placed batch -> (cross-entropy sum, predicted tokens) on the host."""
        self.model.check_step(params, batch["input_ids"].shape, adapter=adapter)
        ce_sum, tokens = jax.device_get(self._jit(params, adapter, batch))
        return float(ce_sum), int(tokens)

    def check(self, params, data, *, batches: int | None = None, adapter=None) -> None:
        """What `run` would refuse, found before a run starts: the batch count, and the eval program traced on
        the first batch (shapes only: nothing compiles or runs)."""
        count = batches if batches is not None else num_batches(data)
        if count < 1:
            raise ValueError(f"evaluation needs at least one batch, got {count}.")
        batch = place_batch(data, 0, self.model.batch_sharding())
        self.model.check_step(params, batch["input_ids"].shape, adapter=adapter)
        jax.eval_shape(self._sums, params, adapter, batch)

    def run(self, params, data, *, batches: int | None = None, start: int = 0, adapter=None) -> dict[str, float]:
        """Batches start .. start + batches - 1 of `data` (default: one pass over it, when it knows its length)
        -> eval_loss, eval_perplexity, eval_tokens. adapter: a LoRA adapter's arrays applied beside params."""
        count = batches if batches is not None else num_batches(data)
        if count < 1:
            raise ValueError(f"evaluation needs at least one batch, got {count}.")
        sharding = self.model.batch_sharding()
        total, tokens = 0.0, 0
        for index in range(start, start + count):
            ce_sum, predicted = self.batch_sums(params, place_batch(data, index, sharding), adapter)
            total, tokens = total + ce_sum, tokens + predicted
        if tokens == 0:
            raise ValueError("the evaluation batches predict no token (every row is padding or one token long).")
        loss = total / tokens
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": tokens}


def num_batches(data) -> int:
    """Whole batches in one pass over `data` (at least 1), for sources that know their row count. A corpus read
    in shares (one per process) counts its own rows per batch, and every process takes the smallest share's
    count, so all of them run the same batches (a collective: every process calls this)."""
    rows = getattr(data, "num_sequences", None)
    if rows is None:
        raise ValueError(f"{type(data).__name__} does not know its length: pass the number of eval batches.")
    count = max(rows // getattr(data, "rows_per_batch", data.batch_size), 1)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        count = int(multihost_utils.process_allgather(np.asarray(count, np.int32)).min())
    return count

