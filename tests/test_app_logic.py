"""The dashboard's plain modules added for the Plan, Techniques, Verify and Report pages:
fit search, technique comparison, query-string state, the run queue, verification result
shaping and the report builder. No Streamlit here; numbers are checked against
planner.estimate called directly."""

import dataclasses
import html
import json
import math
import random
import re
import threading
import time
from datetime import datetime, timezone

import pytest

from planner.fit import fit_limits, largest_fitting, max_batch_size, max_seq_len
from app_pages.query_state import decode, encode
from app_pages.run_queue import CANCELLED, DONE, RunQueue, progress_fraction
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.gpus import GPUS
from planner.loading import load_model_shape
from planner.scenario import scenario_from_values
from planner.strategy import ParallelPlan, Strategy
from planner.units import GIB, MIB
from reporting import build_report, render_report, report_for_values, write_report
from runners.history import RunMode, RunRecord, RunStatus
from views.comparison import (
    chart_base,
    TECHNIQUES,
    TECHNIQUES_BY_KEY,
    accumulation_steps_for,
    batch_sizes_for_chart,
    compare_techniques,
    comparison_table,
    matching_run,
    memory_vs_batch,
    memory_vs_batch_known,
    saving_pct,
    series_within,
    technique_values,
)
from views.inputs import DEFAULTS, SidebarValues, base_values, total_capacity_bytes
from views.verify_results import (
    category_values,
    filter_history,
    history_table,
    plan_request,
    scatter_points,
    technique_requests,
)

BASE = {"task": "causal-lm", "num_labels": 2, "batch_size": 8, "seq_len": 512, "optimizer": "sgd",
        "precision": "bf16", "gradient_checkpointing": True, "grad_accum": 2, "attn": "sdpa", "device": "cuda"}


@pytest.fixture(scope="module")
def gpt2():
    return load_model_shape("gpt2", scenario_from_values(task="causal-lm", batch_size=1, seq_len=1).task)


def peak(shape, **values):
    return estimate(shape, scenario_from_values(**({**BASE, **values}))).peak_bytes


# --- fit search -----------------------------------------------------------------------------

@pytest.mark.parametrize("threshold", [1, 2, 3, 7, 64, 65, 1000, 1023, 1024])
def test_largest_fitting_is_exact_on_a_step_function(threshold):
    calls = []

    def peak_for(n):
        calls.append(n)
        return n * 10

    assert largest_fitting(peak_for, threshold * 10, limit=1024) == threshold
    assert len(calls) <= 2 * 11 + 1  # doubling then bisection: logarithmic


def test_largest_fitting_none_and_limit():
    assert largest_fitting(lambda n: 100, 99, 1000) is None
    assert largest_fitting(lambda n: 1, 10, 37) == 37  # everything fits: the limit
    assert largest_fitting(lambda n: None if n > 5 else 0, 10, 1000) == 5  # None counts as not fitting


def test_the_costlier_test_is_searched_exactly_and_in_few_calls_below_the_peaks_answer():
    """largest_fitting's second test (the replayed allocator) against brute force: every peak
    answer, every point below it where the second test starts failing, with and without a known
    fit; the calls stay logarithmic in the distance below the peak's answer."""
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    print(f"seed {seed}")
    for _ in range(400):
        peak_answer = rng.randint(1, 3000)
        passes_up_to = rng.choice([peak_answer, peak_answer - 1, rng.randint(0, peak_answer)])
        known = rng.choice([1, rng.randint(1, max(1, passes_up_to))])
        calls = []

        def passes(n):
            calls.append(n)
            assert 1 <= n <= peak_answer
            return n <= passes_up_to

        found = largest_fitting(lambda n: n, peak_answer, 4096, known_fit=known, passes=passes)
        assert found == (passes_up_to or None), (seed, peak_answer, passes_up_to, known)
        distance = peak_answer - passes_up_to
        assert len(calls) <= 2 * math.log2(distance + 1) + 2, (seed, peak_answer, passes_up_to, known, calls)


def _headroom_trials(seed: int, rooms: str):
    """(peak_answer, boundary, known fit, largest_fitting's answer, the n it tested) for 300
    random searches whose costlier test passes up to `boundary`, answering the room left:
    "smooth", the live peak's bytes plus a fragmentation that grows with n, against a
    capacity between the boundary's need and the next one's; "understated", the same but a
    failing test's shortfall is a random 5-100% of it (a replay stops at its first request
    that does not fit: planner.cuda_allocator, Headroom); "adversarial", a random magnitude
    of the right sign."""
    from planner.device_fit import Headroom

    rng = random.Random(seed)
    for _ in range(300):
        peak_answer = rng.randint(2, 6000)
        boundary = rng.choice([peak_answer - 1, rng.randint(0, peak_answer - 1), int(peak_answer * 0.8)])
        known = rng.choice([1, rng.randint(1, max(1, boundary))])
        per_unit = rng.randint(10**5, 10**7)  # live bytes per sequence or token
        growth = rng.uniform(0.0, 0.3) / peak_answer  # fragmentation's share grows with n

        def need(n):
            return int(per_unit * n * (1 + growth * n)) + 3 * 2**20

        capacity = need(boundary) + rng.randrange(need(boundary + 1) - need(boundary))
        calls = []

        def passes(n):
            calls.append(n)
            assert 1 <= n <= peak_answer
            if rooms == "adversarial":
                room = rng.randint(0, 10**12) if n <= boundary else -rng.randint(1, 10**12)
            else:
                room = capacity - need(n)
                if rooms == "understated" and room < 0:  # a failing replay stops at its first shortfall
                    room = min(-1, int(room * rng.uniform(0.05, 1.0)))
            return Headroom(n <= boundary, room)

        found = largest_fitting(lambda n: per_unit * n, per_unit * peak_answer, 1 << 20, known_fit=known,
                                passes=passes)
        yield peak_answer, boundary, known, found, calls


@pytest.mark.parametrize("rooms, mean_at_most, most", [("smooth", 5.0, 12), ("understated", 7.5, 30)])
def test_measured_rooms_find_the_same_answer_in_a_few_tests(rooms, mean_at_most, most):
    """With the replay's headroom (planner.device_fit.Headroom), the search lands on the same
    boundary as bisection would, in few tests where the room is the smooth function of n a
    step's tensors give it (on average at most 5, or 7.5 with understated shortfalls), where
    stepping down from the peak's answer takes up to 2·log2 of the distance (25 here)."""
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    counts = []
    for peak_answer, boundary, known, found, calls in _headroom_trials(seed, rooms):
        assert found == (boundary or None), (seed, peak_answer, boundary, known, calls)
        assert len(calls) <= most, (seed, peak_answer, boundary, known, calls)
        counts.append(len(calls))
    assert sum(counts) / len(counts) <= mean_at_most, (seed, sum(counts) / len(counts))


def test_misleading_rooms_still_find_the_answer_in_logarithmic_tests():
    """Rooms of the right sign but any size: the answer is still the test's boundary, in at
    most about 3·log2 of the range searched: the step down from the failing end doubles, and
    after two aims that do not halve the bracket the next test bisects it."""
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    for peak_answer, boundary, known, found, calls in _headroom_trials(seed, "adversarial"):
        assert found == (boundary or None), (seed, peak_answer, boundary, known, calls)
        assert len(calls) <= 3 * math.log2(peak_answer + 1) + 3, (seed, peak_answer, boundary, known, calls)


def test_max_batch_size_is_the_boundary(gpt2):
    scenario = scenario_from_values(**BASE)
    capacity = 16 * GIB
    best = max_batch_size(gpt2, scenario, capacity)
    assert peak(gpt2, batch_size=best) <= capacity < peak(gpt2, batch_size=best + 1)
    assert max_batch_size(gpt2, scenario, MIB) is None


def test_max_seq_len_is_the_boundary_or_the_positions(gpt2):
    scenario = scenario_from_values(**{**BASE, "batch_size": 64})
    capacity = 16 * GIB
    best = max_seq_len(gpt2, scenario, capacity)
    assert best < gpt2.max_positions
    assert peak(gpt2, batch_size=64, seq_len=best) <= capacity < peak(gpt2, batch_size=64, seq_len=best + 1)
    roomy = fit_limits(gpt2, scenario_from_values(**BASE), 80 * GIB)
    assert roomy.seq_len == gpt2.max_positions and roomy.seq_len_capped_by_positions


# --- techniques -------------------------------------------------------------------------------

def test_every_lesson_technique_is_listed():
    keys = {t.key for t in TECHNIQUES}
    assert {"baseline", "adafactor", "adam8bit", "bf16", "checkpointing", "accumulation"} <= keys
    assert any("+" in k for k in keys)  # combinations
    assert "33%" in TECHNIQUES_BY_KEY["checkpointing"].cost
    assert "approximation" in TECHNIQUES_BY_KEY["adafactor"].cost


def test_technique_values_replace_the_sidebar_techniques_with_the_baseline():
    assert technique_values(BASE, TECHNIQUES_BY_KEY["baseline"]) == {
        **BASE, "optimizer": "adamw", "precision": "fp32", "gradient_checkpointing": False, "grad_accum": 1}
    assert technique_values(BASE, TECHNIQUES_BY_KEY["adam8bit"])["optimizer"] == "adam8bit"
    accumulated = technique_values(BASE, TECHNIQUES_BY_KEY["accumulation"])
    assert accumulated["batch_size"] * accumulated["grad_accum"] == BASE["batch_size"]  # same effective batch
    assert (accumulated["batch_size"], accumulated["grad_accum"]) == (2, 4)
    assert [accumulation_steps_for(b) for b in (1, 2, 3, 6, 8)] == [1, 2, 1, 2, 4]


def test_comparison_rows_match_the_planner_and_savings(gpt2):
    rows = compare_techniques(gpt2, BASE)
    assert [r.technique for r in rows] == list(TECHNIQUES)
    for row in rows:
        assert row.peak_bytes == estimate(gpt2, scenario_from_values(**row.values)).peak_bytes
        assert row.measured_peak_bytes is None
    table = comparison_table(rows, 16 * GIB)
    baseline = rows[0].peak_bytes
    assert table["saving vs baseline (%)"].iloc[0] == 0
    for row, saving in zip(rows, table["saving vs baseline (%)"]):
        assert saving == pytest.approx((baseline - row.peak_bytes) / baseline * 100)
    assert list(table["fits"]) == [r.peak_bytes <= 16 * GIB for r in rows]
    assert saving_pct(None, 3) is None


def record(model="gpt2", status="ok", measured=123, created=None, **scenario):
    values = {**technique_values(BASE, TECHNIQUES_BY_KEY["baseline"]), "engine": "accelerate", **scenario}
    return RunRecord(id=f"r{measured}", model_name=model, mode=RunMode.SIMULATE, status=RunStatus(status),
                     created_at=created or datetime(2026, 1, 1, tzinfo=timezone.utc),
                     finished_at=datetime(2026, 1, 1, tzinfo=timezone.utc), scenario=values,
                     estimate={"peak_bytes": 100, "peak_breakdown_bytes": {}},
                     measurement={"peak_bytes": measured} if measured else None, environment=None, reason=None)


def test_matching_run_takes_exactly_that_scenario(gpt2):
    baseline = technique_values(BASE, TECHNIQUES_BY_KEY["baseline"])
    other = record(batch_size=4, measured=1)
    failed = record(status="failed", measured=None)
    wrong_model = record(model="opt-125m", measured=2)
    good = record(measured=3, device="cpu")  # measured on another device kind still matches
    assert matching_run([other, failed, wrong_model, good], "gpt2", None, baseline) is good
    assert matching_run([other], "gpt2", None, baseline) is None
    rows = compare_techniques(gpt2, BASE, [other, good])
    assert rows[0].measured_peak_bytes == 3 and rows[0].measured_mode == "simulate"
    assert all(r.measured_peak_bytes is None for r in rows[1:])


def test_memory_vs_batch_series(gpt2):
    sizes = batch_sizes_for_chart(40)
    assert sizes == [1, 2, 4, 8, 16, 32, 64]
    series = memory_vs_batch(gpt2, BASE, sizes)
    assert "Gradient accumulation (same effective batch)" not in series
    base_line = series["AdamW fp32 (baseline)"]
    assert [b for b, _ in base_line] == sizes
    assert base_line[3][1] == peak(gpt2, batch_size=8, optimizer="adamw", precision="fp32",
                                   gradient_checkpointing=False, grad_accum=1)
    assert all(p1 < p2 for (_, p1), (_, p2) in zip(base_line, base_line[1:]))


def test_chart_base_keys_exactly_what_the_series_follow_from(gpt2):
    # The Plan page caches the lines by chart_base: scenarios with the same key must draw the
    # same lines, and a change that moves them (the sequence) must change the key.
    sizes = [1, 4, 16]
    other = {**BASE, "batch_size": 3, "optimizer": "adafactor", "precision": "bf16-mixed",
             "gradient_checkpointing": True, "grad_accum": 4}
    assert chart_base(other) == chart_base(BASE)
    assert memory_vs_batch(gpt2, other, sizes) == memory_vs_batch(gpt2, BASE, sizes)
    longer = {**BASE, "seq_len": 1024}
    assert chart_base(longer) != chart_base(BASE)
    assert memory_vs_batch(gpt2, longer, sizes) != memory_vs_batch(gpt2, BASE, sizes)


def test_lines_cut_from_every_chart_size_are_the_lines_drawn_for_fewer(gpt2):
    # The Plan page keeps each model's lines at every size a chart may show and cuts them to the
    # sizes it draws: the same points as estimating those sizes alone, and a technique whose
    # probe is missing is still named, with only its missing sizes among those drawn.
    every = (1, 2, 4, 8, 16, 32, 64, 128)
    series, unprobed = memory_vs_batch_known(gpt2, BASE, every)
    for largest in (3, 40):
        sizes = batch_sizes_for_chart(largest, at_least=4)
        assert series_within(series, unprobed, sizes) == memory_vs_batch_known(gpt2, BASE, sizes)
    technique = TECHNIQUES[0]
    kept, left_out = series_within({"a": [(1, 5), (8, None)], "b": [(64, 7)]}, [(technique, (1, 64))], [1, 2, 8])
    assert kept == {"a": [(1, 5), (8, None)]} and left_out == ((technique, (1,)),)
    assert series_within({}, [(technique, (64,))], [1, 2]) == ({}, ())


# --- shared controls --------------------------------------------------------------------------

def test_query_string_round_trip():
    values = {**DEFAULTS, "catalog_model": "gpt2", "task": "causal-lm", "batch_size": 3,
              "gradient_checkpointing": True, "gpu_preset": "H200 · 141 GB", "gpu_count": 8, "gpu_custom_gib": 2.5}
    params = encode(values)
    assert "seq_len" not in params  # defaults stay out of the link
    assert params["gradient_checkpointing"] == "true" and params["gpu_count"] == "8"
    assert decode(params) == {k: v for k, v in values.items() if DEFAULTS[k] != v}


def test_a_stored_upload_and_a_hub_id_travel_in_the_link():
    digest = "0123456789abcdef" * 4
    values = {**DEFAULTS, "model_source": "upload", "config_hash": digest}
    assert encode(values) == {"model_source": "upload", "config_hash": digest}
    assert decode(encode(values)) == {"model_source": "upload", "config_hash": digest}
    assert decode({"config_hash": digest.upper()}) == {"config_hash": digest}
    hub = {**DEFAULTS, "model_source": "hub", "hub_model_id": "mistralai/Mistral-7B-v0.1"}
    assert decode(encode(hub)) == {"model_source": "hub", "hub_model_id": "mistralai/Mistral-7B-v0.1"}
    assert encode({**values, "model_source": "catalog"}) == {}  # a hash only with its source
    assert encode({**hub, "model_source": "upload"}) == {"model_source": "upload"}


@pytest.mark.parametrize("params", [
    {"config_hash": "../../etc/passwd"}, {"config_hash": "ab" * 31}, {"config_hash": "zz" * 32},
    {"config_hash": "ab" * 32 + ".json"}, {"hub_model_id": "../secrets"}, {"hub_model_id": "a/b/c"},
    {"hub_model_id": "owner/x?y=1"}, {"hub_model_id": "-x/y"}, {"model_source": "ftp"},
    {"batch_size": "0"}, {"batch_size": "-3"}, {"batch_size": "x"}, {"catalog_model": "no-such"},
    {"optimizer": "lion"}, {"gpu_custom_gib": "nan"}, {"gpu_custom_gib": "0"}, {"gradient_checkpointing": "maybe"},
    {"unknown": "1"}, {"gpu_preset": "TPU"}, {"gpu_count": "5000"}, {"task": "regression"},
])
def test_bad_query_values_are_dropped(params):
    assert decode(params) == {}


def test_total_capacity_scales_with_the_gpu_count():
    values = dataclasses.replace(SidebarValues.from_state({}), gpu_count=4)
    assert total_capacity_bytes(values) == 4 * 15 * GIB
    with pytest.raises(PlannerInputError, match="number of GPUs"):
        total_capacity_bytes(dataclasses.replace(values, gpu_count=0))
    assert base_values(values)["batch_size"] == DEFAULTS["batch_size"]


# --- run queue --------------------------------------------------------------------------------

def fake_runner(gate=None, log=None):
    def run(request, timeout_s, on_progress, history, cancel=None):
        if log is not None:
            log.append(request.model_name)
        on_progress({"stage": "building"})
        if gate is not None:
            gate.wait(5)
        for step in (1, 2, 3):
            on_progress({"stage": "step", "step": step, "steps": 3})
        if request.model_name == "bad":
            raise PlannerInputError("bad model")
        return {"status": "ok", "mode": "simulate", "estimated": {"peak_bytes": 10}, "measured": {"peak_bytes": 11},
                "reason": None}
    return run


def tiny_request(name="tiny"):
    from tests.conftest import tiny_config
    return plan_request(tiny_config("tiny-llama"), name, {**BASE, "batch_size": 2, "seq_len": 64,
                                                          "gradient_checkpointing": False, "precision": "fp32",
                                                          "optimizer": "adamw", "grad_accum": 1}, "simulate", 2)


def test_queue_runs_one_at_a_time_in_order_and_sessions_see_their_own():
    gate, order = threading.Event(), []
    queue = RunQueue(runner=fake_runner(gate, order))
    first = queue.submit("alice", "one", tiny_request("a1"))
    queue.submit("bob", "two", tiny_request("b1"))
    third = queue.submit("alice", "three", tiny_request("a2"))
    deadline = time.time() + 5
    while queue.jobs("alice")[0].position != 0 and time.time() < deadline:
        time.sleep(0.01)
    alice = queue.jobs("alice")
    assert [v.job.label for v in alice] == ["one", "three"]
    assert [v.position for v in alice] == [0, 2]  # bob's run waits between them
    assert [v.job.label for v in queue.jobs("bob")] == ["two"]
    assert queue.cancel("bob", third) is False  # not bob's
    gate.set()
    assert queue.wait_idle(5)
    assert order == ["a1", "b1", "a2"]
    done = queue.jobs("alice")
    assert all(v.job.state == DONE and v.position is None and v.job.status == "ok" for v in done)
    assert done[0].job.fraction == 1.0 and "step 3 of 3" in done[0].job.log
    assert first == done[0].job.id


def test_queue_cancel_waiting_and_errors_do_not_stop_the_worker():
    gate = threading.Event()
    queue = RunQueue(runner=fake_runner(gate))
    queue.submit("s", "running", tiny_request())
    waiting = queue.submit("s", "waiting", tiny_request())
    queue.submit("s", "broken", tiny_request("bad"))
    assert queue.cancel("s", waiting)
    gate.set()
    assert queue.wait_idle(5)
    jobs = {v.job.label: v.job for v in queue.jobs("s")}
    assert jobs["waiting"].state == CANCELLED
    assert jobs["broken"].status == "error" and jobs["broken"].error == "bad model"
    assert jobs["running"].status == "ok"
    queue.clear_finished("s")
    assert queue.jobs("s") == []


def test_progress_fraction():
    assert progress_fraction({"stage": "step", "step": 3, "steps": 3}) == (0.9, "step 3 of 3")
    assert progress_fraction({"stage": "measuring"})[0] > 0.9
    assert progress_fraction({})[1] == "working"


# --- verification results ---------------------------------------------------------------------

def test_technique_requests_one_per_technique():
    from tests.conftest import tiny_config
    requests = technique_requests(tiny_config("tiny-llama"), "tiny", {**BASE, "batch_size": 4, "seq_len": 32},
                                  "simulate", 2)
    assert [label for label, _ in requests] == [t.label for t in TECHNIQUES]
    assert all(r.mode.value == "simulate" and r.steps == 2 for _, r in requests)
    with pytest.raises(PlannerInputError):
        plan_request({}, "x", {**BASE, "batch_size": 0}, "simulate", 2)


def test_history_table_filter_and_scatter():
    records = [record(measured=200), record(model="opt-125m", measured=90), record(status="failed", measured=None)]
    table = history_table(records)
    assert list(table["status"]) == ["ok", "ok", "failed"]
    assert table["error (%)"].iloc[0] == pytest.approx(-50.0)  # estimate 100, measured 200
    assert list(filter_history(table, models=["opt-125m"])["model"]) == ["opt-125m"]
    assert len(filter_history(table, statuses=["ok"], modes=["simulate"])) == 2
    estimated, measured, labels = scatter_points(table)
    assert estimated == [100, 100] and measured == [200, 90] and len(labels) == 2
    assert history_table([]).empty


def test_category_values():
    estimated = {"peak_bytes": 10, "peak_breakdown_bytes": {"weights": 1, "gradients": 2, "optimizer_state": 3,
                                                            "activations": 4, "temporaries": 0}}
    est, meas = category_values(estimated, {"weights_bytes": 1, "peak_bytes": 9})
    assert est["peak"] == 10 and est["activations"] == 4
    assert meas["weights"] == 1 and meas["gradients"] is None and meas["peak"] == 9


# --- report -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report(gpt2):
    evil = dataclasses.replace(gpt2, name="<script>alert(1)</script>|x")
    runs = [record(model=evil.name, measured=123456)]
    return build_report(evil, {**BASE, "optimizer": "adamw"}, 16 * GIB, "T4 · 16 GB", 2, runs)


def test_report_json_holds_the_plan(report):
    data = json.loads(render_report(report, "json"))
    assert data["plan"]["estimate"]["peak_bytes"] == report.estimate.peak_bytes
    assert data["plan"]["estimate"]["per_device_peak_bytes"] == report.per_device.per_device_peak_bytes
    assert data["plan"]["estimate"]["strategy"] == "ddp"
    assert data["plan"]["largest_batch_size"] == report.limits.batch_size
    assert data["plan"]["total_capacity_bytes"] == 32 * GIB
    assert [t["key"] for t in data["techniques"]] == [t.key for t in TECHNIQUES]
    assert data["runs"][0]["measured peak (bytes)"] == 123456


def test_report_html_is_self_contained_and_escaped(report):
    text = render_report(report, "html")
    assert "<script>alert(1)</script>" not in text
    assert html.escape("<script>alert(1)</script>|x") in text
    assert "<script src=" not in text and len(text) > 3_000_000  # plotly.js inline: opens with no network
    assert text.count("Plotly.newPlot") >= 3
    assert f"{report.per_device.per_device_peak_bytes}" in text  # 2 GPUs: the plan per GPU under DDP


def test_report_what_fits_has_its_largest_sequences_and_readable_numbers(report):
    fits = json.loads(render_report(report, "json"))["what_fits"]
    assert fits and all(isinstance(row["largest sequence"], int) for row in fits)
    best = report.fits.iloc[0]
    plan = scenario_from_values(**{**report.values, "optimizer": best["optimizer"], "precision": best["precision"],
                                   "gradient_checkpointing": bool(best["checkpointing"]),
                                   "batch_size": int(best["micro-batch"]), "grad_accum": int(best["accumulation"])})
    assert fits[0]["largest sequence"] == max_seq_len(report.shape, plan, report.capacity_bytes,
                                                      plan=ParallelPlan(2, Strategy(best["strategy"])))
    page = render_report(report, "html")
    cells = re.findall(r"<td>([^<]*)</td>", page)
    assert f"{report.fits['step time (s)'].iloc[0]:,.2f}" in cells
    assert not [c for c in cells if re.fullmatch(r"-?[0-9,]*\.[0-9]{3,}", c)]  # no raw floats (46.404661)


def test_report_markdown_and_csv(report):
    md = render_report(report, "md")
    assert "\\<script\\>" in md and "\\|x" in md
    per_gpu_peak = report.per_device.per_device_peak_bytes  # 2 GPUs: the plan per GPU under DDP
    assert f"| Peak (total) | {per_gpu_peak} |" in md
    assert "| Communication buffers |" in md
    csv = render_report(report, "csv")
    assert csv.splitlines()[0].startswith("section,")
    assert f",{per_gpu_peak}," in csv and ".0," not in csv.splitlines()[1]
    assert {line.split(",")[0] for line in csv.splitlines()[1:]} == {
        "plan", "techniques", "what fits", "runs", "multi-GPU memory", "multi-GPU traffic", "multi-GPU local SGD"}
    with pytest.raises(PlannerInputError, match="format"):
        render_report(report, "pdf")


def test_write_report_from_cli_values(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    values = {"config": "gpt2", "task": "causal-lm", "batch_size": "4", "seq_len": "256", "optimizer": "adamw",
              "precision": "fp32", "gradient_checkpointing": False, "grad_accum": "1", "attn": "sdpa",
              "device": "cuda", "num_labels": "2", "engine": "accelerate", "gpu": "24", "gpu_count": "2",
              "strategy": "zero2", "hub": False, "out": "ignored"}
    out = write_report(values, tmp_path / "plan.json")
    data = json.loads(out.read_text())
    assert data["plan"]["capacity_bytes"] == 24 * GIB and data["plan"]["gpu_count"] == 2
    assert data["plan"]["estimate"]["strategy"] == "zero2"  # the plan per GPU under --strategy
    assert data["plan"]["estimate"]["placement"]["gradients"] == "sharded 2 ways"
    assert data["plan"]["estimate"]["peak_bytes"] == peak(load_model_shape("gpt2", scenario_from_values(
        task="causal-lm", batch_size=1, seq_len=1).task), batch_size=4, seq_len=256, optimizer="adamw",
        precision="fp32", gradient_checkpointing=False, grad_accum=1)
    assert (write_report(values, tmp_path / "plan.md")).read_text().startswith("# Training memory plan: gpt2")
    with pytest.raises(PlannerInputError, match="must end in"):
        write_report(values, tmp_path / "plan.pdf")
    with pytest.raises(PlannerInputError, match="unknown GPU"):
        report_for_values({**values, "gpu": "TPU"})
    # The planner's own GPU keys, as `planner estimate --gpu` takes them, name the same card as the preset.
    by_key = report_for_values({**values, "gpu": "t4", "gpu_count": "1", "strategy": "ddp"})
    by_label = report_for_values({**values, "gpu": "T4 · 16 GB", "gpu_count": "1", "strategy": "ddp"})
    assert by_key.capacity_bytes == by_label.capacity_bytes == GPUS["t4"].capacity_bytes
    assert by_key.gpu is by_label.gpu is GPUS["t4"]
