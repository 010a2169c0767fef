"""benchmarks/browser_speed.py's arithmetic and table without a browser: nearest-rank
percentiles, pass/fail against the issue's targets, the Markdown rows from a results dict,
and the CPU profile's time by script file (a native DOM call counted to its caller)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Loaded from its file: putting benchmarks/ on sys.path would let its modules shadow others.
_SPEC = importlib.util.spec_from_file_location("browser_speed", ROOT / "benchmarks" / "browser_speed.py")
browser_speed = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(browser_speed)


def test_summarise_takes_nearest_rank_percentiles():
    values = [0.1 * i for i in range(1, 21)]  # 0.1 .. 2.0
    stats = browser_speed.summarise(values)
    assert stats == {"n": 20, "p50_s": 1.0, "p95_s": 1.9, "max_s": 2.0}
    assert browser_speed.summarise([]) == {"n": 0, "p50_s": None, "p95_s": None, "max_s": None}
    assert browser_speed.summarise([0.3])["p95_s"] == 0.3


def test_verdict_is_inclusive_and_says_when_nothing_was_measured():
    assert browser_speed.verdict(0.25, 0.25) == "pass"
    assert browser_speed.verdict(0.2501, 0.25) == "FAIL"
    assert browser_speed.verdict(None, 1.0) == "FAIL (not measured)"
    assert browser_speed.verdict(3.0, None) == "-"


def results(**overrides) -> dict:
    stats = {"n": 6, "p50_s": 0.2, "p95_s": 0.3, "max_s": 0.3}
    base = {
        "command": ".venv/bin/python benchmarks/browser_speed.py", "machine": "x86_64, 2 CPUs", "date": "today",
        "loadavg_before_full": "0.50 0.40 0.30 1/100 1", "loadavg_after_full": "1.50 0.40 0.30 1/100 2",
        "loadavg_before": "0.50", "loadavg_after": "1.50", "load_note": "other load was running",
        "first_session_s": 1.5, "later_sessions": {"n": 5, "p50_s": 0.8, "p95_s": 1.2, "max_s": 1.2},
        "sidebar_changes": {"batch": stats, "model": {**stats, "p95_s": 0.9}},
        "page_switches": {"Techniques": stats},
        "load_test": {"summary": {"concurrent sessions": 20, "re-renders per session": 5, "re-render p50 (s)": 0.6,
                                  "re-render p95 (s)": 1.4, "sessions not finished in budget": 0},
                      "errors": []},
        "errors": [],
    }
    return base | overrides


def test_rows_hold_each_measure_its_target_and_result():
    rows = {measure: (value, target, result) for measure, value, target, result in
            browser_speed.result_rows(results())}
    assert rows["complete Plan page, first session of a fresh server"] == ("1.500 s", "<= 2 s", "pass")
    assert rows["complete Plan page, later sessions (5), median"] == ("0.800 s", "<= 1 s", "pass")
    assert rows["complete Plan page, later sessions (5), max"] == ("1.200 s", "<= 1 s", "FAIL")
    assert rows["sidebar change: batch (6), p95"] == ("0.300 s", "<= 0.25 s", "FAIL")
    assert rows["sidebar change: model (6), p95"] == ("0.900 s", "<= 1 s", "pass")  # its own, looser target
    assert rows["sidebar change: batch (6), p50"][1:] == ("-", "-")
    assert rows["load test, 20 sessions, re-render p95"] == ("1.400 s", "<= 1 s", "FAIL")
    assert rows["load test, 20 sessions, errors"] == ("0", "0", "pass")
    assert rows["load average (1 min) before / after"][0] == "0.50 / 1.50"


def test_load_test_errors_and_unfinished_sessions_fail():
    load = results()["load_test"]
    load["errors"] = ["session 3: TimeoutError"]
    load["summary"]["sessions not finished in budget"] = 1
    rows = {m: (v, r) for m, v, _, r in browser_speed.result_rows(results(load_test=load))}
    assert rows["load test, 20 sessions, errors"] == ("2", "FAIL")


def test_markdown_has_the_command_machine_load_and_table():
    text = browser_speed.markdown(results(diagnosis_summary=["Plotly's chunk is 4.5 MiB."]))
    assert "Command: `.venv/bin/python benchmarks/browser_speed.py`" in text
    assert "Machine: x86_64, 2 CPUs; run today." in text
    assert "0.50 0.40 0.30 1/100 1 before" in text and "other load was running" in text
    assert "| measure | value | target | result |" in text
    assert "- Plotly's chunk is 4.5 MiB." in text
    assert text.endswith("Errors: none\n")


def test_profile_counts_a_native_call_to_the_script_calling_it():
    def frame(name, url=""):
        return {"functionName": name, "url": url}

    profile = {
        "nodes": [{"id": 1, "callFrame": frame("(root)"), "children": [2, 4]},
                  {"id": 2, "callFrame": frame("draw", "http://h/static/js/PlotlyChart.D9Z0_fxz.js"), "children": [3]},
                  {"id": 3, "callFrame": frame("getBoundingClientRect")},
                  {"id": 4, "callFrame": frame("(idle)")}],
        "samples": [2, 3, 3, 4], "timeDeltas": [1000, 2000, 2000, 5000],  # microseconds
    }
    found = browser_speed.profile_by_file(profile)
    assert found["by_file_ms"] == {"(idle)": 5.0, "PlotlyChart.js": 5.0}
    assert found["top_functions_ms"]["getBoundingClientRect (native)"] == 4.0
    assert found["total_ms"] == 10.0
