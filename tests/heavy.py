"""Parametrized grids split into the suite's representative cases and the rest, which are marked `heavy`:
deselected unless pytest runs with --heavy (scripts/run_heavy_tests.sh runs only them)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

HEAVY = pytest.mark.heavy


def representative(cases: Iterable, suite: Sequence[str], ids: Sequence[str] | None = None) -> list:
    """`cases` as pytest params named by `ids` (or by the cases themselves); those not named in `suite` are heavy.

    A case of several arguments is a tuple (the parametrize names are several)."""
    cases = list(cases)
    ids = [str(case) for case in cases] if ids is None else list(ids)
    unknown = set(suite) - set(ids)
    assert not unknown, f"suite cases {sorted(unknown)} are not among {ids}"
    params = []
    for case, name in zip(cases, ids, strict=True):
        values = case if isinstance(case, tuple) else (case,)
        params.append(pytest.param(*values, id=name, marks=() if name in suite else HEAVY))
    return params
