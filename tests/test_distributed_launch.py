"""runners.launch and `verify --num-processes`: real torchrun runs of tiny-llama on CPU
over gloo. A rank SIGKILLed mid-run, or one that exits before the process group forms,
ends the run with a reason naming the rank, well within the limit, and leaves no process
behind; refusals start nothing; the CLI's two-rank DDP run ends with equal replicas."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CONFIGS, tiny_config
from planner.strategy import Strategy
from runners import launch, scratch
from runners.history import RunHistory
from runners.launch import processes_holding, run_distributed
from runners.request import Mode, VerifyRequest

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = {"task": "causal-lm", "batch_size": 2, "seq_len": 16, "optimizer": "adamw", "precision": "fp32"}
TIMEOUT_S = 60.0


def request(mode: Mode = Mode.CPU, fault: str | None = None, steps: int = 4) -> VerifyRequest:
    return VerifyRequest(config=tiny_config("tiny-llama"), model_name="tiny-llama", scenario=SCENARIO, mode=mode,
                         steps=steps, inject_fault=fault)


@pytest.fixture
def launched(monkeypatch, tmp_path) -> list[str]:
    """The private temp dir of every run started (every process of a run carries it in its argv).
    The system temp dir is a fresh folder for the test, empty again once the run is over."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))  # torchrun and the ranks inherit it
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    dirs: list[str] = []
    real_mkdtemp = scratch.tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        dirs.append(real_mkdtemp(*args, **kwargs))
        return dirs[-1]

    monkeypatch.setattr(scratch.tempfile, "mkdtemp", recording_mkdtemp)
    yield dirs
    # torch elastic writes its logs under TMPDIR (torchelastic_*): a run must take them along.
    # torchinductor_<user> is torch's compile cache, made by this test process's own torch.
    left = [name for name in os.listdir(private_tmp) if not name.startswith("torchinductor_")]
    assert left == [], "the run left temporary files behind"


def assert_nothing_left(dirs: list[str]) -> None:
    assert dirs, "no run was started"
    for directory in dirs:
        assert processes_holding(directory) == [], f"processes of {directory} outlived the run"
        assert not Path(directory).exists(), "the run's temp dir was not removed"


def test_rank_sigkilled_mid_run_names_the_rank_and_leaves_nothing(launched):
    events = []
    started = time.monotonic()
    result = run_distributed(request(fault="sigkill-self"), Strategy.DDP, 2, TIMEOUT_S, on_progress=events.append)
    elapsed = time.monotonic() - started
    assert result["status"] == "killed", result
    assert result["reason"].startswith("rank 1 died (SIGKILL) at step 2 of 4"), result["reason"]
    assert elapsed < TIMEOUT_S / 2
    assert any(e.get("stage") == "step" and e.get("step") == 2 for e in events)  # progress arrived live
    assert result["ranks"] == [] and result["stderr_tail"]
    assert_nothing_left(launched)


def test_rank_exiting_before_the_group_forms_fails_fast(launched):
    started = time.monotonic()
    result = run_distributed(request(fault="import-error"), Strategy.DDP, 2, TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert result["status"] == "failed", result
    assert result["reason"].startswith("rank 1 exited with status 3 before the process group formed"), result["reason"]
    assert elapsed < TIMEOUT_S / 3  # torchrun notices the exit; nobody waits for the group timeout
    assert_nothing_left(launched)


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": Strategy.ZERO2}, "DeepSpeed ZeRO is not a dependency"),
    ({"strategy": Strategy.ZERO3}, "fsdp-full-shard (like ZeRO-3)"),
    ({"mode": Mode.SIMULATE}, "distributed runs measure real tensors"),
    ({"num_processes": 1}, "without --num-processes"),
    ({"mode": Mode.CUDA, "num_processes": 64}, "64 processes need 64 GPUs; this machine has"),
    ({"num_processes": 4 * (os.cpu_count() or 1) + 1}, "too many"),
])
def test_refusals_start_nothing(monkeypatch, launched, kwargs, message):
    def no_process(*args, **kw):
        raise AssertionError("a refused run started a process")

    monkeypatch.setattr(launch.subprocess, "Popen", no_process)
    strategy = kwargs.get("strategy", Strategy.DDP)
    started = time.monotonic()
    result = run_distributed(request(mode=kwargs.get("mode", Mode.CPU)), strategy, kwargs.get("num_processes", 2),
                             TIMEOUT_S)
    assert time.monotonic() - started < 5.0
    assert result["status"] == "refused"
    assert message in result["reason"] and "\n" not in result["reason"]
    assert launched == []  # not even a temp dir


def test_auto_mode_resolves_to_cpu_without_enough_gpus():
    plan = launch.plan_distributed(request(mode=Mode.AUTO), Strategy.DDP, 2, cuda_devices=1, check_ram=False)
    assert plan.request.mode is Mode.CPU and plan.request.scenario["device"] == "cpu" and plan.refusal is None
    plan = launch.plan_distributed(request(mode=Mode.AUTO), Strategy.DDP, 2, cuda_devices=2)
    assert plan.request.mode is Mode.CUDA and plan.request.scenario["device"] == "cuda" and plan.refusal is None


def test_each_cpu_rank_gets_a_memory_limit_from_its_estimate_and_a_share_of_free_ram(monkeypatch, tmp_path):
    from planner.loading import model_shape_for_config
    from planner.parallel import parallel_estimate
    from planner.strategy import ParallelPlan
    from runners import verify as verify_module
    from runners.memory_limit import MEMORY_LIMIT_ENV

    planned = launch.plan_distributed(request(), Strategy.DDP, 2, check_ram=False).request  # device: cpu
    scenario = planned.parsed_scenario()
    shape = model_shape_for_config(planned.config, scenario.task, scenario.num_labels, planned.model_name)
    per_rank = parallel_estimate(shape, scenario, ParallelPlan(2, Strategy.DDP)).per_device_peak_bytes
    needed = verify_module.ram_needed_for_peak(per_rank)
    for free, expected in ((64 * 2**30, int(needed * 1.5)), (int(needed * 2.4), int(needed * 1.2))):
        monkeypatch.setattr(verify_module, "available_ram_bytes", lambda free=free: free)
        plan = launch.plan_distributed(request(), Strategy.DDP, 2)
        assert plan.refusal is None and plan.memory_limit_bytes == expected  # 1.5 x needed, or half the free RAM
    env = launch._env(tmp_path, plan.memory_limit_bytes)  # torchrun's, which each rank inherits and applies
    assert env[MEMORY_LIMIT_ENV] == str(expected) and env["TMPDIR"] == str(tmp_path)


def test_cli_two_rank_ddp_run_has_equal_replicas_and_is_recorded(tmp_path):
    data_dir = tmp_path / "data"
    env = {**os.environ, "PLANNER_DATA_DIR": str(data_dir)}
    proc = subprocess.run(
        [sys.executable, "-m", "runners", "verify", "--config", str(CONFIGS / "tiny-llama.json"), "--task",
         "causal-lm", "--batch-size", "2", "--seq-len", "16", "--num-processes", "2", "--strategy", "ddp",
         "--mode", "cpu", "--steps", "3", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "ok" and result["reason"] is None
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert result["replicas_equal"] is True
    assert result["ranks"][0]["parameter_digest"] == result["ranks"][1]["parameter_digest"]
    assert result["max_rank_peak_bytes"] == max(r["measured"]["peak_bytes"] for r in result["ranks"])
    # DDP all-reduces every gradient once per step, in buckets: the steady step's payload is
    # the buckets' total, exactly.
    buckets = result["comm_per_step"]["ddp_gradient_buckets"]
    assert buckets["bytes"] == sum(result["ranks"][0]["measured"]["ddp_bucket_bytes"])
    assert buckets["calls"] >= 1
    assert "step 3 of 3" in proc.stderr  # the progress bar
    record = RunHistory(data_dir / "runs.sqlite3").get(result["run_id"])
    assert record.status.value == "ok" and record.mode.value == "cpu"
    assert record.scenario["strategy"] == "ddp" and record.scenario["num_devices"] == 2
    assert record.scenario["local_sgd_steps"] is None
    # The planner's estimate for one rank is stored beside the measurement.
    assert record.estimate["strategy"] == "ddp" and record.estimate["num_devices"] == 2
    assert record.estimate["comm_bytes_per_step"] == buckets["bytes"] + result["comm_per_step"]["broadcast"]["bytes"]
    assert abs(record.estimate["per_device_peak_bytes"] - result["max_rank_peak_bytes"]) <= 0.01 * result[
        "max_rank_peak_bytes"]
    assert record.measurement["replicas_equal"] is True and "stderr_tail" not in record.measurement


def _accelerate_launch(tmp_path: Path, *launch_flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    from runners.launch import write_job

    job = write_job(request(steps=3), Strategy.DDP, tmp_path / "job.json")
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *launch_flags, "-m",
                           "runners.rank_worker", str(job), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done, out


def test_accelerate_launch_multi_gpu_runs_two_gloo_ranks_on_cpu(tmp_path):
    done, out = _accelerate_launch(tmp_path, "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                                   "--mixed_precision", "no", "--dynamo_backend", "no")
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2] and {r["backend"] for r in ranks} == {"gloo"}
    assert all(r["replicas_equal"] for r in ranks)


def test_accelerate_launch_cpu_flag_runs_one_process_and_says_so(tmp_path):
    # DESIGN, Known facts: `accelerate launch --cpu --num_processes 2` silently runs one process.
    done, out = _accelerate_launch(tmp_path, "--cpu", "--num_processes", "2", "--num_machines", "1",
                                   "--mixed_precision", "no", "--dynamo_backend", "no")
    assert done.returncode != 0 and not out.exists()
    assert "accelerate launch --multi_gpu --num_processes N" in done.stderr
