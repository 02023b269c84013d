"""The expert load the next step will route: its batch through the model under the state's parameters, forward only.

    probe = NextLoadProbe(train_step)
    load = probe(state, batch)      # numpy [sparse layers, E]: the real tokens each sparse layer sends each expert

A router that trains moves its hot tokens between experts from one step to the next, so the load of the steps
before a re-placement can be far from the load of the step after it. The probe runs the step's own loss (its
micro-batches, precision, adapter, pipeline, step key and placement) without the gradient and the update, so
its load is the one the next step on `batch` reports (`expert_load`) as long as that step drops no pairs. XLA
drops what the load does not need (the lm_head and the loss, the layers after the last router).
`TrainLoop(rebalance_every=)` re-places from it and the window of the steps before (`placement_search`).
It costs about one forward pass of the batch per re-placement (docs/benchmarks.md, "Expert load balance"); one
compilation per (capacity, batch keys), as the step's.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .precompiled import Precompiled, batch_signature, holds_program
from .state import TrainState


class NextLoadProbe:
    """`probe(state, batch) -> expert_load [L, E]` (numpy) of `train_step`'s model on `batch` at `state`."""

    def __init__(self, train_step):
        if "expert_load" not in train_step.load_shapes():
            raise ValueError("the expert load probe needs a model with sparse layers; this one has none.")
        self.train_step = train_step
        self._compiled: dict[tuple, callable] = {}

    def __call__(self, state: TrainState, batch: dict) -> np.ndarray:
        key = (state.capacity, tuple(sorted(batch)))
        if key not in self._compiled:
            self._compiled[key] = self._jit()
        load = self._compiled[key](state, batch, *self.train_step._frozen_arguments())
        return np.asarray(jax.device_get(load), np.float64)

    def precompile(self, state: TrainState, batch: dict, capacities) -> dict[float | None, float]:
        """Compile the probe now for each of `capacities`, for batches shaped and keyed like `batch` (what
        `TrainStep.precompile` does for the step: a capacity move then stops no re-placement for a compilation).
        Returns {capacity: seconds} of those compiled here."""
        sharding = self.train_step.model.batch_sharding()
        spec = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for name, shape, dtype in batch_signature(batch)}
        signature, keys = batch_signature(spec), tuple(sorted(batch))
        seconds = {}
        for capacity in dict.fromkeys(capacities):
            if holds_program(self._compiled.get((capacity, keys)), signature):
                continue
            start = time.perf_counter()
            jitted = self._jit()
            compiled = jitted.lower(state.replace(capacity=capacity), spec, *self.train_step._frozen_spec()).compile()
            self._compiled[(capacity, keys)] = Precompiled(jitted, compiled, signature)
            seconds[capacity] = time.perf_counter() - start
        return seconds

    def _jit(self):
        # Replicated: every process of a multi-process run reads the whole load.
        return jax.jit(self._load, out_shardings=NamedSharding(self.train_step.model.mesh, P()))

    def _load(self, state: TrainState, batch: dict, frozen: dict | None = None) -> jax.Array:
        step = self.train_step
        params = step._on_device(state.params, step.shardings(state.capacity).params, 0)
        micro, total_tokens, mtp_weights = step.micro_batches(batch)
        step_key = jax.random.fold_in(state.rng, state.step)     # the next step's: the same router jitter

        def add(total, inputs):
            index, micro_batch = inputs
            _, terms = step._micro_loss(params, micro_batch, jax.random.fold_in(step_key, index), frozen=frozen,
                                        capacity=state.capacity, total_tokens=total_tokens,
                                        placement=state.expert_placement, mtp_weights=mtp_weights)
            return total + terms["expert_load"], None

        zero = jnp.zeros(step.load_shapes()["expert_load"], jnp.float32)
        total, _ = jax.lax.scan(add, zero, (jnp.arange(step.options.grad_accum), micro))
        return total
