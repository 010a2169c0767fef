"""The exported report's "Multiple GPUs" section (reporting.multi_gpu): present in all four
formats when the report is for more than one GPU and absent for one; its numbers are the
planner's (planner.parallel called directly, or bytes worked out from the catalog's
published parameter count); distributed runs from the history listed beside their
estimates, user strings escaped.

The run history is a fresh SQLite file per test (PLANNER_DATA_DIR).
"""

import html
import json

import pytest

from planner.catalog import CATALOG_DIR
from planner.loading import load_model_shape
from planner.parallel import parallel_estimate
from planner.scenario import scenario_from_values
from planner.strategy import ParallelPlan, Strategy
from reporting import build_report, render_report, report_for_values
from reporting.build import FORMATS
from reporting.cli import main
from runners.history import RunHistory

MODEL = "llama-2-7b"
GPUS = 8
VALUES = {"config": MODEL, "task": "causal-lm", "batch_size": "1", "seq_len": "2048", "optimizer": "adamw",
          "precision": "bf16-mixed", "gradient_checkpointing": True, "grad_accum": "1", "attn": "sdpa",
          "device": "cuda", "num_labels": "2", "engine": "accelerate", "gpu": "H100 · 80 GB", "hub": False}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp-shard-grad-op", "fsdp-full-shard")
HEADING = "Multiple GPUs"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    report = report_for_values({**VALUES, "gpu_count": str(GPUS)})
    return {fmt: render_report(report, fmt) for fmt in FORMATS}


def llama_and_scenario():
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=2048, optimizer="adamw",
                                    precision="bf16-mixed", gradient_checkpointing=True, grad_accum=1)
    return load_model_shape(MODEL, scenario.task), scenario


def test_every_format_has_the_section(rendered):
    text = rendered["html"]
    assert f"<h2>{HEADING} ({GPUS} × H100 · 80 GB)</h2>" in text
    section = text[text.index(f"<h2>{HEADING}"):text.index("<h2>Verification runs")]
    assert all(f"<td>{s}</td>" in section for s in STRATEGIES)
    assert "Plotly.newPlot" in section and "Per-GPU memory at the peak on 8 GPUs" in section
    assert "<script src=" not in text and text.count("plotly.js v") == 1  # plotly.js inline, once
    assert "&lt;NA&gt;" not in section
    markdown = rendered["md"]
    assert f"## {HEADING} ({GPUS} × H100 · 80 GB)" in markdown
    for heading in ("### Memory per GPU, by strategy", "### Traffic per optimizer step, by strategy",
                    "### DDP against local SGD", "### Distributed runs of this model"):
        assert heading in markdown
    assert markdown.index(f"## {HEADING}") < markdown.index("## Verification runs")
    rows = [line.split(",") for line in rendered["csv"].splitlines()[1:]]
    sections = {row[0] for row in rows}
    assert {"multi-GPU memory", "multi-GPU traffic", "multi-GPU local SGD"} <= sections
    assert "multi-GPU runs" not in sections  # no distributed runs in a fresh history
    assert sum(row[0] == "multi-GPU memory" for row in rows) == len(STRATEGIES)
    data = json.loads(rendered["json"])
    assert data["multi_gpu"]["num_devices"] == GPUS and list(data["multi_gpu"]["strategies"]) == list(STRATEGIES)
    assert data["multi_gpu"]["measured_runs"] == []


def test_json_per_gpu_numbers_are_the_planners(rendered):
    shape, scenario = llama_and_scenario()
    section = json.loads(rendered["json"])["multi_gpu"]
    capacity = section["capacity_bytes"]
    assert capacity == 81559 * 2**20  # the H100 preset
    for value in STRATEGIES:
        expected = parallel_estimate(shape, scenario, ParallelPlan(GPUS, Strategy(value)))
        got = section["strategies"][value]
        assert got["per_device_peak_bytes"] == expected.per_device_peak_bytes
        assert got["placement"] == expected.placement
        assert got["largest_gathered_unit_bytes"] == expected.largest_gathered_unit_bytes
        assert got["comm_bytes_per_step"] == expected.comm_bytes_per_step
        assert got["comm_wire_bytes_per_step"] == expected.comm_wire_bytes_per_step
        assert got["fits"] is (expected.per_device_peak_bytes <= capacity)
    assert section["strategies"]["ddp"]["fits"] is False  # 7B with AdamW replicated: over 80 GB
    assert section["strategies"]["fsdp-full-shard"]["fits"] is True
    ddp = parallel_estimate(shape, scenario, ParallelPlan(GPUS, Strategy.DDP)).per_device_peak_bytes
    markdown = rendered["md"]
    assert f"| ddp | {ddp / 2**30:,.2f} GiB | {ddp} |" in markdown


def test_local_sgd_bytes_come_from_the_published_parameter_count(rendered):
    published = json.loads((CATALOG_DIR / "index.json").read_text())[MODEL]["published_params"]
    fp32_master = 4  # bf16-mixed keeps fp32 parameters: local SGD averages 4 bytes each
    local = json.loads(rendered["json"])["multi_gpu"]["local_sgd"]
    assert local["run_steps"] == 1000
    assert [p["k"] for p in local["periods"]] == [1, 2, 4, 8, 16, 32]
    k8 = next(p for p in local["periods"] if p["k"] == 8)
    assert k8["payload_per_step_bytes"] == published * fp32_master / 8
    assert k8["payload_over_run_bytes"] == (1000 // 8 + 1) * published * fp32_master  # every 8th, and at the end
    ddp = local["ddp"]["payload_per_step_bytes"]
    assert k8["saving_vs_ddp_per_step_pct"] == pytest.approx((1 - published * fp32_master / 8 / ddp) * 100)
    assert f"| 8 | 3.14 GiB | {published * fp32_master // 8} |" in rendered["md"]


def test_one_gpu_has_no_section():
    # What fits' LoRA search is not what is tested here (it probes the adapters' step on first use).
    report = report_for_values({**VALUES, "gpu_count": "1", "search_adapters": False})
    assert report.multi_gpu is None
    text = {fmt: render_report(report, fmt) for fmt in FORMATS}
    assert "multi_gpu" not in json.loads(text["json"])
    assert HEADING not in text["md"] and HEADING not in text["html"]
    assert "multi-GPU" not in text["csv"]


def test_cli_flags_run_steps_and_an_extra_local_sgd_period(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--config", "gpt2", "--task", "causal-lm", "--batch-size", "2", "--seq-len", "128",
            "--gpu", "24", "--gpu-count", "4", "--out", str(out)]
    assert main([*argv, "--run-steps", "500", "--local-sgd-steps", "64"]) == 0
    local = json.loads(out.read_text())["multi_gpu"]["local_sgd"]
    assert local["run_steps"] == 500 and [p["k"] for p in local["periods"]] == [1, 2, 4, 8, 16, 32, 64]
    assert main([*argv, "--run-steps", "0"]) == 2
    assert "--run-steps" in capsys.readouterr().err
    assert main([*argv, "--local-sgd-steps", "0"]) == 2
    assert "--local-sgd-steps" in capsys.readouterr().err


def _record_distributed_run(history: RunHistory, shape, scenario, strategy: str, peak_bytes: int,
                            payload_bytes: float) -> None:
    config = json.loads((CATALOG_DIR / "gpt2.json").read_text())
    plan_values = {"task": "causal-lm", "batch_size": scenario.batch_size, "seq_len": scenario.seq_len,
                   "optimizer": "adamw", "precision": "fp32", "gradient_checkpointing": False, "grad_accum": 1,
                   "attn": "sdpa", "device": "cpu", "num_labels": 2, "engine": "accelerate", "model_config": config,
                   "strategy": strategy, "num_devices": 2, "local_sgd_steps": None}
    run_id = history.start_run("gpt2", "cpu", plan_values, {})
    history.finish_run(run_id, "ok", measurement={
        "status": "ok", "mode": "cpu", "strategy": strategy, "num_processes": 2,
        "ranks": [{"rank": 0}, {"rank": 1}], "max_rank_peak_bytes": peak_bytes,
        "comm_per_step": {"all_reduce": {"calls": 8.0, "bytes": float(payload_bytes)}}})


def test_distributed_runs_from_the_history_beside_their_estimates():
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=128, device="cpu")
    shape = load_model_shape("gpt2", scenario.task)
    estimate = parallel_estimate(shape, scenario, ParallelPlan(2, Strategy.DDP))
    history = RunHistory()
    _record_distributed_run(history, shape, scenario, "<script>alert(1)</script>", 1000, 10.0)
    _record_distributed_run(history, shape, scenario, "ddp", round(estimate.per_device_peak_bytes / 1.02),
                            estimate.comm_bytes_per_step)
    single = history.start_run("gpt2", "cpu", {"task": "causal-lm"}, {})
    history.finish_run(single, "ok", measurement={"peak_bytes": 1})  # one device: not listed
    values = {"task": "causal-lm", "batch_size": 2, "seq_len": 128, "device": "cpu"}
    report = build_report(shape, values, 24 * 2**30, "24 GiB", 2, history.list_runs(limit=None))
    runs = json.loads(render_report(report, "json"))["multi_gpu"]["measured_runs"]
    assert len(runs) == 2
    ddp = next(r for r in runs if r["strategy"] == "ddp")
    assert ddp["estimated per-GPU peak (bytes)"] == estimate.per_device_peak_bytes
    assert ddp["peak error (%)"] == pytest.approx(2.0, abs=1e-3)
    assert ddp["payload error (%)"] == pytest.approx(0.0, abs=1e-9)
    hostile = next(r for r in runs if r["strategy"] != "ddp")
    assert hostile["estimated per-GPU peak (bytes)"] is None and hostile["note"].startswith("not estimable")
    text = render_report(report, "html")
    assert "<script>alert(1)</script>" not in text and html.escape("<script>alert(1)</script>") in text
    assert "\\<script\\>alert(1)\\</script\\>" in render_report(report, "md")
    assert "multi-GPU runs" in {line.split(",")[0] for line in render_report(report, "csv").splitlines()}
