"""Train steps compiled ahead for one batch signature (`TrainStep.precompile`)."""

from __future__ import annotations

import jax
import numpy as np


def batch_signature(batch: dict) -> tuple:
    """((name, shape, dtype), ...) of a batch's arrays (host or device, or ShapeDtypeStructs)."""
    return tuple((name, tuple(np.shape(value)), jax.dtypes.canonicalize_dtype(
        value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype)) for name, value in sorted(batch.items()))


class Precompiled:
    """A step compiled ahead (`TrainStep.precompile`) for batches of one signature; any other batch goes to the
    jitted step, which compiles for it on first use as usual."""

    def __init__(self, jitted, compiled, signature: tuple):
        self.jitted, self.compiled, self.signature = jitted, compiled, signature

    def __call__(self, state, batch, *frozen):
        return (self.compiled if batch_signature(batch) == self.signature else self.jitted)(state, batch, *frozen)


def holds_program(step, signature: tuple) -> bool:
    """Whether a cached step already has a compiled program for batches of `signature` (a jitted step's own
    cache is not inspected: precompiling over it builds the executable the next call would)."""
    return isinstance(step, Precompiled) and step.signature == signature
