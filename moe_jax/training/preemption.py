"""Stopping a training loop cleanly when the cluster asks for the devices back.

Schedulers preempt a job with SIGTERM (Slurm, Kubernetes; some send SIGUSR1 ahead of it) and requeue the same
command line. `Preemption` turns those signals into a request the loop answers at the next step boundary: it stops
dispatching, confirms the steps in flight, saves a checkpoint of the last one and returns (`TrainLoop(preemption=)`);
`moe-jax train` then says so in one line and exits 0, and the same command with `--resume` continues.

Every process of a multi-process job must stop at the same step. One process: the first step confirmed after the
signal. Several: JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`), which agrees on
the step through the coordination service without a collective on the devices; JAX's runtime catches SIGTERM for
it, so the other signals are passed on to it as SIGTERM. A second signal while the loop stops is reported and
ignored: the checkpoint being written is not cut short (orbax writes it under a temporary name and renames it).
"""

from __future__ import annotations

import os
import signal
import sys

import jax

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


def signal_numbers(names) -> list[signal.Signals]:
    """Signal names ("SIGTERM", "USR1", ...) -> signals; ValueError naming an unknown one."""
    numbers = []
    for name in names:
        full = name.strip().upper()
        full = full if full.startswith("SIG") else "SIG" + full
        if not hasattr(signal, full) or full in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"unknown or uncatchable signal {name!r}: name signals such as SIGTERM, SIGUSR1, SIGINT.")
        numbers.append(signal.Signals[full])
    return numbers


class Preemption:
    """Installs handlers for `signals` (names; DEFAULT_SIGNALS) while in use (`with Preemption(): ...`); the loop
    asks `reached(step)` once per confirmed step. `request(name)` is what a handler does (tests and callers that
    learn of a preemption otherwise call it too). `signal_name`: the signal that asked, or None."""

    def __init__(self, signals=DEFAULT_SIGNALS):
        self.signals = signal_numbers(signals)
        self.signal_name: str | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._multi = jax.process_count() > 1

    def __enter__(self) -> Preemption:
        for number in self.signals:
            if self._multi and number == signal.SIGTERM:
                continue   # JAX's runtime listens for it (the preemption sync point)
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number, frame) -> None:
        name = signal.Signals(number).name
        if self.signal_name is not None:
            print(f"{name}: already stopping at the next step boundary to save a checkpoint; let it finish",
                  file=sys.stderr, flush=True)
            return
        self.request(name)
        if self._multi:   # the sync point hears SIGTERM only
            os.kill(os.getpid(), signal.SIGTERM)

    def request(self, name: str = "request") -> None:
        if self.signal_name is None:
            self.signal_name = name
            print(f"{name}: stopping at the next step boundary to save a checkpoint", file=sys.stderr, flush=True)

    def reached(self, step: int) -> bool:
        """Whether the loop stops after `step` (every process gets the same answer at the same step)."""
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "SIGTERM"
                print(f"{self.signal_name}: every process stops after step {step} to save a checkpoint",
                      file=sys.stderr, flush=True)
                return True
            return False
        return self.signal_name is not None
