"""The run-history store: round trips, ordering and filters, schema migrations, the data
directory, and durability under concurrent writer processes and a SIGKILLed writer."""

import json
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from runners import history
from runners.history import RunHistory, RunMode, RunRecord, RunStatus
from runners.history_errors import HistoryError
from runners.process_identity import ProcessIdentity, current, is_alive

SCENARIO = {"config": "distilbert-base-cased", "task": "sequence-classification", "batch_size": 8,
            "seq_len": 128, "optimizer": "adamw", "precision": "fp32"}
ESTIMATE = {"weights_bytes": 263132168, "gradients_bytes": 263132168, "optimizer_state_bytes": 526264752,
            "activations_bytes": 123456789, "peak_bytes": 1175985877}


@pytest.fixture
def store(tmp_path) -> RunHistory:
    return RunHistory(tmp_path / "runs.sqlite3")


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


# --- round trip and validation ---------------------------------------------------------------

def test_round_trip_of_one_run(store):
    run_id = store.start_run("distilbert-base-cased", "cpu", SCENARIO, ESTIMATE)
    assert len(run_id) == 32 and int(run_id, 16) >= 0

    running = store.get(run_id)
    assert running.status is RunStatus.RUNNING and running.mode is RunMode.CPU
    assert running.finished_at is None and running.measurement is None and running.reason is None
    assert running.scenario == SCENARIO and running.estimate == ESTIMATE
    assert running.created_at.tzinfo is not None and running.created_at.utcoffset() == timedelta(0)

    measurement = {"peak_bytes": 1180000000, "by_category": {"weights": 263132168, "activations": 120000000}}
    environment = {"torch": "2.13", "device": "cpu", "threads": 16}
    store.finish_run(run_id, RunStatus.OK, measurement=measurement, environment=environment)
    done = store.get(run_id)
    assert done == RunRecord(id=run_id, model_name="distilbert-base-cased", mode=RunMode.CPU, status=RunStatus.OK,
                             created_at=running.created_at, finished_at=done.finished_at, scenario=SCENARIO,
                             estimate=ESTIMATE, measurement=measurement, environment=environment, reason=None)
    assert done.finished_at >= done.created_at
    assert store.get("0" * 32) is None


def test_columns_hold_json_text_not_pickles(store):
    run_id = store.start_run("m", RunMode.SIMULATE, SCENARIO, ESTIMATE)
    store.finish_run(run_id, "oom", measurement=None, environment={"cuda": None}, reason="CUDA out of memory")
    with _raw(store.path) as con:
        row = con.execute("SELECT status, mode, scenario_json, environment_json, finished_at FROM runs").fetchone()
    assert row[0] == "oom" and row[1] == "simulate"
    assert json.loads(row[2]) == SCENARIO and json.loads(row[3]) == {"cuda": None}
    assert row[4].endswith("+00:00")  # UTC ISO-8601
    assert store.get(run_id).reason == "CUDA out of memory"


def test_bad_inputs_raise_one_line_errors(store):
    run_id = store.start_run("m", "cuda", SCENARIO, ESTIMATE)
    with pytest.raises(ValueError, match="unknown run status 'done'") as exc:
        store.finish_run(run_id, "done")
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="terminal status"):
        store.finish_run(run_id, RunStatus.RUNNING)
    with pytest.raises(KeyError, match="no run with id"):
        store.finish_run("f" * 32, RunStatus.OK)
    with pytest.raises(ValueError, match="unknown run mode 'tpu'"):
        store.start_run("m", "tpu", SCENARIO, ESTIMATE)
    with pytest.raises(ValueError, match="scenario must be a dict"):
        store.start_run("m", "cpu", [1, 2], ESTIMATE)
    with pytest.raises(ValueError, match="estimate is required"):
        store.start_run("m", "cpu", SCENARIO, None)
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        store.start_run("m", "cpu", SCENARIO, {"peak_bytes": float("nan")})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        store.finish_run(run_id, "ok", measurement={"when": object()})
    with pytest.raises(ValueError, match="unknown run status"):
        store.list_runs(status="running ")
    with pytest.raises(ValueError, match="limit"):
        store.list_runs(limit=0)
    # None of the rejected calls left a trace; the run is still open and can be finished once.
    assert [r.id for r in store.list_runs()] == [run_id]
    store.finish_run(run_id, "timeout", reason="step 2 exceeded 600 s")
    with pytest.raises(ValueError, match="already finished"):
        store.finish_run(run_id, "ok")
    assert store.get(run_id).status is RunStatus.TIMEOUT


def test_record_invariant_finished_at_matches_status():
    now = datetime.now(timezone.utc)
    with pytest.raises(ValueError):
        RunRecord(id="a", model_name="m", mode=RunMode.CPU, status=RunStatus.OK, created_at=now, finished_at=None,
                  scenario={}, estimate={}, measurement=None, environment=None, reason=None)
    with pytest.raises(ValueError):
        RunRecord(id="a", model_name="m", mode=RunMode.CPU, status=RunStatus.RUNNING, created_at=now,
                  finished_at=now, scenario={}, estimate={}, measurement=None, environment=None, reason=None)


# --- listing -----------------------------------------------------------------------------------

def test_list_runs_newest_first_with_filters(store):
    ids = []
    for i, (model, status) in enumerate([("a", "ok"), ("b", "oom"), ("a", "failed"), ("b", "ok"), ("a", "ok"),
                                         ("a", None)]):
        run_id = store.start_run(model, "cpu", {**SCENARIO, "i": i}, ESTIMATE)
        if status is not None:
            store.finish_run(run_id, status)
        ids.append(run_id)

    assert [r.id for r in store.list_runs()] == ids[::-1]
    assert [r.scenario["i"] for r in store.list_runs(limit=2)] == [5, 4]
    assert [r.id for r in store.list_runs(status=RunStatus.OK)] == [ids[4], ids[3], ids[0]]
    assert [r.id for r in store.list_runs(status="ok", model="a")] == [ids[4], ids[0]]
    assert [r.id for r in store.list_runs(model="b")] == [ids[3], ids[1]]
    assert [r.id for r in store.list_runs(status="running")] == [ids[5]]
    assert store.list_runs(model="nobody") == []
    assert len(store.list_runs(limit=None)) == 6
    created = [r.created_at for r in store.list_runs()]
    assert created == sorted(created, reverse=True)


def test_same_timestamp_keeps_insertion_order(store):
    ids = [store.start_run("m", "cpu", SCENARIO, ESTIMATE) for _ in range(3)]
    with _raw(store.path) as con:
        con.execute("UPDATE runs SET created_at = '2025-01-01T00:00:00.000000+00:00'")
    assert [r.id for r in store.list_runs()] == ids[::-1]


# --- stale runs -----------------------------------------------------------------------------------

def test_stale_running_runs_are_marked_failed(store):
    done = store.start_run("m", "cpu", SCENARIO, ESTIMATE)
    store.finish_run(done, "ok")
    old = store.start_run("m", "cuda", SCENARIO, ESTIMATE)
    with _raw(store.path) as con:  # an old run whose process died, and a queued one
        con.execute("UPDATE runs SET created_at = '2020-01-01T00:00:00.000000+00:00' WHERE id = ?", (old,))
        con.execute("INSERT INTO runs (id, created_at, status, mode, model_name, scenario_json, estimate_json) "
                    "VALUES ('q', '2020-01-01T00:00:01.000000+00:00', 'queued', 'cpu', 'm', '{}', '{}')")
    fresh = store.start_run("m", "cpu", SCENARIO, ESTIMATE)

    cutoff = datetime.now(timezone.utc) - timedelta(hours=1)
    assert store.mark_stale_running_as_failed("runner process died", created_before=cutoff) == 2
    for run_id in (old, "q"):
        record = store.get(run_id)
        assert record.status is RunStatus.FAILED and record.reason == "runner process died"
        assert record.finished_at is not None
    assert store.get(fresh).status is RunStatus.RUNNING
    assert store.get(done).status is RunStatus.OK and store.get(done).reason is None

    assert store.mark_stale_running_as_failed("found at startup") == 1
    assert store.get(fresh).status is RunStatus.FAILED
    assert store.mark_stale_running_as_failed("found at startup") == 0
    with pytest.raises(ValueError, match="already finished"):
        store.finish_run(fresh, "ok")  # the late report of a run declared dead is refused, not merged
    with pytest.raises(ValueError, match="reason"):
        store.mark_stale_running_as_failed("")
    with pytest.raises(ValueError, match="timezone-aware"):
        store.mark_stale_running_as_failed("x", created_before=datetime(2020, 1, 1))


# --- schema, journal, data directory --------------------------------------------------------------

def test_new_database_is_wal_at_current_version_and_reopen_is_idempotent(tmp_path):
    path = tmp_path / "nested" / "dir" / "runs.sqlite3"
    store = RunHistory(path)
    assert path.exists()
    assert store.schema_version() == len(history.MIGRATIONS) == 2
    with _raw(path) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert con.execute("PRAGMA user_version").fetchone()[0] == 2
    run_id = store.start_run("m", "cpu", SCENARIO, ESTIMATE)
    with store._connect() as con:
        assert con.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert con.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000
    again = RunHistory(path)
    assert again.schema_version() == 2
    assert again.get(run_id) == store.get(run_id)
    assert again.integrity_ok()


def test_empty_version_0_file_is_migrated(tmp_path):
    path = tmp_path / "runs.sqlite3"
    _raw(path).close()  # an existing, empty database: user_version 0, rollback journal
    with _raw(path) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == 0
    store = RunHistory(path)
    assert store.schema_version() == 2
    store.finish_run(store.start_run("m", "cpu", SCENARIO, ESTIMATE), "ok")
    assert len(store.list_runs()) == 1


def test_older_database_is_migrated_forward_by_appended_migration(tmp_path, monkeypatch):
    path = tmp_path / "runs.sqlite3"
    v1 = RunHistory(path)
    run_id = v1.start_run("m", "cpu", SCENARIO, ESTIMATE)

    def add_device_name(con):  # what a real next version would look like: one appended function
        con.execute("ALTER TABLE runs ADD COLUMN device_name TEXT")
        con.execute("UPDATE runs SET device_name = 'unknown'")

    monkeypatch.setattr(history, "MIGRATIONS", history.MIGRATIONS + (add_device_name,))
    v2 = RunHistory(path)
    assert v2.schema_version() == 3
    with _raw(path) as con:
        assert con.execute("SELECT device_name FROM runs WHERE id = ?", (run_id,)).fetchone() == ("unknown",)
    assert v2.get(run_id).scenario == SCENARIO
    RunHistory(path)  # at the current version: nothing runs again
    assert v2.schema_version() == 3


def test_failed_migration_rolls_back_completely(tmp_path, monkeypatch):
    path = tmp_path / "runs.sqlite3"
    run_id = RunHistory(path).start_run("m", "cpu", SCENARIO, ESTIMATE)
    released = history.MIGRATIONS

    def half_done(con):
        con.execute("ALTER TABLE runs ADD COLUMN x TEXT")
        raise RuntimeError("migration bug")

    monkeypatch.setattr(history, "MIGRATIONS", history.MIGRATIONS + (half_done,))
    with pytest.raises(RuntimeError, match="migration bug"):
        RunHistory(path)
    with _raw(path) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == len(released)
        assert "x" not in [r[1] for r in con.execute("PRAGMA table_info(runs)")]
    monkeypatch.setattr(history, "MIGRATIONS", released)
    assert RunHistory(path).get(run_id) is not None


def test_database_newer_than_code_is_refused(tmp_path):
    path = tmp_path / "runs.sqlite3"
    RunHistory(path)
    with _raw(path) as con:
        con.execute("PRAGMA user_version = 7")
    with pytest.raises(HistoryError, match="schema version 7, newer than this code"):
        RunHistory(path)


def test_data_dir_env_is_honoured(tmp_path, monkeypatch):
    data_dir = tmp_path / "planner-data"
    monkeypatch.setenv("PLANNER_DATA_DIR", str(data_dir))
    store = RunHistory()
    assert store.path == data_dir / "runs.sqlite3"
    assert store.path.exists()
    store.start_run("m", "cpu", SCENARIO, ESTIMATE)
    assert len(RunHistory(data_dir / "runs.sqlite3").list_runs()) == 1


def test_default_location_is_data_under_project_root(monkeypatch):
    monkeypatch.delenv("PLANNER_DATA_DIR", raising=False)
    root = Path(__file__).resolve().parents[1]
    assert history.default_db_path() == root / "data" / "runs.sqlite3"  # path only: nothing is created
    monkeypatch.setenv("PLANNER_DATA_DIR", "")
    assert history.default_db_path() == root / "data" / "runs.sqlite3"


def test_integrity_ok_detects_a_damaged_file(tmp_path):
    path = tmp_path / "runs.sqlite3"
    store = RunHistory(path)
    store.start_run("m", "cpu", SCENARIO, ESTIMATE)
    with _raw(path) as con:  # 200 rows in one commit: a table many pages deep, quickly
        con.execute("BEGIN")
        con.executemany("INSERT INTO runs (id, created_at, status, mode, model_name, scenario_json, estimate_json) "
                        "VALUES (?, '2025-01-01T00:00:00.000000+00:00', 'running', 'cpu', 'm', ?, '{}')",
                        [(f"{i:032x}", json.dumps({"pad": "x" * 500})) for i in range(200)])
        con.execute("COMMIT")
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert store.integrity_ok()
    page_size = 4096
    with open(path, "r+b") as f:  # scribble over an interior page of the table
        f.seek(page_size * 10 + 100)
        f.write(b"\xff" * 1000)
    assert not store.integrity_ok()


# --- concurrency and crashes ---------------------------------------------------------------------

def test_threads_can_share_one_store(store):
    errors = []

    def work():
        try:
            for _ in range(10):
                store.finish_run(store.start_run("threaded", "cpu", SCENARIO, ESTIMATE), "ok")
        except Exception as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.list_runs(limit=None, model="threaded", status="ok")) == 40


def _concurrent_writer(path: str, worker: int, runs: int, go, results) -> None:
    store = RunHistory(path)  # every process opens (and would migrate) the same fresh file
    go.wait()
    ids = []
    for i in range(runs):
        run_id = store.start_run(f"worker-{worker}", "cpu", {**SCENARIO, "i": i}, ESTIMATE)
        store.finish_run(run_id, "ok", measurement={"peak_bytes": i}, environment={"worker": worker})
        ids.append(run_id)
    results.put((worker, ids))


def test_concurrent_writer_processes_lose_nothing(tmp_path):
    path = tmp_path / "runs.sqlite3"  # not created here: the workers race to create it
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_writer, args=(str(path), w, 20, go, results)) for w in range(8)]
    for p in procs:
        p.start()
    go.set()
    reported = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    store = RunHistory(path)
    assert store.integrity_ok()
    runs = store.list_runs(limit=None)
    assert len(runs) == 160
    assert {r.id for r in runs} == {run_id for ids in reported.values() for run_id in ids}
    assert all(r.status is RunStatus.OK and r.finished_at is not None for r in runs)
    for worker in range(8):
        mine = store.list_runs(limit=None, model=f"worker-{worker}")
        assert sorted(r.scenario["i"] for r in mine) == list(range(20))
        assert all(r.environment == {"worker": worker} and r.measurement == {"peak_bytes": r.scenario["i"]}
                   for r in mine)


def _writer_until_killed(path: str, log_path: str) -> None:
    store = RunHistory(path)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    payload = {"trace": list(range(2000))}  # bigger commits: the kill lands mid-write more often
    while True:
        run_id = store.start_run("victim", "cpu", SCENARIO, ESTIMATE)
        store.finish_run(run_id, "ok", measurement=payload)
        os.write(fd, f"{run_id}\n".encode())  # reported only after finish_run committed


def _completed_lines(log_path: Path) -> list[str]:
    if not log_path.exists():
        return []
    text = log_path.read_text()
    return text[:text.rfind("\n") + 1].split()  # a torn last line is not a report


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkilled_writer_leaves_intact_database_with_every_reported_run(tmp_path):
    path, log_path = tmp_path / "runs.sqlite3", tmp_path / "reported.txt"
    RunHistory(path)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_writer_until_killed, args=(str(path), str(log_path)))
    proc.start()
    deadline = time.monotonic() + 30
    while len(_completed_lines(log_path)) < 40:
        assert proc.is_alive() and time.monotonic() < deadline, "writer died or stalled before the kill"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    assert proc.exitcode == -signal.SIGKILL

    reported = _completed_lines(log_path)
    store = RunHistory(path)  # reopening recovers the WAL left by the killed process
    assert store.integrity_ok()
    runs = {r.id: r for r in store.list_runs(limit=None)}
    assert set(reported) <= set(runs)
    assert all(runs[run_id].status is RunStatus.OK and runs[run_id].measurement["trace"][-1] == 1999
               for run_id in reported)
    # At most the one run in flight at the kill is unreported: started, maybe also finished.
    unreported = [r for run_id, r in runs.items() if run_id not in set(reported)]
    assert len(unreported) <= 1
    assert store.mark_stale_running_as_failed("writer was killed") == sum(
        r.status is RunStatus.RUNNING for r in unreported)
    assert store.list_runs(limit=None, status="running") == []
    store.finish_run(store.start_run("after", "cpu", SCENARIO, ESTIMATE), "ok")  # still writable
    assert store.integrity_ok()


# --- runs whose owner died, database faults (issue 15) ------------------------------------------

def _dead_owner() -> str:
    """The token of a process that has exited (a real one: started, reaped)."""
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join()
    return ProcessIdentity(current().host, current().boot_id, proc.pid, current().start_ticks).token()


def test_run_whose_owner_died_is_marked_killed_when_the_history_next_opens(tmp_path):
    path = tmp_path / "runs.sqlite3"
    store = RunHistory(path)
    orphan = store.start_run("m", "cpu", SCENARIO, ESTIMATE)
    mine = store.start_run("m", "cpu", SCENARIO, ESTIMATE)
    foreign = store.start_run("m", "cpu", SCENARIO, ESTIMATE)
    with _raw(path) as con:
        con.execute("UPDATE runs SET owner = ? WHERE id = ?", (_dead_owner(), orphan))
        con.execute("UPDATE runs SET owner = ? WHERE id = ?", ("other-host/x/1/1", foreign))
    reopened = RunHistory(path)
    killed = reopened.get(orphan)
    assert killed.status is RunStatus.KILLED and killed.finished_at is not None
    assert "ended without recording an outcome" in killed.reason and "SIGKILL" in killed.reason
    assert reopened.get(mine).status is RunStatus.RUNNING  # this process is alive
    assert reopened.get(foreign).status is RunStatus.RUNNING  # another host's: unknown, left alone
    assert reopened.mark_runs_of_dead_owners() == 0


def test_process_identity_tells_a_reused_pid_and_a_reboot_from_the_owner():
    me = current()
    assert ProcessIdentity.from_token(me.token()) == me and is_alive(me) is True
    assert is_alive(ProcessIdentity(me.host, me.boot_id, me.pid, (me.start_ticks or 0) + 1)) is False
    assert is_alive(ProcessIdentity(me.host, "another-boot", me.pid, me.start_ticks)) is False
    assert ProcessIdentity.from_token("not a token") is None


def _garbage(path: Path) -> None:
    path.write_bytes(b"this is not a database, just bytes " * 100)


def _newer(path: Path) -> None:
    RunHistory(path)
    with _raw(path) as con:
        con.execute("PRAGMA user_version = 99")


def _read_only(path: Path) -> None:
    RunHistory(path).start_run("m", "cpu", SCENARIO, ESTIMATE)
    files = [str(f) for f in path.parent.iterdir()]
    for name in files:
        os.chmod(name, 0o444)
    path.parent.chmod(0o555)
    if os.geteuid() == 0:  # root writes whatever the mode says: make them immutable instead
        if subprocess.run(["chattr", "+i", *files, str(path.parent)], capture_output=True, check=False).returncode != 0:
            pytest.skip("running as root without chattr: a read-only file cannot be made")


def _writable_again(folder: Path) -> None:
    if os.geteuid() == 0 and folder.is_dir():
        subprocess.run(["chattr", "-i", str(folder), *map(str, folder.iterdir())], capture_output=True, check=False)
    if folder.is_dir():
        folder.chmod(0o755)


def _directory(path: Path) -> None:
    path.mkdir(parents=True)


def _data_dir_is_a_file(path: Path) -> None:
    path.parent.write_text("a file where the data directory should be")


@pytest.mark.parametrize(("make", "words"), [
    (_garbage, "not a SQLite database"), (_newer, "newer than this code"), (_read_only, "read-only"),
    (_directory, "is a folder, not a database file"), (_data_dir_is_a_file, "is a file, not a folder"),
])
def test_every_database_fault_is_one_line_saying_how_to_recover(tmp_path, make, words):
    path = tmp_path / "data" / "runs.sqlite3"
    if make is not _data_dir_is_a_file:
        path.parent.mkdir()
    try:
        make(path)
        with pytest.raises(HistoryError) as raised:
            RunHistory(path).start_run("m", "cpu", SCENARIO, ESTIMATE)
        message = str(raised.value)
        assert words in message and "\n" not in message
        assert "PLANNER_DATA_DIR" in message or "update the planner" in message
    finally:
        _writable_again(path.parent)


def test_database_deleted_while_in_use_is_an_error_not_a_new_empty_file(tmp_path):
    path = tmp_path / "runs.sqlite3"
    store = RunHistory(path)
    run_id = store.start_run("m", "cpu", SCENARIO, ESTIMATE)
    for name in ("runs.sqlite3", "runs.sqlite3-wal", "runs.sqlite3-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    with pytest.raises(HistoryError, match="deleted while in use"):
        store.finish_run(run_id, "ok", measurement={"peak_bytes": 1})
    assert not path.exists()


def test_unfinished_run_from_before_owners_is_marked_once_a_day_old(tmp_path):
    path = tmp_path / "runs.sqlite3"
    store = RunHistory(path)
    old, recent = (store.start_run("m", "cpu", SCENARIO, ESTIMATE) for _ in range(2))
    day_ago = (datetime.now(timezone.utc) - timedelta(days=1, minutes=1)).isoformat(timespec="microseconds")
    with _raw(path) as con:  # as a version-1 database left them: no owner
        con.execute("UPDATE runs SET owner = NULL")
        con.execute("UPDATE runs SET created_at = ? WHERE id = ?", (day_ago, old))
    reopened = RunHistory(path)
    assert reopened.get(old).status is RunStatus.KILLED and "before run owners" in reopened.get(old).reason
    assert reopened.get(recent).status is RunStatus.RUNNING
