"""The prepared GPU check (benchmarks/gpu_check.py) without a GPU: the dry run takes the
same code path on CPU (environment probe, child runs recorded in the history, planner
estimates, sub-checks, JSON and table); the GPU path's logic (what a CUDA result
becomes, the time guard, the GPU's planner key, the scenario matrix's coverage) runs
on fake measurements."""

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from planner.catalog import catalog_config
from runners.history import RunHistory
from runners.request import Engine, Mode, VerifyRequest

ROOT = Path(__file__).resolve().parents[1]
# Loaded from its file: putting benchmarks/ on sys.path would let its modules shadow others.
_SPEC = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_check)

RECORD_KEYS = {"id", "model", "family", "technique", "engine", "expandable_segments", "cuda_alloc_conf", "scenario",
               "steps", "status", "reason", "run_id", "mode", "wall_s", "child_alloc_conf", "measured", "planner",
               "errors", "environment"}
MEASURED_KEYS = {"allocated_peak_bytes", "reserved_peak_bytes", "reserved_after_run_bytes", "cuda_context_bytes",
                 "cuda_context_after_run_bytes", "cublas_workspace_bytes", "weights_bytes", "optimizer_state_bytes",
                 "peak_phase", "phase_peak_bytes", "after_load_bytes", "step_wall_s"}
PLANNER_KEYS = {"peak_bytes", "allocated_peak_bytes", "reserved_peak_bytes", "usable_capacity_bytes", "capacity_bytes",
                "required_bytes", "margin_bytes", "fits", "cuda_overhead_bytes", "allocator_overhead_bytes",
                "cuda_overhead_items", "allocator_overhead_items", "optimizer_state_bytes", "gpu"}
ERROR_KEYS = {"allocated_peak_pct", "live_tensor_peak_pct", "reserved_peak_pct", "optimizer_state_pct",
              "reserved_over_allocated"}


# One of the two dry scenarios (the Accelerate loop, expandable segments on): both take
# about 24 s on 2 cores, over this test's 20 s; `bash benchmarks/gpu_check.sh --dry-run`
# runs both, the Trainer's too.
DRY_ONE = gpu_check.DRY_SCENARIOS[0]


def test_dry_run_writes_every_field_and_fills_the_history(tmp_path):
    exported = tmp_path / "exported"
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", DRY_ONE["id"], "--export", str(exported)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "cpu" and report["environment"]["torch"]
    assert {"environment", "probe", "scenarios", "subchecks", "overheads", "elapsed_s", "gpu"} <= set(report)
    assert [r["id"] for r in report["scenarios"]] == [DRY_ONE["id"]]
    for record in report["scenarios"]:
        assert record["status"] == "ok", record["reason"]
        assert set(record) == RECORD_KEYS
        assert set(record["measured"]) == MEASURED_KEYS and set(record["errors"]) == ERROR_KEYS
        assert PLANNER_KEYS <= set(record["planner"]), record["planner"]
        assert record["measured"]["allocated_peak_bytes"] > 0 and record["planner"]["peak_bytes"] > 0
        assert abs(record["errors"]["allocated_peak_pct"]) < 50
        # the child saw the setting its scenario asked for
        assert record["child_alloc_conf"] == record["cuda_alloc_conf"]
    assert report["scenarios"][0]["child_alloc_conf"] == gpu_check.EXPANDABLE_ON
    assert set(report["subchecks"]) == {"allocator_gpu_check", "check_fake_cuda_on_gpu"}
    assert report["subchecks"]["allocator_gpu_check"]["returncode"] == 0
    assert report["subchecks"]["check_fake_cuda_on_gpu"]["returncode"] == 2  # no CUDA here: says so, checks nothing
    runs = RunHistory(tmp_path / "data" / "runs.sqlite3").list_runs()
    assert {run.id for run in runs} == {r["run_id"] for r in report["scenarios"]}
    # what a lent machine hands back: the results and a copy of the history holding the runs
    assert {p.name for p in exported.iterdir()} == {"gpu_check.json", "gpu_check.md", "runs.sqlite3"}
    assert [run.id for run in RunHistory(exported / "runs.sqlite3").list_runs()] == [report["scenarios"][0]["run_id"]]
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("# GPU check") and "## Overheads" in table and "## Sub-checks" in table
    assert f"| {DRY_ONE['id']} (" in table


def test_the_dry_run_covers_both_engines_and_both_settings():
    assert {s["engine"] for s in gpu_check.DRY_SCENARIOS} == {"accelerate", "trainer"}
    assert {s["expandable_segments"] for s in gpu_check.DRY_SCENARIOS} == {True, False}
    assert gpu_check.main(["--dry-run", "--only", "no-such-scenario"]) == 2


def cuda_result(peak: int, reserved: int, conf: str) -> dict:
    """What runners.verify answers for an ok CUDA run (runners.measure's keys)."""
    return {"status": "ok", "reason": None, "run_id": 7, "mode": "cuda", "child": {"wall_s": 9.5},
            "environment": {"cuda_alloc_conf": conf, "device": "NVIDIA H100 80GB HBM3"},
            "measured": {"peak_bytes": peak, "reserved_peak_bytes": reserved, "reserved_bytes": reserved - 2**20,
                         "cuda_context_bytes": 500 * 2**20, "cuda_context_after_run_bytes": 530 * 2**20,
                         "weights_bytes": 1000, "optimizer_state_bytes": 2000, "peak_phase": "backward",
                         "phase_peak_bytes": {"backward": peak}, "after_load_bytes": 1000, "step_wall_s": 0.2}}


PROBE = {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0], "total_bytes": 85520809984,
         "context_bytes": 480 * 2**20, "context_after_matmuls_bytes": 520 * 2**20,
         "workspace_main_thread_bytes": 32 * 2**20, "workspace_autograd_thread_bytes": 32 * 2**20}


def test_a_cuda_result_becomes_a_record_with_its_estimate_and_errors():
    spec = gpu_check.SCENARIOS[5]  # gpt2, fused AdamW, bf16 autocast
    planned = gpu_check.planner_record(spec, "cuda", "h100")
    assert planned["gpu"] == "h100" and planned["capacity_bytes"] == 81559 * 2**20
    # Replayed: the live tensors and torch's blocks, in the blocks the allocator hands out.
    assert planned["allocated_peak_bytes"] >= planned["peak_bytes"] + planned["allocator_overhead_bytes"]
    measured_peak = planned["allocated_peak_bytes"] * 100 // 101  # the planner 1% over
    record = gpu_check.scenario_record(spec, cuda_result(measured_peak, measured_peak * 11 // 10, "x"), planned,
                                       PROBE, "gpt2")
    assert set(record) == RECORD_KEYS and set(record["measured"]) == MEASURED_KEYS
    assert record["measured"]["cublas_workspace_bytes"] == 64 * 2**20
    assert record["errors"]["allocated_peak_pct"] == pytest.approx(1.0, abs=0.01)
    assert record["errors"]["reserved_over_allocated"] == pytest.approx(1.1, abs=1e-4)
    # The planner replays the caching allocator for this single-GPU plan (planner.device_fit).
    assert planned["reserved_peak_bytes"] >= planned["allocated_peak_bytes"]
    measured_reserved = measured_peak * 11 // 10
    assert record["errors"]["reserved_peak_pct"] == pytest.approx(
        100 * (planned["reserved_peak_bytes"] - measured_reserved) / measured_reserved, abs=0.001)
    skipped = gpu_check.skipped_record(gpu_check.SCENARIOS[6], "not started: over the time budget")
    failed = gpu_check.scenario_record(gpu_check.SCENARIOS[7], {"status": "failed", "reason": "RuntimeError: x"},
                                       {"error": "PlannerInputError: no"}, PROBE, "gpt2")
    summary = gpu_check.overheads_summary([record, skipped, failed], PROBE)
    assert summary["cublas_workspace"]["documented_bytes"] == 64 * 2**20  # 2 x 32 MiB on Hopper
    assert summary["cuda_context"]["after_run_measured_max_bytes"] == 530 * 2**20
    report = {"mode": "cuda", "gpu": "h100", "command": "bash benchmarks/gpu_check.sh", "elapsed_s": 1.0,
              "environment": gpu_check.environment_record(PROBE), "probe": PROBE, "scenarios": [record, skipped, failed],
              "subchecks": {}, "overheads": summary}
    table = gpu_check.render_markdown(report)
    assert "+1.00%" in table and "1.1000" in table and "64.0 MiB" in table
    assert "over the time budget" in table and "RuntimeError: x" in table and "PlannerInputError: no" in table
    json.dumps(report, allow_nan=False)  # what write_results stores


def test_the_time_guard_stops_starting_scenarios_and_bounds_each():
    now = [0.0]
    limits = []

    def measure(spec, timeout_s):
        limits.append(timeout_s)
        now[0] += 200.0  # each scenario takes 200 s
        return {"id": spec["id"], "status": "ok", "reason": None}

    saved = []
    records = gpu_check.run_scenarios(gpu_check.SCENARIOS[:4], measure, started=0.0, clock=lambda: now[0],
                                      start_limit_s=330.0, end_s=420.0, on_record=lambda r: saved.append(len(r)),
                                      log=lambda line: None)
    # started at 0 s and 200 s; at 400 s the start limit has passed
    assert [r["status"] for r in records] == ["ok", "ok", "skipped", "skipped"]
    assert "time budget" in records[2]["reason"] and set(records[2]) == RECORD_KEYS
    assert limits == [gpu_check.SCENARIO_TIMEOUT_S, 220.0 if 220.0 < gpu_check.SCENARIO_TIMEOUT_S
                      else gpu_check.SCENARIO_TIMEOUT_S]
    assert saved == [1, 2, 3, 4]  # results rewritten after every scenario
    now[0] = 400.0
    late = gpu_check.run_scenarios(gpu_check.SCENARIOS[:1], measure, started=0.0, clock=lambda: now[0],
                                   start_limit_s=410.0, end_s=420.0, log=lambda line: None)
    assert late[0]["status"] == "ok" and limits[-1] == gpu_check.MIN_SCENARIO_S


def test_sub_checks_out_of_time_are_not_started(tmp_path):
    results = gpu_check.run_subchecks(tmp_path, dry_run=True, started=0.0, clock=lambda: 455.0, end_s=460.0)
    assert all(r["returncode"] is None and "not started" in r["reason"] for r in results.values())


@pytest.mark.parametrize("name,total,key", [
    ("NVIDIA H100 80GB HBM3", 85520809984, "h100"), ("NVIDIA H200", 150754820096, "h200"),
    ("NVIDIA A100-SXM4-80GB", 85899345920, "a100-80gb"), ("NVIDIA A10", 23836098560, "a10"),
    ("NVIDIA L40S", 47697362944, "44.42"),  # not a planner GPU: its size
    ("NVIDIA H100 NVL", 99857989632, "93.00"),  # an H100 of another size: its size, not h100's capacity
])
def test_the_detected_gpu_maps_to_a_planner_key_or_its_size(name, total, key):
    assert gpu_check.planner_gpu(name, total) == key


def test_the_matrix_covers_every_technique_family_engine_and_allocator_setting():
    specs = gpu_check.SCENARIOS
    assert len(specs) >= 12 and len({s["id"] for s in specs}) == len(specs)
    families = {catalog_config(s["model"])["model_type"] for s in specs}
    assert len(families) >= 4
    values = [s["values"] for s in specs]
    assert {v["optimizer"] for v in values} >= {"adamw", "adamw-fused", "sgd", "adafactor", "hf-adafactor",
                                                 "adam8bit", "adamw8bit", "paged-adamw8bit"}
    assert {v.get("precision", "fp32") for v in values} == {"fp32", "bf16-mixed", "bf16", "fp16-mixed"}
    assert any(v.get("gradient_checkpointing") for v in values) and any(v.get("grad_accum", 1) > 1 for v in values)
    assert {v.get("attn", "sdpa") for v in values} == {"sdpa", "eager"}
    dropout = {catalog_config(s["model"]).get("attention_dropout", catalog_config(s["model"]).get("attn_pdrop", 0.0))
               > 0 for s in specs}
    assert dropout == {True, False}
    assert {s["engine"] for s in specs} == {"accelerate", "trainer"}
    assert {s["expandable_segments"] for s in specs} == {True, False}
    assert {v.get("finetune", "full") for v in values} == {"full", "lora", "qlora"}
    for s in specs:  # every scenario is one the runners accept (validated in this process)
        VerifyRequest(config=catalog_config(s["model"]), model_name=s["model"], scenario={**s["values"], "device": "cuda"},
                      mode=Mode.CUDA, engine=Engine(s["engine"]), steps=gpu_check.STEPS,
                      cuda_alloc_conf=gpu_check.EXPANDABLE_ON if s["expandable_segments"] else gpu_check.EXPANDABLE_OFF)


def test_a_sub_check_past_its_limit_is_stopped_with_what_it_started():
    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
              "print('started', flush=True); time.sleep(60)"
    done = gpu_check._run_subprocess([sys.executable, "-c", sleeper], timeout_s=2.0)
    assert done["returncode"] is None and "no result within 2 s" in done["reason"]
    assert "started" in done["output_tail"] and done["wall_s"] < 10  # the grandchild's pipe did not hold it


def test_an_8bit_scenario_without_bitsandbytes_is_skipped_at_once():
    eight_bit = next(s for s in gpu_check.SCENARIOS if s["values"]["optimizer"] == "paged-adamw8bit")
    assert "bitsandbytes is not installed" in gpu_check.missing_package(eight_bit, {"bitsandbytes": None})
    assert gpu_check.missing_package(eight_bit, {"bitsandbytes": "0.50.0"}) is None
    assert gpu_check.missing_package(gpu_check.SCENARIOS[0], {"bitsandbytes": None}) is None
    lora = next(s for s in gpu_check.SCENARIOS if s["values"].get("finetune") == "lora")
    qlora = next(s for s in gpu_check.SCENARIOS if s["values"].get("finetune") == "qlora")
    assert "peft is not installed" in gpu_check.missing_package(lora, {"peft": None, "bitsandbytes": "0.50.0"})
    assert gpu_check.missing_package(lora, {"peft": "0.21.2", "bitsandbytes": None}) is None
    assert "bitsandbytes is not installed" in gpu_check.missing_package(qlora, {"peft": "0.21.2", "bitsandbytes": None})


def test_the_probes_cuda_branch_runs_on_a_stand_in(monkeypatch, capsys):
    """The probe's GPU branch, every call in it, on CPU tensors behind a faked torch.cuda."""
    import torch

    allocated = [0]
    for name, value in {"is_available": lambda: True, "init": lambda: None, "synchronize": lambda: None,
                        "mem_get_info": lambda: (60 * 2**30, 80 * 2**30), "get_device_name": lambda: "Stand-in H100",
                        "get_device_capability": lambda: (9, 0), "memory_reserved": lambda: 2**30,
                        "memory_allocated": lambda: allocated[0],
                        "get_device_properties": lambda device: types.SimpleNamespace(multi_processor_count=132)
                        }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    exec(gpu_check.PROBE_CODE.replace('device="cuda"', 'device="cpu"'), {})
    probe = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert probe["gpu_name"] == "Stand-in H100" and probe["compute_capability"] == [9, 0]
    assert probe["multiprocessors"] == 132 and gpu_check.environment_record(probe)["multiprocessors"] == 132
    assert probe["context_bytes"] == 19 * 2**30 and probe["context_after_matmuls_bytes"] == 19 * 2**30
    assert {"workspace_main_thread_bytes", "workspace_lt_main_thread_bytes",
            "workspace_autograd_thread_bytes"} <= set(probe)
    assert {"transformers", "accelerate", "bitsandbytes", "cuda_version", "cudnn_version"} <= set(probe)


def test_an_expandable_scenario_is_planned_with_expandable_segments():
    """The run gets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, so the planner's reserved
    figure it is compared with must replay the allocator with them too."""
    from planner.cli import result_json

    spec = next(s for s in gpu_check.SCENARIOS if s["expandable_segments"] and s["model"] == "gpt2")
    planned = gpu_check.planner_record(spec, "cuda", "h100")
    values = {**spec["values"], "config": spec["model"], "device": "cuda", "engine": spec["engine"], "gpu": "h100"}
    expandable = result_json({**values, "cuda_alloc_conf": gpu_check.EXPANDABLE_ON}, base_dir=gpu_check.ROOT)
    assert expandable["scenario"]["cuda_alloc_conf"] == gpu_check.EXPANDABLE_ON
    assert planned["reserved_peak_bytes"] == expandable["reserved_peak_bytes"]
    assert planned["reserved_peak_bytes"] != result_json(values, base_dir=gpu_check.ROOT)["reserved_peak_bytes"]


def test_the_parallel_planner_hands_each_estimate_over_and_says_when_one_never_comes(tmp_path):
    """The estimates come from a process of their own (the GPU hidden from it): a scenario's
    record is the one planner_record gives, and an id it never plans is an error record
    once that process has ended, not a wait until the time budget runs out."""
    planner = gpu_check.ParallelPlanner([DRY_ONE], "cpu", "24", tmp_path)
    try:
        got = planner.record(DRY_ONE["id"], deadline_s=float("inf"))
        missing = planner.record("never-planned", deadline_s=float("inf"))
    finally:
        planner.stop()
    here = gpu_check.planner_record(DRY_ONE, "cpu", "24")
    for key in ("peak_bytes", "allocated_peak_bytes", "optimizer_state_bytes", "fits", "capacity_bytes"):
        assert got[key] == here[key], key
    assert missing["error"].startswith("the planner's process ended (exit status 0) without this scenario's estimate")
    assert gpu_check.PLANNER_ENV["CUDA_VISIBLE_DEVICES"] == ""  # no CUDA context beside the measured runs


def test_a_planner_that_falls_behind_the_time_budget_gives_an_error_record(tmp_path):
    # Asked at once, with the deadline passed: the process is still importing torch (seconds),
    # so nothing is written yet and the answer is the time budget's error.
    planner = gpu_check.ParallelPlanner([DRY_ONE], "cpu", "24", tmp_path)
    try:
        late = planner.record(DRY_ONE["id"], deadline_s=0.0, clock=lambda: 1.0)
    finally:
        planner.stop()
    assert late["error"].startswith("no estimate: the planner's process had not reached this scenario")
