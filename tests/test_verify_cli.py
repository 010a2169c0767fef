"""`python -m runners verify|history`: flag parsing, one-line errors (exit 2), the exit
status of every run outcome, `--json`'s last line, the progress bar and the table.
Runs use injected faults, so no training step is needed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS
from planner.units import GIB
from runners.cli import EXIT_CODES, ProgressBar, main
from runners.history import RunHistory, RunStatus

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(CONFIGS / "tiny-llama.json"), "--task", "causal-lm", "--batch-size", "2", "--seq-len", "16"]


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["verify", "--task", "causal-lm", "--batch-size", "2", "--seq-len", "16"], "--config"),
    (["verify", *TINY, "--steps", "1"], "steps must be an integer from 2"),
    (["verify", *TINY, "--steps", "two"], "--steps"),
    (["verify", *TINY, "--mode", "gpu"], "--mode"),
    (["verify", *TINY, "--engine", "deepspeed"], "--engine"),
    (["verify", *TINY, "--engine", "trainer", "--mode", "simulate"], "simulate mode runs the Accelerate loop only"),
    (["verify", *TINY, "--timeout", "0"], "positive number of seconds"),
    (["verify", *TINY, "--device", "cpu"], "drop --device"),
    (["verify", *TINY, "--local-sgd-steps", "0"], "local SGD steps"),
    (["verify", *TINY, "--optimizer", "lion"], "unknown optimizer"),
    (["verify", "--config", "no-such-model", "--task", "causal-lm", "--batch-size", "2", "--seq-len", "16"],
     "neither a catalog model nor a config file"),
    (["verify", *TINY[:-1], "100000"], "sequence"),
    (["history", "--limit", "0"], "--limit"),
    (["frobnicate"], "invalid choice"),
    # Issue 15 item 6: each traced back, or ran (and recorded) a run, before.
    (["history", "--limit", str(10**20)], "--limit must be an integer from 1 to 1,000,000"),
    (["verify", *TINY, "--seed", str(10**26)], "seed must be an integer from 0 to 4,294,967,295"),
    (["verify", *TINY, "--write-job", "job.json"], "--write-job writes a distributed job"),
    (["verify", *TINY, "--num-processes", "2", "--write-job", "/no/such/folder/job.json"],
     "folder '/no/such/folder' does not exist"),
    (["verify", *TINY, "--num-processes", "2", "--write-job", str(ROOT)], "is a folder: give a file name"),
    (["bogus"], "(see `python -m runners --help`)"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, data_dir, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("runners: error: ")
    assert message in err
    assert not (data_dir / "runs.sqlite3").exists() or RunHistory().list_runs() == []  # nothing recorded


def test_exit_codes_are_documented():
    assert EXIT_CODES == {"ok": 0, "failed": 1, "timeout": 1, "killed": 1, "oom": 3, "refused": 3}


@pytest.mark.parametrize("fault, extra, status, code", [
    ("raise", [], "failed", 1),
    ("import-error", [], "failed", 1),
    ("sigkill-self", [], "killed", 1),
    ("hang", ["--timeout", "2"], "timeout", 1),
    ("cuda-oom", [], "oom", 3),
])
def test_json_last_line_and_exit_code_per_outcome(capsys, fault, extra, status, code):
    exit_code, out, err = run_cli(capsys, "verify", *TINY, "--mode", "cpu", "--inject-fault", fault, "--json", *extra)
    assert exit_code == code
    result = json.loads(out.strip().splitlines()[-1])
    assert result["status"] == status and result["mode"] == "cpu" and result["measured"] is None
    assert result["estimated"]["peak_bytes"] > 0 and result["estimated"]["scenario"]["device"] == "cpu"
    assert result["reason"]
    (record,) = RunHistory().list_runs()
    assert record.status is RunStatus(status) and record.id == result["run_id"]
    if fault == "cuda-oom":
        assert result["oom_requested_bytes"] == 2 * GIB


def test_refused_cpu_run_exits_3(capsys):
    code, out, err = run_cli(capsys, "verify", "--config", "llama-2-70b", "--task", "causal-lm", "--batch-size", "1",
                             "--seq-len", "512", "--mode", "cpu", "--json")
    assert code == 3
    result = json.loads(out.strip().splitlines()[-1])
    assert result["status"] == "refused" and "--mode simulate" in result["reason"]
    assert err == ""  # no child, so no progress


def test_table_and_progress_bar(capsys):
    code, out, err = run_cli(capsys, "verify", *TINY, "--mode", "cpu", "--steps", "4", "--inject-fault", "cuda-oom")
    assert code == 3
    assert "tiny-llama.json: oom, mode cpu" in out
    assert "Requested when out of memory: 2.00 GiB" in out
    for row in ("weights", "gradients", "optimizer state", "activations", "temporaries", "PEAK"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    assert "GiB = 2**30 bytes" in out
    assert "step 1 of 4" in err and "[" in err


def test_progress_bar_draws_stages():
    class Stream:
        def __init__(self, tty):
            self.text, self.tty = "", tty

        def write(self, text):
            self.text += text

        def flush(self):
            pass

        def isatty(self):
            return self.tty

    events = [{"stage": "building model"}, {"stage": "step", "step": 1, "steps": 2},
              {"stage": "step", "step": 2, "steps": 2}, {"stage": "measuring"}, {"stage": "measuring"}]
    log = Stream(tty=False)
    bar = ProgressBar(log)
    for event in events:
        bar(event)
    bar.close()
    assert log.text.splitlines() == ["[........................] building model",
                                     "[############............] step 1 of 2",
                                     "[########################] step 2 of 2",
                                     "[########################] measuring"]
    terminal = Stream(tty=True)
    bar = ProgressBar(terminal)
    for event in events:
        bar(event)
    bar.close()
    assert terminal.text.count("\n") == 1 and terminal.text.count("\r") == len(events)


def test_history_lists_runs(capsys):
    run_cli(capsys, "verify", *TINY, "--mode", "cpu", "--inject-fault", "raise")
    code, out, _ = run_cli(capsys, "history", "--json")
    assert code == 0
    (run,) = json.loads(out)
    assert run["status"] == "failed" and run["mode"] == "cpu" and run["scenario"]["inject_fault"] == "raise"
    code, out, _ = run_cli(capsys, "history")
    assert code == 0 and "failed" in out and "tiny-llama.json" in out


def test_python_dash_m_runners(data_dir):
    """The real entry point, in a fresh interpreter: stdout's last line is the result."""
    done = subprocess.run([sys.executable, "-m", "runners", "verify", *TINY, "--mode", "simulate",
                           "--inject-fault", "raise", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "failed" and result["mode"] == "simulate"
    assert "RuntimeError: injected fault" in result["reason"]


def test_a_real_cpu_run_end_to_end(capsys):
    """No fault: the child trains the tiny decoder for 2 steps and measures the last one."""
    code, out, err = run_cli(capsys, "verify", *TINY, "--mode", "cpu", "--steps", "2", "--json")
    assert code == 0, out + err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["status"] == "ok" and result["mode"] == "cpu" and result["reason"] is None
    measured = result["measured"]
    for key in ("weights_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes",
                "temporaries_bytes", "peak_bytes"):
        assert isinstance(measured[key], int), key
    assert measured["peak_bytes"] > 0 and measured["step_wall_s"] > 0
    assert result["errors_pct"]["optimizer_state"] == 0.0  # the planner's exact figure
    assert set(result["errors_pct"]) == {"weights", "gradients", "optimizer_state", "activations", "temporaries",
                                         "peak"}
    assert result["environment"]["torch"]
    (record,) = RunHistory().list_runs()
    assert record.status is RunStatus.OK and record.measurement["peak_bytes"] == measured["peak_bytes"]
    assert "step 2 of 2" in err and "measuring" in err


def test_cuda_is_likely_available_reads_the_driver_without_importing_torch(tmp_path, monkeypatch):
    from runners.verify import cuda_is_likely_available

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    driver = tmp_path / "version"
    assert not cuda_is_likely_available(str(driver))
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module\n")
    assert cuda_is_likely_available(str(driver))
    assert "torch" not in sys.modules


def test_a_config_beyond_any_model_is_refused_before_a_run_is_recorded(capsys, tmp_path):
    """Issue 15 item 1 on the runners' path: T5 with 100,000 layers built for minutes."""
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({"model_type": "t5", "num_layers": 100_000, "d_model": 64, "num_heads": 2}))
    code, out, err = run_cli(capsys, "verify", "--config", str(path), "--task", "sequence-classification",
                             "--batch-size", "1", "--seq-len", "8", "--mode", "simulate")
    assert (code, out) == (2, "") and "beyond any real model" in err and err.count("\n") == 1
    assert RunHistory().list_runs() == []
