"""Which layouts to compile first, and which the default budget must compile before it may stop.

    order, floor = compile_order(candidates, guesses, states)

`order`: the likely winners first, by the analytic guess (`analytic`), less state breaking ties. `floor`: the
layouts an answer has to rest on: the `TOP_GUESSES` best guesses, and the best-guessed layout of every family
(each ep size, each pp size, tp or not, HSDP or not, each cp size) so that a family the guess misjudges is still seen.
The floor comes first in `order`, in guess order.
"""

from __future__ import annotations

from collections.abc import Callable

from .layouts import Candidate, Layout

TOP_GUESSES = 12

# family name -> the value a layout has in it: the floor holds one layout of every value that occurs
LAYOUT_FAMILIES: dict[str, Callable[[Layout], object]] = {
    "ep size": lambda layout: layout.ep,
    "pp size": lambda layout: layout.pp,
    "tp or fsdp": lambda layout: layout.tp > 1,
    "HSDP": lambda layout: layout.dp_replicate > 1,
    "cp size": lambda layout: layout.cp,
}


def compile_order(candidates: list[Candidate], guesses: dict[int, float], states: dict[int, int],
                  top: int = TOP_GUESSES) -> tuple[list[Candidate], list[Candidate]]:
    """(every candidate in compile order, the floor: its first members). guesses / states: by `id(candidate)`,
    the analytic seconds and the state bytes one device holds."""
    ranked = sorted(candidates, key=lambda c: (guesses[id(c)], states[id(c)]))
    floor = ranked[:top]
    for family in LAYOUT_FAMILIES.values():
        seen = {family(candidate.layout) for candidate in floor}
        for candidate in ranked:
            value = family(candidate.layout)
            if value not in seen:
                floor.append(candidate)
                seen.add(value)
    chosen = {id(candidate) for candidate in floor}
    floor = [candidate for candidate in ranked if id(candidate) in chosen]
    return floor + [candidate for candidate in ranked if id(candidate) not in chosen], floor
