"""Several processes, one engine: process 0 leads (requests arrive there) and sends each step's inputs to the
others, which run the same program on them until released.

Every message is a broadcast from process 0 (`broadcast_one_to_all`): first a header [code, rows, columns,
tokens] (which program, the packed inputs' shape), then, for a program, the packed (ints, floats). The followers
wait in that collective; an idle leader sends IDLE_CODE now and then so the wait never times out.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all

from .step_inputs import FLOAT_COLUMNS

PROGRAM_CODES = {"prefill": 0, "decode": 1, "mixed": 2, "verify": 3}
ROUTING_CODE = 16   # added to a program's code: its routing variant (`StepPrograms`)
STOP_CODE = -1
IDLE_CODE = -2   # nothing to run: keeps the followers' collective from timing out while the server waits


def check_leader() -> bool:
    """On the process that would lead -> whether there are followers to lead. Only process 0 leads."""
    if jax.process_count() > 1 and jax.process_index() != 0:
        raise RuntimeError("only process 0 leads; the other processes call follow().")
    return jax.process_count() > 1


def send_step(name: str, ints: np.ndarray, floats: np.ndarray, tokens: int, routing: bool = False) -> None:
    """Process 0: the followers run program `name` (with `routing`: its routing variant) on these packed inputs."""
    code = PROGRAM_CODES[name] + (ROUTING_CODE if routing else 0)
    broadcast_one_to_all(np.asarray([code, *ints.shape, tokens], np.int32))
    broadcast_one_to_all((ints, floats))


def send_idle() -> None:
    broadcast_one_to_all(np.asarray([IDLE_CODE, 0, 0, 0], np.int32))


def send_stop() -> None:
    broadcast_one_to_all(np.asarray([STOP_CODE, 0, 0, 0], np.int32))


def follow(execute: Callable[[str, np.ndarray, np.ndarray, int, bool], object]) -> int:
    """Processes other than 0: `execute(name, ints, floats, tokens, routing)` every step process 0 sends, until it sends
    STOP_CODE. Returns the steps run."""
    steps = 0
    names = {code: name for name, code in PROGRAM_CODES.items()}
    while True:
        code, rows, columns, tokens = (int(v) for v in broadcast_one_to_all(np.zeros(4, np.int32)))
        if code == STOP_CODE:
            return steps
        if code == IDLE_CODE:
            continue
        ints, floats = broadcast_one_to_all((np.zeros((rows, columns), np.int32), np.zeros((rows, FLOAT_COLUMNS), np.float32)))
        execute(names[code % ROUTING_CODE], np.asarray(ints), np.asarray(floats), tokens, code >= ROUTING_CODE)
        steps += 1
