"""The run history: one SQLite row per verification run (scenario, estimate, measurement).

Stdlib only (sqlite3, json), so a runner subprocess can record a run without importing
torch or the planner. The database lives in the data directory: `$PLANNER_DATA_DIR` when
set, else `<project root>/data`; file `runs.sqlite3`, created on first use.

Durability ("nothing completed is ever lost"):
- WAL journal: readers never block the writer, and a process killed mid-write (SIGKILL,
  OOM killer) leaves the database intact; the next opener rolls back the torn write.
- `synchronous=FULL`: in WAL mode NORMAL survives a process crash but may drop the last
  commits on power loss or an OS crash, because the WAL is only fsynced at checkpoints.
  FULL fsyncs the WAL at every commit, so a run that `finish_run` reported as recorded
  stays recorded. A run writes two rows' worth of commits, so the cost is negligible.
- A busy timeout: concurrent writers (parallel runner processes) wait for the lock
  rather than fail with "database is locked".
- Every write is one short autocommit statement (or one `BEGIN IMMEDIATE` transaction
  for a migration); a connection is opened per operation, so a `RunHistory` may be
  shared by threads and handed to subprocesses (it holds only a path).

Schema versions: `PRAGMA user_version` is the number of migrations applied. MIGRATIONS[i]
takes the database from version i to i+1; to change the schema, append one function,
never edit a released one. A database newer than this code is refused, not guessed at.

Runs never stay `running` for ever: each unfinished run records its owner, the process
that started it (runners.process_identity: host, boot, pid and start time), and every
open of the history marks the unfinished runs whose owner is gone as `killed`, with the
reason (the owner was killed by a signal, e.g. SIGKILL or the out-of-memory killer, or
crashed, before it could record an outcome). Runs without an owner (recorded before
schema version 2) are marked so once a day old; `mark_stale_running_as_failed` lets a
caller decide sooner.

Faults: every operation raises runners.history_errors.HistoryError, one line saying what
is wrong and how to recover, for a garbage, damaged, read-only, newer-schema or deleted
database, a database path that is a folder, or a data directory that is a file. A
database deleted while a run goes is not silently re-created empty under it: only
opening a RunHistory creates the file.

Known limitations: JSON columns hold whatever dict the caller passes; their inner
structure is the runners' contract, not this store's. A run owned by another host's
process is never marked (its liveness cannot be checked from here).
"""

from __future__ import annotations

import enum
import json
import os
import sqlite3
import time
import uuid
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

from runners.history_errors import HistoryError, translated
from runners.process_identity import ProcessIdentity, current, is_alive

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR_ENV = "PLANNER_DATA_DIR"
DB_FILENAME = "runs.sqlite3"
BUSY_TIMEOUT_S = 30.0  # a writer holds the lock for one statement: milliseconds
OWNERLESS_STALE_AFTER = timedelta(days=1)  # see mark_runs_of_dead_owners


class RunStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    OK = "ok"
    OOM = "oom"  # the scenario did not fit: a valid answer, not a runner failure
    TIMEOUT = "timeout"
    KILLED = "killed"  # stopped by the user or a signal (also: its owner found gone, mark_runs_of_dead_owners)
    FAILED = "failed"  # the runner crashed (or an ownerless run was found stale: mark_stale_running_as_failed)
    REFUSED = "refused"  # not started: e.g. the plan exceeds the device, or the mode is unavailable

    @property
    def is_terminal(self) -> bool:
        return self not in (RunStatus.QUEUED, RunStatus.RUNNING)


class RunMode(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"
    SIMULATE = "simulate"  # FakeTensorMode: bookkeeping without allocation


def _parse_enum(kind: type[enum.Enum], value: object, what: str) -> enum.Enum:
    if isinstance(value, kind):
        return value
    for member in kind:
        if member.value == value:
            return member
    choices = ", ".join(m.value for m in kind)
    raise ValueError(f"unknown {what} {value!r}: choose one of {choices}")


@dataclass(frozen=True)
class RunRecord:
    id: str  # uuid4 hex
    model_name: str
    mode: RunMode
    status: RunStatus
    created_at: datetime  # UTC, timezone-aware
    finished_at: datetime | None  # None exactly while the run is queued or running
    scenario: dict
    estimate: dict
    measurement: dict | None
    environment: dict | None
    reason: str | None  # why it failed, was refused or killed; free text

    def __post_init__(self):
        if (self.finished_at is None) == self.status.is_terminal:
            raise ValueError(f"run {self.id}: status {self.status.value} with finished_at={self.finished_at}")


def data_dir() -> Path:
    """The planner's data directory: `$PLANNER_DATA_DIR`, else `<project root>/data`; read at
    call time. The run history and the stored uploads (runners.config_store) live here."""
    configured = os.environ.get(DATA_DIR_ENV, "").strip()
    return Path(configured).expanduser() if configured else PROJECT_ROOT / "data"


def default_db_path() -> Path:
    """`$PLANNER_DATA_DIR/runs.sqlite3`, else `<project root>/data/runs.sqlite3`; read at call time."""
    return data_dir() / DB_FILENAME


# --- schema -------------------------------------------------------------------------------

def _migrate_0_to_1(con: sqlite3.Connection) -> None:
    # The status CHECK is spelled out, not derived from RunStatus: a migration is frozen
    # once released, and a new status needs a table-rebuild migration of its own.
    con.execute("""
        CREATE TABLE runs (
            id               TEXT PRIMARY KEY,
            created_at       TEXT NOT NULL,
            finished_at      TEXT,
            status           TEXT NOT NULL CHECK (status IN
                ('queued', 'running', 'ok', 'oom', 'timeout', 'killed', 'failed', 'refused')),
            mode             TEXT NOT NULL,
            model_name       TEXT NOT NULL,
            scenario_json    TEXT NOT NULL,
            estimate_json    TEXT NOT NULL,
            measurement_json TEXT,
            environment_json TEXT,
            reason           TEXT
        )""")
    con.execute("CREATE INDEX runs_by_created ON runs (created_at)")
    con.execute("CREATE INDEX runs_by_status ON runs (status)")


def _migrate_1_to_2(con: sqlite3.Connection) -> None:
    # owner: runners.process_identity token of the process that started the run; NULL
    # for runs recorded before (their owner is unknown, see mark_stale_running_as_failed).
    con.execute("ALTER TABLE runs ADD COLUMN owner TEXT")


# MIGRATIONS[i] takes user_version i to i + 1, inside the caller's transaction.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migrate_0_to_1, _migrate_1_to_2)


def _now() -> str:
    # Fixed width (microseconds, +00:00), so text order is time order in SQL.
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _to_json(value: dict | None, what: str, nullable: bool) -> str | None:
    if value is None:
        if nullable:
            return None
        raise ValueError(f"{what} is required: pass a dict")
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a dict, got {type(value).__name__}")
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable ({exc}): pass plain numbers, strings, lists, dicts") \
            from None


def _from_json(text: str | None) -> dict | None:
    return None if text is None else json.loads(text)


def _record(row: sqlite3.Row) -> RunRecord:
    return RunRecord(
        id=row["id"], model_name=row["model_name"], mode=RunMode(row["mode"]), status=RunStatus(row["status"]),
        created_at=datetime.fromisoformat(row["created_at"]),
        finished_at=None if row["finished_at"] is None else datetime.fromisoformat(row["finished_at"]),
        scenario=_from_json(row["scenario_json"]), estimate=_from_json(row["estimate_json"]),
        measurement=_from_json(row["measurement_json"]), environment=_from_json(row["environment_json"]),
        reason=row["reason"])


class RunHistory:
    """The run store at `path` (default: `default_db_path()`), created and migrated on open."""

    def __init__(self, path: str | os.PathLike | None = None):
        """Open (creating and migrating) the store, then mark the runs whose owner is gone.
        Raises HistoryError (one line) for any fault of the database or its folder."""
        self.path = Path(path) if path is not None else default_db_path()
        with translated(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._open_and_migrate()
        self.mark_runs_of_dead_owners()

    # Connections: one per operation (sqlite3 objects must not cross threads, and a
    # fresh connection after fork is the only safe kind). Autocommit mode
    # (isolation_level=None): each statement is its own transaction unless we BEGIN.
    # Only the opener may create the file (mode=rwc): a database deleted while in use is
    # an error, not a new empty file without tables under a run that is still going.
    def _connect(self, create: bool = False) -> sqlite3.Connection:
        uri = f"{self.path.absolute().as_uri()}?mode={'rwc' if create else 'rw'}"
        con = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        con.row_factory = sqlite3.Row
        con.execute("PRAGMA synchronous=FULL")  # per connection; why: module docstring
        return con

    def _open_and_migrate(self) -> None:
        with closing(self._connect(create=True)) as con:
            self._ensure_wal(con)
            version = con.execute("PRAGMA user_version").fetchone()[0]
            self._refuse_newer(version)
            if version == len(MIGRATIONS):
                return
            # BEGIN IMMEDIATE takes the write lock first, so two openers cannot both
            # migrate; the version is re-read under the lock.
            con.execute("BEGIN IMMEDIATE")
            try:
                version = con.execute("PRAGMA user_version").fetchone()[0]
                self._refuse_newer(version)
                for target in range(version + 1, len(MIGRATIONS) + 1):
                    MIGRATIONS[target - 1](con)
                    con.execute(f"PRAGMA user_version = {target:d}")
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise

    def _refuse_newer(self, version: int) -> None:
        if version > len(MIGRATIONS):
            raise HistoryError(f"the run history {self.path} has schema version {version}, newer than this code's "
                               f"({len(MIGRATIONS)}): update the planner, or set {DATA_DIR_ENV} to another folder")

    def _ensure_wal(self, con: sqlite3.Connection) -> None:
        # journal_mode is stored in the file, so this matters once per database. The
        # switch needs the file to ourselves, and SQLite answers SQLITE_BUSY at once,
        # without the busy handler, while another process is opening the same new file
        # (seen: 16 processes creating one database together): retry until the timeout.
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        delay_s = 0.001
        while True:
            try:
                if con.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
                    return
                mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower()
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                    raise
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 0.05)
                continue
            if mode != "wal":
                raise HistoryError(f"{self.path}: cannot switch to WAL journal (got {mode!r}); "
                                   f"put the data directory on a local filesystem")
            return

    def schema_version(self) -> int:
        with translated(self.path), closing(self._connect()) as con:
            return con.execute("PRAGMA user_version").fetchone()[0]

    # --- writes: each one short autocommit statement --------------------------------------

    def start_run(self, model_name: str, mode: RunMode | str, scenario: dict, estimate: dict) -> str:
        """Record a run as RUNNING now; returns its id (uuid4 hex)."""
        if not isinstance(model_name, str) or not model_name.strip():
            raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
        mode = _parse_enum(RunMode, mode, "run mode")
        scenario_json = _to_json(scenario, "scenario", nullable=False)
        estimate_json = _to_json(estimate, "estimate", nullable=False)
        run_id = uuid.uuid4().hex
        with translated(self.path), closing(self._connect()) as con:
            con.execute(
                "INSERT INTO runs (id, created_at, status, mode, model_name, scenario_json, estimate_json, owner) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, _now(), RunStatus.RUNNING.value, mode.value, model_name, scenario_json, estimate_json,
                 current().token()))
        return run_id

    def finish_run(self, run_id: str, status: RunStatus | str, measurement: dict | None = None,
                   environment: dict | None = None, reason: str | None = None) -> None:
        """Close an unfinished run with a terminal status. Once this returns, the row is on disk."""
        status = _parse_enum(RunStatus, status, "run status")
        if not status.is_terminal:
            raise ValueError(f"finish_run needs a terminal status, got {status.value!r}: "
                             f"choose one of {', '.join(s.value for s in RunStatus if s.is_terminal)}")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"reason must be a string or None, got {type(reason).__name__}")
        measurement_json = _to_json(measurement, "measurement", nullable=True)
        environment_json = _to_json(environment, "environment", nullable=True)
        with translated(self.path), closing(self._connect()) as con:
            # The status guard makes the update atomic with its precondition: a run
            # cannot be finished twice, even by two racing processes.
            cur = con.execute(
                "UPDATE runs SET status = ?, finished_at = ?, measurement_json = ?, environment_json = ?, "
                "reason = ? WHERE id = ? AND status IN ('queued', 'running')",
                (status.value, _now(), measurement_json, environment_json, reason, run_id))
            if cur.rowcount == 1:
                return
            row = con.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(f"no run with id {run_id!r} in {self.path}")
        raise ValueError(f"run {run_id} is already finished (status {row['status']!r}); a run is finished once")

    def mark_stale_running_as_failed(self, reason: str, created_before: datetime | None = None) -> int:
        """Fail every queued or running run (created before `created_before`, if given): runs
        a killed process left open. Call when no runner is alive. Returns how many."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError("reason must be a non-empty string saying why the runs are marked failed")
        sql = ("UPDATE runs SET status = ?, finished_at = ?, reason = ? "
               "WHERE status IN ('queued', 'running')")
        params: list = [RunStatus.FAILED.value, _now(), reason]
        if created_before is not None:
            if created_before.tzinfo is None:
                raise ValueError("created_before must be timezone-aware (UTC)")
            sql += " AND created_at < ?"
            params.append(created_before.astimezone(timezone.utc).isoformat(timespec="microseconds"))
        with translated(self.path), closing(self._connect()) as con:
            return con.execute(sql, params).rowcount

    def mark_runs_of_dead_owners(self) -> int:
        """Mark `killed`, with the reason, every unfinished run whose owner process is gone
        (module docstring). Returns how many; runs of live or unknown owners stay as they are."""
        with translated(self.path), closing(self._connect()) as con:
            rows = con.execute("SELECT id, owner FROM runs WHERE status IN ('queued', 'running') "
                               "AND owner IS NOT NULL").fetchall()
            marked = 0
            for row in rows:
                owner = ProcessIdentity.from_token(row["owner"])
                if owner is None or is_alive(owner) is not False:
                    continue
                reason = (f"its process (pid {owner.pid}) ended without recording an outcome: killed by a signal "
                          "(SIGKILL, the out-of-memory killer) or crashed; marked when the run history was next "
                          "opened")
                # Guarded by status and owner: a run its owner finished meanwhile stays as recorded.
                marked += con.execute(
                    "UPDATE runs SET status = ?, finished_at = ?, reason = ? "
                    "WHERE id = ? AND owner = ? AND status IN ('queued', 'running')",
                    (RunStatus.KILLED.value, _now(), reason, row["id"], row["owner"])).rowcount
            # Runs recorded before owners were (schema version 1) cannot be checked; one still
            # unfinished a day on is past any time limit the dashboard or the CLI's default sets.
            cutoff = (datetime.now(timezone.utc) - OWNERLESS_STALE_AFTER).isoformat(timespec="microseconds")
            marked += con.execute(
                "UPDATE runs SET status = ?, finished_at = ?, reason = ? "
                "WHERE owner IS NULL AND status IN ('queued', 'running') AND created_at < ?",
                (RunStatus.KILLED.value, _now(), "recorded before run owners were tracked and still unfinished a "
                 "day later: its process is gone; marked when the run history was next opened", cutoff)).rowcount
            return marked

    # --- reads ---------------------------------------------------------------------------

    def get(self, run_id: str) -> RunRecord | None:
        with translated(self.path), closing(self._connect()) as con:
            row = con.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else _record(row)

    def list_runs(self, limit: int | None = 100, status: RunStatus | str | None = None,
                  model: str | None = None) -> list[RunRecord]:
        """Newest first (creation time; insertion order breaks ties). `limit=None`: all."""
        where, params = [], []
        if status is not None:
            where.append("status = ?")
            params.append(_parse_enum(RunStatus, status, "run status").value)
        if model is not None:
            where.append("model_name = ?")
            params.append(model)
        sql = "SELECT * FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, rowid DESC"
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
            sql += " LIMIT ?"
            params.append(limit)
        with translated(self.path), closing(self._connect()) as con:
            return [_record(row) for row in con.execute(sql, params)]

    def integrity_ok(self) -> bool:
        """PRAGMA integrity_check says exactly "ok" (a file too damaged to read is not ok)."""
        try:
            with closing(self._connect()) as con:
                rows = con.execute("PRAGMA integrity_check").fetchall()
        except (sqlite3.DatabaseError, OSError):
            return False
        return [tuple(r) for r in rows] == [("ok",)]
