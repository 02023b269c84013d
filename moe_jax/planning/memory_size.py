"""Memory sizes as people write them: `80GiB` (2^30 bytes), `80GB` (10^9 bytes), `512MiB`, `1.5TB`, `1e9`.

    parse_memory_size("80GiB")    # 85899345920
    parse_memory_size("80GB")     # 80000000000
    describe_memory_size("80GB")  # '80GB = 80 x 10^9 bytes (74.5 GiB)'
"""

from __future__ import annotations

import re

# Unit -> bytes: binary units are powers of 2^10, decimal ones powers of 10^3 (as drive and GPU vendors count).
UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


def parse_memory_size(text: str) -> int:
    """Bytes of a size such as `80GiB` or `80GB` (GB = 10^9 bytes, GiB = 2^30); a bare number is bytes."""
    match = _SIZE.match(str(text))
    unit = match["unit"].lower() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(f"memory size {text!r} is not a number with a unit: write e.g. 80GiB (80 x 2^30 bytes) or "
                         f"80GB (80 x 10^9 bytes); units: {', '.join(u for u in UNITS if u)} (any case).")
    size = float(match["number"]) * UNITS[unit]
    if size <= 0:
        raise ValueError(f"memory size {text!r} must be more than 0 bytes.")
    return int(size)


def describe_memory_size(text: str) -> str:
    """How `text` was read: '80GB = 80 x 10^9 bytes (74.5 GiB)'."""
    size = parse_memory_size(text)
    unit = _SIZE.match(str(text))["unit"].lower()
    base = {"k": 1, "m": 2, "g": 3, "t": 4}.get(unit[:1], 0)
    if unit.endswith("ib"):
        return f"{text.strip()} = {size / UNITS[unit]:g} x 2^{10 * base} bytes ({size / 10**9:.1f} GB)"
    if base:
        return f"{text.strip()} = {size / UNITS[unit]:g} x 10^{3 * base} bytes ({size / 2**30:.1f} GiB)"
    return f"{size} bytes ({size / 2**30:.1f} GiB)"
