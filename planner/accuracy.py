"""How far an estimate is from a measurement: the one error figure that verification runs
record (runners.verify) and the pages and reports print beside them.

(estimated - measured) / measured * 100, rounded to 0.001: positive means the planner
over-estimates. None where either side is missing, or the measurement is zero while the
estimate is not (no finite percentage says how wrong that is).
"""

from __future__ import annotations


def error_pct(estimated: int | None, measured: int | None) -> float | None:
    if estimated is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if estimated == 0 else None
    return round((estimated - measured) / measured * 100.0, 3)
