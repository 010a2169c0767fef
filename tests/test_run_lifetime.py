"""A run's processes and files end with the run, and its record never stays `running`:
a SIGKILLed or SIGTERMed `runners verify` takes its hung child along and the next
`runners history` shows the run as killed; a child that allocates past its memory limit
ends as "oom" with the limit in its reason; scratch folders of a dead starter are swept;
a measured result the history cannot store is kept in a file beside it; a broken history
is one line from `verify` and `history`, not a traceback.
(Faults inside a run: test_isolation.py; ranks of a distributed run: test_distributed_launch.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CONFIGS, tiny_config
from runners.history import RunHistory, RunStatus
from runners.isolation import run_in_child
from runners.memory_limit import (
    ADDRESS_SPACE_SLACK_BYTES,
    GIB,
    MEMORY_LIMIT_ENV,
    env_with_limit,
    memory_limit_for,
)
from runners.process_identity import current
from runners.request import Mode, VerifyRequest
from runners.scratch import scratch_dir, sweep_orphans
from runners.unrecorded import finish_or_keep, unrecorded_note, unrecorded_path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(CONFIGS / "tiny-llama.json"), "--task", "causal-lm", "--batch-size", "2", "--seq-len", "16"]
# A catalog model plans from its shipped probe tables (no probe in a fresh data dir); the
# hang fault stops the child before it builds anything.
CATALOG = ["--config", "gpt2", "--task", "causal-lm", "--batch-size", "1", "--seq-len", "16"]


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Running, or a zombie nobody reaped yet that is still ours (a dead one re-parented is not alive)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X")


def _start_hung_verify(tmp_path: Path) -> subprocess.Popen:
    """`runners verify` of a run whose child hangs (its progress bar goes to stderr)."""
    env = {**os.environ, "PLANNER_DATA_DIR": str(tmp_path / "data"), "TMPDIR": str(tmp_path / "tmp"),
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "runners", "verify", *CATALOG, "--mode", "simulate",
                             "--inject-fault", "hang", "--timeout", "300"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _hanging_child(proc: subprocess.Popen) -> int:
    """The pid of `proc`'s child once it reports its hang (so it is past binding itself to its parent)."""
    for line in proc.stderr:  # the progress bar: one line per stage off a terminal
        if b"building model" in line:
            return _children_of(proc.pid)[0]
    raise AssertionError(f"verify exited ({proc.wait()}) before its child hung")


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_sigkill_or_sigterm_of_verify_leaves_no_process_and_history_shows_killed(tmp_path):
    (tmp_path / "tmp").mkdir()
    # Both at once: they start together on the two cores.
    procs = {number: _start_hung_verify(tmp_path) for number in (signal.SIGKILL, signal.SIGTERM)}
    children = {number: _hanging_child(proc) for number, proc in procs.items()}
    for number, proc in procs.items():
        os.kill(proc.pid, number)
    for number, proc in procs.items():
        name = signal.Signals(number).name
        assert proc.wait(timeout=5) == (-signal.SIGKILL if number == signal.SIGKILL else 128 + signal.SIGTERM)
        assert _gone_within(children[number], 5.0), f"the child of a verify ended by {name} survived 5 s"
    env = {**os.environ, "PLANNER_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)}
    listed = subprocess.run([sys.executable, "-m", "runners", "history", "--json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    runs = json.loads(listed.stdout)
    assert sorted(r["status"] for r in runs) == ["killed", "killed"], runs
    reasons = sorted(r["reason"] for r in runs)
    assert "ended without recording an outcome" in reasons[0]  # SIGKILL: found when the history opened
    assert "SIGTERM" in reasons[1]  # SIGTERM: recorded by the stopping process itself
    # The SIGKILLed parent could not remove its scratch folder: the next run sweeps it.
    sweep_orphans(tmp_path / "tmp")
    # torchinductor_<user> is torch's compile cache, which importing torch makes: not the run's.
    assert [name for name in os.listdir(tmp_path / "tmp") if not name.startswith("torchinductor_")] == []


def test_a_child_that_outgrows_its_memory_limit_ends_as_oom_with_the_limit_named():
    limit = 256 * 2**20
    request = VerifyRequest(config=tiny_config("tiny-llama"), model_name="tiny-llama",
                            scenario={"task": "causal-lm", "batch_size": 2, "seq_len": 16}, mode=Mode.CPU,
                            inject_fault="hog-memory")
    result = run_in_child(request, 60, memory_limit_bytes=limit)
    assert result["status"] == "oom", result
    assert result["reason"].startswith("over the run's memory limit of 0.25 GiB"), result["reason"]
    assert result["memory_limit_bytes"] == limit
    assert result["environment"]["max_rss_bytes"] <= limit + ADDRESS_SPACE_SLACK_BYTES


def test_memory_limit_is_derived_from_the_estimate_and_free_ram():
    # The run: allowed at 2.36 GiB, it reached 4.98 GB resident; its limit stops it below that.
    needed = int(2.36 * GIB)
    assert memory_limit_for("cpu", needed, 20 * GIB) == int(needed * 1.5) < 4.98e9
    assert memory_limit_for("cpu", needed, 3 * GIB) == 3 * GIB  # never more than the free RAM
    assert memory_limit_for("cpu", needed, None) == int(needed * 1.5)
    assert memory_limit_for("simulate", None, 5 * GIB) == 5 * GIB
    assert memory_limit_for("cuda", needed, 5 * GIB) is None
    # The child's environment: the limit, and glibc's arenas capped unless the caller chose.
    assert env_with_limit({"PATH": "/bin"}, 123) == {"PATH": "/bin", MEMORY_LIMIT_ENV: "123", "MALLOC_ARENA_MAX": "2"}
    assert env_with_limit({"MALLOC_ARENA_MAX": "8"}, 123)["MALLOC_ARENA_MAX"] == "8"
    assert env_with_limit({MEMORY_LIMIT_ENV: "5"}, None) == {}


def test_scratch_folders_of_a_dead_owner_are_swept_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    orphan = tmp_path / f"planner-run-{int(dead.stdout)}-{current().start_ticks}-abc123"
    (orphan / "torchelastic_x").mkdir(parents=True)
    unrelated = tmp_path / "planner-run-notes"
    unrelated.mkdir()
    with scratch_dir("run", root=tmp_path) as live:
        assert not orphan.exists() and unrelated.exists()
        assert sweep_orphans(tmp_path) == [] and live.exists()
    assert not live.exists()


def test_measured_result_of_a_history_deleted_mid_run_is_kept_beside_it(tmp_path):
    history = RunHistory(tmp_path / "data" / "runs.sqlite3")
    started = {"model_name": "tiny-llama", "mode": "cpu", "scenario": {"batch_size": 2}, "estimate": {"peak_bytes": 7}}
    run_id = history.start_run("tiny-llama", "cpu", started["scenario"], started["estimate"])
    for name in ("runs.sqlite3", "runs.sqlite3-wal", "runs.sqlite3-shm"):
        (tmp_path / "data" / name).unlink(missing_ok=True)
    answer = finish_or_keep(history, run_id, RunStatus.OK, started, measurement={"peak_bytes": 6})
    assert "deleted while in use" in answer["error"]
    kept = json.loads(Path(answer["kept_in"]).read_text())
    assert Path(answer["kept_in"]) == unrecorded_path(history.path, run_id)
    assert kept["measurement"] == {"peak_bytes": 6} and kept["status"] == "ok" and kept["estimate"] == {"peak_bytes": 7}
    note = unrecorded_note({"run_id": run_id, "unrecorded": answer})  # what the CLI and the pages show
    assert note.startswith(f"run {run_id} was not recorded") and note.endswith(f"kept in {answer['kept_in']}")
    assert unrecorded_note({"run_id": run_id, "unrecorded": None}) is None


def test_verify_cli_reports_a_result_it_could_not_record(tmp_path, capsys, monkeypatch):
    """The CLI's own line for it: the run's result, then where it is kept."""
    from runners import cli, verify as verify_module

    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    real_run_in_child = verify_module.run_in_child

    def delete_history_then_run(*args, **kwargs):
        for name in ("runs.sqlite3", "runs.sqlite3-wal", "runs.sqlite3-shm"):
            (tmp_path / "data" / name).unlink(missing_ok=True)
        return real_run_in_child(*args, **kwargs)

    monkeypatch.setattr(verify_module, "run_in_child", delete_history_then_run)
    code = cli.main(["verify", *CATALOG, "--mode", "simulate", "--inject-fault", "raise", "--json"])
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 1 and result["status"] == "failed"
    assert result["unrecorded"]["kept_in"] and Path(result["unrecorded"]["kept_in"]).exists()
    assert f"run {result['run_id']} was not recorded" in err and "no such table" not in err


def _garbage_database(data: Path) -> None:
    data.mkdir()
    (data / "runs.sqlite3").write_bytes(b"not a database " * 64)


def _data_dir_is_a_file(data: Path) -> None:
    data.write_text("a file where the data directory should be")


@pytest.mark.parametrize("make", [_garbage_database, _data_dir_is_a_file])
@pytest.mark.parametrize("command", [["history"], ["verify", *CATALOG, "--mode", "simulate"]])
def test_cli_says_one_line_for_a_broken_history_not_a_traceback(tmp_path, capsys, monkeypatch, make, command):
    from runners import cli

    make(tmp_path / "data")
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    code = cli.main(command)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("runners: error: the run history") and err.count("\n") == 1
    assert "PLANNER_DATA_DIR" in err
