"""Reading a model family's HF `config.json` into a frozen dataclass, and writing it back.

A family's config dataclass lists the fields its model reads, with HF's defaults, and inherits this
mixin: `from_dict` keeps the known fields (tuples for lists, HF `attribute_map` aliases resolved) and the
whole original dict in `raw`; `to_dict` gives `raw` updated with the fields, so a saved `config.json`
keeps everything the checkpoint had.
"""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar


class HFConfigMixin:
    """Mixin of the family config dataclasses (which declare `raw: dict` as their last field)."""

    model_type: ClassVar[str]
    # config.json key -> field name (HF's attribute_map), e.g. {"num_local_experts": "num_experts"}.
    attribute_map: ClassVar[dict[str, str]] = {}

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"raw"}

    @classmethod
    def from_dict(cls, values: dict):
        known = cls.field_names()
        kwargs = {}
        for key, value in values.items():
            name = cls.attribute_map.get(key, key)
            if name not in known:
                continue
            if name in kwargs and kwargs[name] != value:
                raise ValueError(
                    f"config.json gives {name}={kwargs[name]} and its alias {key}={value}, which disagree; "
                    "keep one of them (HF's attribute_map makes them the same setting)."
                )
            kwargs[name] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs, raw=dict(values))

    def to_dict(self) -> dict:
        values = {}
        for name in self.field_names():
            value = getattr(self, name)
            values[name] = list(value) if isinstance(value, tuple) else value
        return {**self.raw, **values, "model_type": self.model_type}
