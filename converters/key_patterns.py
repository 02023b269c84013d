"""Dotted key patterns with integer placeholders: `model.layers.{layer}.mlp.experts.{expert}.w1.weight`.

A placeholder stands for a non-negative integer written without leading zeros (as PyTorch names ModuleList
entries), so matching a key and formatting the values back gives the same key.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KeyPattern:
    text: str
    placeholders: tuple[str, ...] = field(init=False)
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        names: list[str] = []
        regex = []
        for literal, name, format_spec, conversion in string.Formatter().parse(self.text):
            regex.append(re.escape(literal))
            if name is None:
                continue
            if not name.isidentifier() or format_spec or conversion:
                raise ValueError(f"Placeholder {{{name}}} in key pattern {self.text!r} must be a bare name like {{layer}}.")
            if name in names:
                raise ValueError(f"Placeholder {{{name}}} appears twice in key pattern {self.text!r}.")
            names.append(name)
            regex.append(f"(?P<{name}>0|[1-9][0-9]*)")
        object.__setattr__(self, "placeholders", tuple(names))
        object.__setattr__(self, "_regex", re.compile("".join(regex)))

    def match(self, key: str) -> dict[str, int] | None:
        """`{placeholder: value}` when `key` is an instance of the pattern, else None."""
        found = self._regex.fullmatch(key)
        return None if found is None else {name: int(value) for name, value in found.groupdict().items()}

    def format(self, **values: int) -> str:
        missing = set(self.placeholders) - set(values)
        if missing:
            raise KeyError(f"Key pattern {self.text!r} needs values for {sorted(missing)}.")
        return self.text.format(**{name: values[name] for name in self.placeholders})

    def bind(self, **values: int) -> KeyPattern:
        """The pattern with some placeholders replaced by values: `bind(layer=1)` keeps `{expert}` open."""
        kept = {name: "{" + name + "}" for name in self.placeholders if name not in values}
        return KeyPattern(self.text.format(**kept, **{k: v for k, v in values.items() if k in self.placeholders}))

    def __str__(self) -> str:
        return self.text


def natural_key(key: str) -> list[tuple[int, int | str]]:
    """Sort key ordering `layers.2` before `layers.10`."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in key.split(".")]
