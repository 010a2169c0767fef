"""The Multiple GPUs page through AppTest: it renders, its numbers are the planner's
(planner.parallel called directly, or bytes worked out from the parameter count), and
distributed runs in the history appear beside their estimates.

The run history is a fresh SQLite file per test (PLANNER_DATA_DIR).
"""

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from planner.catalog import CATALOG_DIR
from planner.loading import load_model_shape
from planner.parallel import parallel_estimate
from planner.scenario import scenario_from_values
from planner.strategy import ParallelPlan, Strategy
from planner.units import format_bytes
from runners.history import RunHistory
from views.inputs import DEFAULTS, GPU_PRESETS
from views.multi_gpu_figures import STRATEGY_ORDER

APP = Path(__file__).resolve().parents[1] / "app.py"
PAGE = "app_pages/multi_gpu.py"
TIMEOUT_S = 60
MODEL = DEFAULTS["catalog_model"]
SCENARIO_KEYS = ("task", "batch_size", "seq_len", "optimizer", "precision", "gradient_checkpointing",
                 "grad_accum", "attn", "device", "num_labels")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))


def page(**sidebar) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.run()
    at.switch_page(PAGE).run()
    for key, value in sidebar.items():
        widget = at.radio(key=key) if key == "device" else at.number_input(key=key)
        widget.set_value(value).run()
    assert not at.exception, at.exception
    return at


def values(**overrides) -> dict:
    return {key: DEFAULTS[key] for key in SCENARIO_KEYS} | overrides


def shape_and_scenario(**overrides):
    scenario = scenario_from_values(**values(**overrides))
    return load_model_shape(MODEL, scenario.task, scenario.num_labels), scenario


def chart(at: AppTest, index: int) -> dict:
    return json.loads(at.get("plotly_chart")[index].proto.spec)


def test_one_gpu_in_the_sidebar_is_the_pages_count_too():
    at = page()
    assert [n.key for n in at.number_input if "gpu" in n.key] == ["gpu_count"]  # no count of the page's own
    assert "The sidebar says 1 GPU" in at.info[0].value and not at.dataframe
    at.button(key="multi_gpu_use_several").click().run()
    assert not at.exception and at.number_input(key="gpu_count").value == 2
    assert "sidebar's **2** GPUs" in at.markdown[0].value
    assert list(at.dataframe[0].value["strategy"]) == [s.value for s in STRATEGY_ORDER]


def test_page_renders_for_two_gpus_with_the_planner_numbers():
    at = page(gpu_count=2)
    assert at.title[0].value == "Multiple GPUs"
    memory = at.dataframe[0].value
    assert list(memory["strategy"]) == [s.value for s in STRATEGY_ORDER]
    shape, scenario = shape_and_scenario()
    ddp = parallel_estimate(shape, scenario, ParallelPlan(2, Strategy.DDP))
    row = memory[memory["strategy"] == "ddp"].iloc[0]
    assert row["per-GPU peak"] == format_bytes(ddp.per_device_peak_bytes)
    assert int(row["per-GPU peak (bytes)"]) == ddp.per_device_peak_bytes
    assert row["fits"] == ("yes" if ddp.per_device_peak_bytes <= GPU_PRESETS[DEFAULTS["gpu_preset"]] else "no")
    full = memory[memory["strategy"] == "fsdp-full-shard"].iloc[0]
    assert full["weights"] == "sharded 2 ways" and row["weights"] == "replicated"
    # One stacked bar per strategy in each category trace, the capacity line drawn.
    bars = chart(at, 0)
    categories = [t for t in bars["data"] if not t["name"].startswith("capacity ")]
    assert len(categories) == 6 and all(len(t["x"]) == 6 for t in categories)
    assert [t["name"] for t in bars["data"] if t["name"].startswith("capacity ")]  # the line, in the legend
    assert len(at.get("plotly_chart")) == 3
    assert at.info and "No distributed runs" in at.info[0].value
    # Bytes are whole in every table, local SGD's averages per step (16,445,760.5 at K=16) too.
    for frame in at.dataframe:
        for column in (c for c in frame.value.columns if c.endswith("(bytes)")):
            assert all(float(v).is_integer() for v in frame.value[column].dropna()), column


def test_sidebar_gpu_count_is_used_when_above_one():
    at = page(gpu_count=4)
    shape, scenario = shape_and_scenario()
    zero3 = parallel_estimate(shape, scenario, ParallelPlan(4, Strategy.ZERO3))
    row = at.dataframe[0].value.set_index("strategy").loc["zero3"]
    assert row["optimizer state"] == "sharded 4 ways"
    assert int(row["per-GPU peak (bytes)"]) == zero3.per_device_peak_bytes


def test_local_sgd_chart_for_k8_is_an_eighth_of_the_parameters():
    # On CPU allocations are exact, so one averaging moves exactly the fp32 parameters.
    at = page(device="cpu", gpu_count=2)
    shape, _ = shape_and_scenario(device="cpu")
    parameter_bytes = shape.num_parameters * 4
    local = chart(at, 2)
    per_step = next(t for t in local["data"] if t["name"] == "local SGD, per optimizer step")
    k8 = per_step["x"].index("8")
    assert per_step["customdata"][k8][0] == parameter_bytes / 8
    over_run = next(t for t in local["data"] if t["name"].startswith("local SGD, over"))
    assert over_run["customdata"][k8][0] == (1000 // 8 + 1) * parameter_bytes  # every 8th micro-batch, and the end
    sgd = at.dataframe[3].value.set_index("average every K micro-batches")
    assert sgd.loc[8, "payload per step (bytes)"] == parameter_bytes / 8


def _record_ddp_run(history: RunHistory, shape, scenario, peak_bytes: int, payload_bytes: float) -> str:
    config = json.loads((CATALOG_DIR / f"{MODEL}.json").read_text())
    plan_values = {**values(device="cpu"), "engine": "accelerate", "model_config": config,
                   "strategy": "ddp", "num_devices": 2, "local_sgd_steps": None}
    estimate = parallel_estimate(shape, scenario, ParallelPlan(2, Strategy.DDP))
    run_id = history.start_run(MODEL, "cpu", plan_values, estimate.to_json())
    per_step = [{"all_reduce": {"calls": 8, "bytes": payload_bytes - 4096}, "broadcast": {"calls": 2, "bytes": 8192}},
                {"all_reduce": {"calls": 8, "bytes": payload_bytes - 4096}, "broadcast": {"calls": 1, "bytes": 4096}}]
    ranks = [{"rank": rank, "world_size": 2, "strategy": "ddp", "backend": "gloo", "distributed_type": "MULTI_CPU",
              "measured": {"peak_bytes": peak_bytes - 1000 * rank, "tracked_peak_bytes": peak_bytes - 1000 * rank,
                           "ddp_bucket_bytes": list(estimate.ddp_bucket_bytes), "comm_buffers_bytes": 0},
              "collectives_per_step": per_step, "collectives_total": {}, "replicas_equal": True} for rank in (0, 1)]
    history.finish_run(run_id, "ok", measurement={
        "status": "ok", "mode": "cpu", "strategy": "ddp", "num_processes": 2, "ranks": ranks,
        "replicas_equal": True, "max_rank_peak_bytes": peak_bytes,
        "comm_per_step": {"all_reduce": {"calls": 8.0, "bytes": float(payload_bytes - 4096)},
                          "broadcast": {"calls": 1.0, "bytes": 4096.0}},
        "comm_total": {}, "reason": None, "wall_s": 12.5, "returncode": 0, "stderr_tail": []})
    return run_id


def test_measured_table_shows_distributed_runs_of_this_model():
    shape, scenario = shape_and_scenario(device="cpu")
    estimate = parallel_estimate(shape, scenario, ParallelPlan(2, Strategy.DDP))
    measured_peak = round(estimate.per_device_peak_bytes / 1.02)
    history = RunHistory()
    _record_ddp_run(history, shape, scenario, measured_peak, estimate.comm_bytes_per_step)
    single = history.start_run(MODEL, "cpu", {**values(), "engine": "accelerate"}, {})
    history.finish_run(single, "ok", measurement={"peak_bytes": 1})  # one device: not shown here
    at = page(gpu_count=2)
    assert not at.info or all("No distributed runs" not in i.value for i in at.info)
    measured = at.dataframe[-1].value
    assert len(measured) == 1
    row = measured.iloc[0]
    assert row["strategy"] == "ddp" and row["ranks"] == 2 and row["mode"] == "cpu"
    assert int(row["estimated per-GPU peak (bytes)"]) == estimate.per_device_peak_bytes
    assert int(row["measured max rank peak (bytes)"]) == measured_peak
    assert row["peak error (%)"] == pytest.approx(2.0, abs=1e-3)
    assert row["measured payload per step (bytes)"] == pytest.approx(estimate.comm_bytes_per_step)
    assert row["payload error (%)"] == pytest.approx(0.0, abs=1e-9)


def test_a_large_model_opens_without_an_error_and_says_why_it_cannot_be_verified():
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S).run()
    at.selectbox(key="catalog_model").set_value("llama-2-7b").run()
    at.number_input(key="gpu_count").set_value(2).run()
    at.switch_page(PAGE).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(c.value.startswith("Not verifiable as chosen: ") for c in at.caption)
    assert at.button(key="mgpu_verify_run").disabled
