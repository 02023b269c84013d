"""The NNX variable types the module keeps besides `nnx.Param`."""

from __future__ import annotations

from flax import nnx


class Buffer(nnx.Variable):
    """A checkpointed array that is not trained (DeepSeek-V3's `e_score_correction_bias`): not an
    `nnx.Param`, so `nnx.grad` and `nnx.Optimizer(..., wrt=nnx.Param)` leave it alone, as a torch optimizer
    never sees a module's buffers."""


class DispatchStats(nnx.Variable):
    """The last call's `DispatchStatistics` (dropped / padded / buffer_rows / required_capacity, summed
    over layers and devices), written by every `__call__` / `loss` inside the traced step; reading it on
    the host is the caller's choice (`MoeCausalLM.update_capacity`)."""
