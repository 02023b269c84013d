"""EP implementations that cannot run on the planned hardware, left out of the enumeration with one line.

    unreachable_implementations("h100")     # {"deepgemm_megamoe": "runs only on an SM100 GPU (b200)"}

A layout with such an implementation is not a choice the user has on that hardware: listed per layout it
would bury the excluded layouts that are choices. The planner names each one left out once, with the count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareRequirement:
    needs: str                                  # what the implementation runs on, in words
    runs_on: Callable[[str], bool]              # hardware profile name -> whether it can


SM100_PROFILES = frozenset({"b200"})

# EP implementation -> the hardware it needs (implementations not named run anywhere moe_jax runs)
IMPLEMENTATION_HARDWARE: dict[str, HardwareRequirement] = {
    "deepgemm_megamoe": HardwareRequirement("an SM100 GPU (b200)", lambda hardware: hardware in SM100_PROFILES),
}


def unreachable_implementations(hardware: str) -> dict[str, str]:
    """EP implementation -> what it needs, for each that cannot run on the `hardware` profile."""
    return {name: requirement.needs for name, requirement in IMPLEMENTATION_HARDWARE.items()
            if not requirement.runs_on(hardware)}
