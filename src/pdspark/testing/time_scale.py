"""One factor for every time bound of the tests: `PDSPARK_TEST_TIME_SCALE` (default 1).

A bound in a test states how long something may take on an idle 2-core machine; a machine that is slower or shared
with other work sets the factor (e.g. 3) instead of each test growing its own slack."""

from __future__ import annotations

import functools
import math
import os

ENV = "PDSPARK_TEST_TIME_SCALE"


@functools.cache
def time_scale() -> float:
    raw = os.environ.get(ENV, "1")
    try:
        factor = float(raw)
    except ValueError:
        factor = math.nan
    if not (1.0 <= factor < math.inf):
        raise ValueError(f"{ENV} must be a number >= 1 (how many times slower than an idle 2-core machine this one "
                         f"may be), not {raw!r}")
    return factor


def scaled(seconds: float) -> float:
    """`seconds` on this machine: the bound times the suite's factor."""
    return seconds * time_scale()
