"""Who holds the temporary memory at a compiled program's peak, from XLA's live-range dump.

    peak = peak_holders(Path(dump_dir, "...cpu_after_optimizations-live-range.txt").read_text())
    peak.forward, peak.backward, peak.other     # bytes live at the peak, by the pass that produced them

XLA's buffer assignment writes, for the moment of peak memory, the bytes then live grouped by the JAX operation
that produced them ("Stack trace breakdown for peak usage"): a tree whose first level's totals add up to the
peak (a loop's buffers sit under the loop). The step's arguments (`state...`: parameters and optimizer state,
counted from their shardings elsewhere) are left out. An operation under `transpose(`
belongs to the backward pass, one under `jvp(` (and not transpose) to the forward pass: forward bytes still
live at the peak are the activations kept for the backward pass; backward bytes are gradients and their partial
sums; the rest (the optimizer update, copies, the batch, the loss) are other temporaries. Buffers named in
`widened` (XLA:CPU's float32 copies of bfloat16 values, which GPU and TPU backends do not make) are counted
apart, as `widened`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BREAKDOWN = re.compile(r"Stack trace breakdown for peak usage: (?P<total>[\d ]+) bytes")
# A first-level entry: six spaces, a branch, the op name, then its numbers.
_ARGUMENT = re.compile(r"state\b")      # the train step's argument is named `state` (a TrainState)
_ENTRY = re.compile(r"^ {6}[├└]── (?P<name>.*) \((?P<share>[\d.]+)%, total: (?P<total>[\d ]+) bytes, "
                    r"current: (?P<current>[\d ]+) bytes")


@dataclass(frozen=True)
class PeakHolders:
    forward: int
    backward: int
    other: int
    widened: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.other + self.widened


def _number(text: str) -> int:
    return int(text.replace(" ", ""))


def pass_of(op_name: str) -> str:
    """"backward", "forward" or "other" for the op name of a live buffer."""
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "other"


def peak_holders(live_range_text: str, widened: frozenset[str] = frozenset()) -> PeakHolders | None:
    """The peak's bytes by pass, or None when the dump has no breakdown. widened: instruction names of
    XLA:CPU's widening converts."""
    start = _BREAKDOWN.search(live_range_text)
    if start is None:
        return None
    sums = {"forward": 0, "backward": 0, "other": 0, "widened": 0}
    for line in live_range_text[start.end():].splitlines():
        match = _ENTRY.match(line)
        if match is None or _ARGUMENT.match(match["name"]):
            continue
        holder = "widened" if match["name"] in widened else pass_of(match["name"])
        sums[holder] += _number(match["total"])
    return PeakHolders(**sums)
