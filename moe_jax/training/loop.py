"""The training loop: dispatch one step ahead, confirm one step late, replay what overflowed.

    loop = TrainLoop(train_step, data, on_step=print, checkpoints=checkpoints)   # checkpoints: optional
    state, capacity = loop.run(state, until_step=100)

Each step is dispatched before the previous one's metrics are read, so the device never waits for the host.
Reading step k's metrics (while step k + 1 runs) tells whether k applied its update. When k's dispatch
overflowed, k and the step already queued behind it returned their input state (the sticky flag), so the
loop clears the flag, raises the capacity to what k required (at least the next rung of the ladder) and
replays k's batch and the ones after it: every batch is applied once, in order, and the results are those
of a dropless run. The capacity moves by the model's `CapacitySchedule` (up at once, down after `patience`
calm steps; `CapacitySchedule.settle` decides, as for `forward` and the NNX face) and is part of the state,
so checkpoints hold it.

Data sources are indexable (`data.batch(index) -> {"input_ids": [B, S], ...}`), which makes replay and
resume exact: the state's `data_position` is the index of the next batch.

With redundant expert slots, `rebalance_every=N` re-places the experts after every N-th step (host side, between
steps, the queue drained as for a save) for two loads at once (`placement_search.replacement`): the real tokens
each expert got in the last N applied steps (the state's `expert_load_window`, added up by the step itself, each
step counting `step.LOAD_WINDOW_DECAY` of the one after it, in logical expert ids whatever the placement each step
ran) and the tokens the next batch sends each expert under the updated parameters (`load_probe.NextLoadProbe`: a
forward pass of that batch; `rebalance_lookahead=B`: of the next B batches; with N = 1 that load alone).
A router that trains moves its hot tokens between experts from step to step; the placement whose busiest rank is
least under the worst of the loads serves the next step and the ones after it. The following steps run it as an
input of the same program; a layer keeps its placement where the new one would not do better on those loads. The
placement and the window are in the state, so checkpoints resume them exactly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ..distributed.capacity import CapacitySchedule, CapacityState, CapacityTracker
from ..distributed.placement_search import replacement
from .data import place_batch
from .load_probe import NextLoadProbe
from .router_health import RouterCollapseWatch
from .state import TrainState


class BatchSource(Protocol):
    def batch(self, index: int) -> dict[str, np.ndarray]:
        """The global batch number `index` (deterministic: a replay or a resume asks for it again)."""


@dataclass
class _InFlight:
    data_index: int
    capacity: float | None
    metrics: dict[str, jax.Array]
    replayed: bool


class TrainLoop:
    """Runs `train_step` over `data` with lag-one confirmation and exact replay.

    on_step(record): called once per applied optimizer step, in order, with a dict of floats/ints: step,
        loss, ce_loss, aux_loss (router_z_loss with a z-loss, mtp_loss with an MTP loss), grad_norm, tokens,
        tokens_per_s, capacity (that the step ran at), required_capacity, padded (dispatch buffer rows that carried nothing), replayed (its
        batch had overflowed and was run again; not the steps queued behind it), replays (overflows so far), data_position, lr (the rate of that update)
        when `learning_rate` (the optimizer's schedule, or a constant) is given, and expert_load (per sparse
        layer, a list of the real tokens sent to each expert) with expert_load_layers (each row's layer index in
        the model) where the step reports it, and ep_rank_load (per sparse layer, the real (token, expert) pairs
        each ep rank computed; rows as expert_load's) where experts are dispatched over ep.
    evaluate(step, state) -> metrics merged into that step's record, after the steps where `should_evaluate(step)`
        (the loop drains its queue first, as for a save: `state` is exactly the state after `step`).
    save(step, state, capacity_state): called after step `step` applied when `should_save(step)`; the loop
        drains the queue first, so `state` is exactly the state after that step. The record of the step after a
        save has `save_wait_s`: the seconds the loop waited in it.
    checkpoints: a `TrainCheckpoints` (anything with should_save, save and wait): the defaults of
        `should_save` and `save`, and `run` waits for its last save before returning.
    rebalance_every: re-place the experts of a model with redundant slots after every that many steps (module
        docstring; also `model.set_expert_placement`); that step's record has `rebalanced: True` and `rebalance_s`:
        the seconds the re-placement took (the next batches' forward passes and the placement search).
    rebalance_lookahead: the batches after a re-placement whose load under the updated parameters it serves with
        the window, one forward pass each (default 1; with `rebalance_every=1` no window).
    preemption: a `training.preemption.Preemption`: once it is `reached`, the loop dispatches no more steps,
        confirms those in flight, saves the last (`save`, when given) and returns; `preempted_at` is then that step.
    router_watch: called with each record before `on_step` (default: a `RouterCollapseWatch`, which warns once
        when a sparse layer's router keeps sending most tokens to a few experts).
    """

    def __init__(self, train_step, data: BatchSource, *, schedule: CapacitySchedule | None = None,
                 on_step: Callable[[dict], None] | None = None,
                 should_save: Callable[[int], bool] | None = None,
                 save: Callable[[int, TrainState, CapacityState | None], None] | None = None,
                 checkpoints=None, learning_rate: Callable[[int], float] | None = None,
                 evaluate: Callable[[int, TrainState], dict] | None = None,
                 should_evaluate: Callable[[int], bool] | None = None, rebalance_every: int | None = None,
                 rebalance_lookahead: int = 1, preemption=None, router_watch: Callable[[dict], Any] | None = None):
        if rebalance_every is not None and rebalance_every < 1:
            raise ValueError(f"rebalance_every={rebalance_every} must be >= 1 (steps between re-placements).")
        if rebalance_lookahead < 1:
            raise ValueError(f"rebalance_lookahead={rebalance_lookahead} must be >= 1 (batches whose load a "
                             "re-placement measures).")
        if rebalance_every is not None and rebalance_lookahead > rebalance_every:
            raise ValueError(f"rebalance_lookahead={rebalance_lookahead} would measure batches past the next "
                             f"re-placement (rebalance_every={rebalance_every}): use at most {rebalance_every}.")
        if rebalance_every is not None and not train_step.model.num_redundant_experts:
            raise ValueError("rebalance_every re-places experts into redundant expert slots, and this model has none: "
                             "build it with num_redundant_experts=R (moe-jax train --num-redundant-experts R).")
        self.rebalance_every, self.rebalance_lookahead = rebalance_every, rebalance_lookahead
        # The next batches' load at each re-placement (`precompile` it with the step's ladder to keep runs smooth).
        self.next_load = None if rebalance_every is None else NextLoadProbe(train_step)
        self.train_step, self.data = train_step, data
        self.learning_rate = learning_rate
        self.evaluate = evaluate
        self.should_evaluate = should_evaluate or (lambda step: False)
        self.schedule = schedule or train_step.model.capacity_schedule
        self.on_step = on_step or (lambda record: None)
        self.checkpoints = checkpoints
        if checkpoints is not None:
            should_save, save = should_save or checkpoints.should_save, save or checkpoints.save
        self.should_save = should_save or (lambda step: False)
        self.save = save
        self.replays = 0
        self.preemption, self.preempted_at = preemption, None
        self._save_wait = 0.0   # seconds the loop waited in saves since the last record
        self.router_watch = router_watch or RouterCollapseWatch()
        self.batch_sharding = train_step.model.batch_sharding()
        # expert_load's rows are the sparse layers in order; records name them by the model's layer index.
        self._sparse_layers = list(train_step.model.sparse_layers())
        # The record's lr is computed on the host's CPU: on an accelerator the schedule's op would queue behind
        # the step in flight, and reading it would wait for that step (losing the one-step overlap).
        self._host_device = jax.local_devices(backend="cpu")[0]

    def run(self, state: TrainState, until_step: int, capacity_state: CapacityState | None = None
            ) -> tuple[TrainState, CapacityState | None]:
        """Train until `state.step == until_step`; returns the final state and capacity state."""
        # The run's capacity: `state.capacity` is the step's static copy of it (its compilation key).
        if capacity_state is None and state.capacity is not None:
            capacity_state = CapacityState(state.capacity)
        tracker = CapacityTracker(self.schedule, capacity_state, dispatches=capacity_state is not None)
        step, next_index = (int(v) for v in jax.device_get((state.step, state.data_position)))
        pending: deque[_InFlight] = deque()
        # The batches that overflowed (and were run again): only they are records' `replayed`; the steps queued
        # behind one are run again too, but did not overflow, and `replays` counts the overflows.
        overflowed: set[int] = set()
        last_confirmation = time.perf_counter()
        stopping = saved = False
        while step < until_step:
            if stopping and not pending:
                break
            expected = step + len(pending)
            # A step to save or evaluate after is not run past: the state is then exactly that step's.
            holds = (self.should_save(expected) or (self.evaluate is not None and self.should_evaluate(expected))
                     or self._should_rebalance(expected))
            if expected < until_step and not stopping and not (pending and holds):
                batch = place_batch(self.data, next_index, self.batch_sharding)
                state, metrics = self.train_step(state, batch)
                pending.append(_InFlight(next_index, state.capacity, metrics, next_index in overflowed))
                next_index += 1
                if len(pending) < 2:
                    continue
            entry = pending.popleft()
            values = {name: np.asarray(value) for name, value in jax.device_get(entry.metrics).items()}
            required = float(values["required_capacity"])
            if not bool(values["applied"]):
                # It dropped pairs, or a step before it did (the sticky flag): replay from its batch, at least
                # a rung up.
                dropped = max(int(values["dropped"]), 1)
                tracker.settle(entry.capacity, dropped, required)
                self.replays += 1
                skipping = jax.device_put(jnp.zeros((), jnp.bool_), state.skipping.sharding)
                state = state.replace(capacity=tracker.capacity, skipping=skipping)
                overflowed.add(entry.data_index)
                next_index = entry.data_index
                pending.clear()
                continue
            step += 1
            now = time.perf_counter()
            record = self._record(values, entry, now - last_confirmation)
            if self._save_wait:
                record["save_wait_s"], self._save_wait = self._save_wait, 0.0
            last_confirmation = now
            if tracker.state is not None:
                tracker.settle(entry.capacity, 0, required)
                if tracker.capacity != state.capacity:
                    state = state.replace(capacity=tracker.capacity)
            if self._should_rebalance(step) and not pending:
                state = self._rebalanced(state, next_index)
                last_confirmation, began = time.perf_counter(), last_confirmation   # not the next step's time
                record.update(rebalanced=True, rebalance_s=last_confirmation - began)
            if self.evaluate is not None and self.should_evaluate(step) and not pending:
                record.update(self.evaluate(step, state))
                last_confirmation = time.perf_counter()   # the evaluation's time is not the next step's
            self.router_watch(record)
            self.on_step(record)
            saved = False
            if self.save is not None and self.should_save(step) and not pending:
                self._timed_save(step, state, tracker.state)
                saved = True
            stopping = stopping or (self.preemption is not None and self.preemption.reached(step))
        if stopping:
            self.preempted_at = step
            if self.save is not None and not saved:
                self._timed_save(step, state, tracker.state)
        if self.checkpoints is not None:
            self.checkpoints.wait()  # the last (asynchronous) save is on disk when the caller gets the state
        return state, tracker.state

    def _timed_save(self, step: int, state: TrainState, capacity_state) -> None:
        """`save`, its blocking time (an asynchronous save returns once the arrays are copied out, after the
        previous save finished: at most one in flight) kept for the next record's `save_wait_s`."""
        began = time.perf_counter()
        self.save(step, state, capacity_state)
        self._save_wait += time.perf_counter() - began

    def _should_rebalance(self, step: int) -> bool:
        return self.rebalance_every is not None and step % self.rebalance_every == 0

    def _rebalanced(self, state: TrainState, next_index: int) -> TrainState:
        """`state` running the placement for its load window and batch `next_index`'s load under its parameters
        (per layer, where it gives the busiest rank less than the placement in force under the worse of the two:
        `placement_search.replacement`), the window zeroed (the model's placement too, for what runs it after the
        loop)."""
        model = self.train_step.model
        window = state.expert_load_window
        upcoming = [self.next_load(state, place_batch(self.data, index, self.batch_sharding))
                    for index in range(next_index, next_index + self.rebalance_lookahead)]
        # The first batch is measured under the very parameters its step runs; the later ones under parameters that
        # the steps before them will have moved, which the window's recent past hedges. One step to the next
        # re-placement: the first batch's load is that step's exactly, and the window only costs.
        if self.rebalance_every > 1:
            upcoming.insert(0, np.asarray(jax.device_get(window), np.float64))
        loads = np.stack(upcoming)
        current = jax.tree.map(lambda array: np.asarray(jax.device_get(array)), state.expert_placement)
        placement = model.set_expert_placement(replacement(
            current, loads, num_redundant_experts=model.num_redundant_experts, ep_size=model.layout.ep_size))
        # A copy: the step donates its state, and the model keeps running its own placement after the loop.
        return state.replace(expert_placement=jax.tree.map(jnp.copy, placement),
                             expert_load_window=jax.device_put(jnp.zeros(window.shape, window.dtype), window.sharding))

    def _learning_rate(self, update: int) -> float:
        with jax.default_device(self._host_device):
            return float(self.learning_rate(update))

    def _record(self, values: dict[str, np.ndarray], entry: _InFlight, seconds: float) -> dict[str, Any]:
        tokens = int(values["tokens"])
        return {
            "step": int(values["step"]), "loss": float(values["loss"]), "ce_loss": float(values["ce_loss"]),
            "aux_loss": float(values["aux_loss"]), "grad_norm": float(values["grad_norm"]), "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"), "capacity": entry.capacity,
            "required_capacity": float(values["required_capacity"]), "padded": int(values["padded"]),
            "replayed": entry.replayed, "replays": self.replays, "data_position": int(values["data_position"]),
            **({} if self.learning_rate is None else {"lr": self._learning_rate(int(values["step"]) - 1)}),
            **{name: float(values[name]) for name in ("router_z_loss", "mtp_loss") if name in values},
            **({} if "expert_load" not in values else {"expert_load": values["expert_load"].tolist(),
                                                       "expert_load_layers": self._sparse_layers}),
            **({} if "ep_rank_load" not in values else {"ep_rank_load": values["ep_rank_load"].tolist()}),
        }
