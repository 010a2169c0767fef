"""A run's outcome that the run history cannot store (its database deleted, replaced,
damaged or made read-only while the run went) is kept in a JSON file beside the database,
`<data dir>/unrecorded-runs/<run id>.json`, and reported, never dropped.

`finish_or_keep` is what the runners call to close a run: RunHistory.finish_run, and on a
HistoryError (or a row that is no longer there) the file. The file holds everything the
row would have held (model, mode, scenario, estimate, outcome), so the run can be read or
re-imported without the database. Stdlib only.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from runners.history import RunHistory, RunStatus
from runners.history_errors import HistoryError

FOLDER = "unrecorded-runs"


def unrecorded_path(db_path: Path, run_id: str) -> Path:
    return db_path.parent / FOLDER / f"{run_id}.json"


def keep_unrecorded(db_path: Path, run_id: str, record: dict) -> Path:
    """Write `record` to the run's file beside the database (its folder re-created if it
    was deleted), atomically and on disk when this returns. Raises OSError if it cannot."""
    target = unrecorded_path(db_path, run_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".json.partial")
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2, sort_keys=True, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, target)  # a reader never sees half a file
    return target


def finish_or_keep(history: RunHistory, run_id: str, status: RunStatus | str, started: dict, *,
                   measurement: dict | None = None, environment: dict | None = None,
                   reason: str | None = None) -> dict | None:
    """Close the run in `history`; None once recorded. When the history cannot store it,
    the outcome (with `started`: model_name, mode, scenario, estimate) goes to the file
    beside the database and the answer is {"error": why, "kept_in": path or None}
    ("kept_in" None when even the file could not be written: the caller's output is then
    the only copy). ValueError (a measurement that is not JSON) is the caller's to handle."""
    try:
        history.finish_run(run_id, status, measurement=measurement, environment=environment, reason=reason)
        return None
    except (HistoryError, KeyError) as error:
        why = str(error) if isinstance(error, HistoryError) else \
            f"the run history {history.path} no longer holds this run (it was replaced while in use)"
    status_value = status.value if isinstance(status, RunStatus) else str(status)
    record = {**started, "run_id": run_id, "status": status_value, "measurement": measurement,
              "environment": environment, "reason": reason, "history": str(history.path), "not_recorded_because": why,
              "finished_at": datetime.now(timezone.utc).isoformat(timespec="microseconds")}
    try:
        kept = keep_unrecorded(history.path, run_id, record)
    except OSError as error:
        return {"error": f"{why}; the result could not be kept in a file either ({error.strerror or error})",
                "kept_in": None}
    return {"error": why, "kept_in": str(kept)}


def unrecorded_note(result: dict) -> str | None:
    """One line for a verify result whose outcome the history did not take; None when it did."""
    unrecorded = result.get("unrecorded")
    if not unrecorded:
        return None
    where = f"kept in {unrecorded['kept_in']}" if unrecorded["kept_in"] else "only in this output"
    return f"run {result.get('run_id')} was not recorded ({unrecorded['error']}); its result is {where}"
