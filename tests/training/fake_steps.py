"""A host-only stand-in for the train step, for tests of `TrainLoop`'s bookkeeping (records, replays, the router
watch) that need no model: each step is a few numpy scalars, so a loop of 20 steps takes milliseconds."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.distributed.capacity import CapacitySchedule


@dataclasses.dataclass
class FakeState:
    """What TrainLoop reads and replaces of a state."""

    step: int = 0
    data_position: int = 0
    capacity: float | None = None
    skipping: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.bool_))   # the sticky flag

    def replace(self, **changes) -> FakeState:
        return dataclasses.replace(self, **changes)


class FakeModel:
    capacity_schedule = CapacitySchedule((1.0, 2.0), patience=100)
    num_redundant_experts = 0

    @staticmethod
    def batch_sharding():
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])

    @staticmethod
    def sparse_layers():
        return [1]


class FakeStep:
    """Batch i is all token id i. expert_load: every token of layer 1 to one of 4 experts (4.0x the mean).
    needs: batch index -> the capacity it needs (it overflows below it); an overflow makes the state skip (the
    sticky flag) until the loop clears it, as the real step does."""

    model = FakeModel

    def __init__(self, needs: dict[int, float] | None = None):
        self.needs = needs or {}
        self.dispatched: list[int] = []   # the batch index of each call, in order

    def __call__(self, state: FakeState, batch):
        index = int(np.asarray(batch["input_ids"])[0, 0])
        self.dispatched.append(index)
        required = self.needs.get(index, 1.0)
        overflowed = state.capacity is not None and required > state.capacity
        skipping = bool(state.skipping) or overflowed
        after = state.replace(step=state.step + 1, data_position=index + 1) if not skipping else state
        after = after.replace(skipping=jnp.asarray(skipping))
        metrics = dict(step=after.step, loss=1.0, ce_loss=1.0, aux_loss=0.0, grad_norm=1.0, tokens=8, padded=0,
                       required_capacity=required, applied=not skipping, dropped=int(overflowed),
                       data_position=after.data_position, expert_load=np.array([[16, 0, 0, 0]]))
        return after, {name: np.asarray(value) for name, value in metrics.items()}


class FakeBatches:
    def batch(self, index: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.full((1, 8), index, np.int32)}
