"""The run history the pages read (runners.history.RunHistory at its default path:
$PLANNER_DATA_DIR or ./data), opened per call so a test's PLANNER_DATA_DIR is honoured."""

from __future__ import annotations

import sqlite3

from runners.history import RunHistory
from runners.history_errors import HistoryError


def recent_runs(limit: int = 500, status: str | None = None, model: str | None = None) -> tuple[list, str | None]:
    """(RunRecords newest first, None) or ([], why the history could not be read)."""
    try:
        return RunHistory().list_runs(limit=limit, status=status, model=model), None
    except HistoryError as error:  # already one line saying how to recover
        return [], str(error)
    except (sqlite3.Error, OSError, ValueError) as error:
        return [], f"the run history could not be read: {error}"
