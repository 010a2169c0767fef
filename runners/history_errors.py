"""Faults of the run history's database, as one line each: what is wrong and how to recover.

`HistoryError` is what every RunHistory operation raises for a fault of the database or
its folder (a garbage, read-only, newer-schema or deleted database, a database path that
is a folder, a data directory that is a file, a full disk); `translated(path)` turns the
sqlite3 and OS errors of a block into one. Stdlib only, like runners.history.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from contextlib import contextmanager
from pathlib import Path

DATA_DIR_ENV = "PLANNER_DATA_DIR"
_ELSEWHERE = f"or set {DATA_DIR_ENV} to another folder"


class HistoryError(Exception):
    """The run history cannot be used; the message is one line saying why and what to do."""


def _first_file_on_the_way(path: Path) -> Path | None:
    """The first existing ancestor of `path` that is not a directory (a data "directory" that is a file)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def describe(error: BaseException, path: Path) -> HistoryError:
    """One line for `error`, raised while using the database at `path`."""
    if isinstance(error, HistoryError):
        return error
    blocker = _first_file_on_the_way(path)
    if blocker is not None:
        return HistoryError(f"the run history's folder {blocker} is a file, not a folder: move it aside "
                            f"{_ELSEWHERE}")
    if path.is_dir():
        return HistoryError(f"the run history {path} is a folder, not a database file: move it aside {_ELSEWHERE}")
    text = str(error)
    if isinstance(error, sqlite3.DatabaseError):
        code = getattr(error, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_NOTADB or "file is not a database" in text:
            return HistoryError(f"the run history {path} is not a SQLite database (damaged, or another file): "
                                f"move it aside (e.g. `mv {path} {path}.bad`) {_ELSEWHERE}; a new one is created")
        if code == sqlite3.SQLITE_CORRUPT or "malformed" in text:
            return HistoryError(f"the run history {path} is damaged ({text}): recover it with "
                                f"`sqlite3 {path} .recover`, or move it aside {_ELSEWHERE}")
        # A read-only WAL database cannot even be opened (SQLite must write its -shm file).
        unwritable = path.exists() and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK))
        if code == sqlite3.SQLITE_READONLY or "readonly" in text or unwritable:
            return HistoryError(f"the run history {path} is read-only: make it and its folder writable "
                                f"(`chmod u+w`) {_ELSEWHERE}")
        if code == sqlite3.SQLITE_FULL or "full" in text:
            return HistoryError(f"the disk holding the run history {path} is full: free some space {_ELSEWHERE}")
        if "no such table" in text or "no such column" in text:
            return HistoryError(f"the run history {path} lost its tables (it was deleted or replaced while in use): "
                                f"the next run creates a new one; restore it from a copy {_ELSEWHERE}")
        if not path.exists():
            return HistoryError(f"the run history {path} was deleted while in use: the next run creates a new one")
        if code == sqlite3.SQLITE_CANTOPEN or "unable to open" in text:
            return HistoryError(f"the run history {path} cannot be opened ({text}): check that its folder "
                                f"exists and is writable, {_ELSEWHERE}")
        return HistoryError(f"the run history {path} failed: {text}: move it aside {_ELSEWHERE}")
    if isinstance(error, OSError):
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return HistoryError(f"the run history's folder {path.parent} is not writable ({os.strerror(error.errno)}): "
                                f"fix its permissions {_ELSEWHERE}")
        if error.errno == errno.ENOSPC:
            return HistoryError(f"the disk holding the run history {path} is full: free some space {_ELSEWHERE}")
        return HistoryError(f"the run history {path} cannot be used ({error.strerror or error}): {_ELSEWHERE}")
    return HistoryError(f"the run history {path} failed ({type(error).__name__}: {text}): {_ELSEWHERE}")


@contextmanager
def translated(path: Path):
    """Inside the block, database and OS errors become one HistoryError line."""
    try:
        yield
    except (sqlite3.Error, OSError) as error:
        raise describe(error, path) from error
