"""Browser speed: the dashboard as a user sees it in headless Chromium, against the targets
of issue 14, and where the time goes.

Starts `streamlit run app.py` on a free port (benchmarks/load_test.py's start_server) and
drives Debian's Chromium through Playwright's sync API. Measures, in the page's own clock
(performance.now(), so Playwright's round trips are not counted):
- the complete Plan page from opening the URL, for the first session of the fresh server
  and for later sessions (each a new browser context: cold HTTP cache, new Streamlit session);
- a sidebar change (batch, sequence, optimizer, precision, checkpointing, model, GPU), from
  the input event (the Enter key, the option's or toggle's pointerdown) to the page complete
  again with the new numbers;
- a page switch through the sidebar's navigation links;
- the 20-session websocket load test (load_test.run_load_test, its own fresh server);
- for scale, later sessions of a page holding one alert and one metric (FLOOR_APP, its own
  server, the same config and browser): what any Streamlit page costs a new session here;
  and of a page of one of each element kind the Plan page draws, nothing computed
  (ELEMENT_KINDS_APP): what those kinds' JavaScript costs a new session.

"Complete" means all of: a script_finished message (the ForwardMsg's field 6, read from the
websocket in the page) received after the action; Streamlit's status widget gone; every
Plotly chart holding its .main-svg and drawn traces; on the Plan page the verdict shown;
the metric and alert text changed (sidebar changes) or the URL path changed (page
switches); then no DOM mutation for QUIET_MS. The time taken is that of the last DOM
mutation, so the quiet wait itself is not counted. Mutations inside a screen reader's
announcement log (a hidden role=log aria-live region, where a select box's "4 options
available" lines are dropped on timers up to 0.4 s after the page is drawn) are counted
apart (`live_region_mutations`), not as the page moving.

Where the time goes (the `diagnosis` part of the JSON): per change, the websocket timing
seen in the page (input -> BackMsg sent -> first ForwardMsg -> script_finished -> last
DOM mutation), the main thread's script/layout/style time (CDP Performance.getMetrics),
a sampled JS CPU profile by bundle file (Plotly's chunk apart), the first load's resource
timing (JS bundles), the same change through a bare websocket client (load_test's
protocol, no browser), and the server script under cProfile through AppTest.

    .venv/bin/python benchmarks/browser_speed.py           # full run (about 2 min on 2 cores)
    .venv/bin/python benchmarks/browser_speed.py --quick   # smoke run, writes under /tmp unless --out

Needs /usr/bin/chromium (or $CHROMIUM) and the playwright package (requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib.util
import io
import json
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Loaded from its file, as tests load benchmarks: benchmarks/ itself stays off sys.path.
_SPEC = importlib.util.spec_from_file_location("load_test", ROOT / "benchmarks" / "load_test.py")
load_test = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(load_test)
percentile = load_test.percentile

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 # as tests/test_browser.py: background connections fail on a closed network
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1440, "height": 1100}
QUIET_MS = 300
FIRST_TIMEOUT_MS = 120_000  # the fresh server's first run imports transformers
CHANGE_TIMEOUT_MS = 60_000
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "browser_speed.md"

TARGETS_S = {"first session": 2.0, "later session": 1.0, "sidebar change p95": 0.25, "model change p95": 1.0,
             "load test p95": 1.0, "load test errors": 0}

# (kind, widget label, values cycled; each differs from the one before so the numbers change)
SIDEBAR_CHANGES = [
    ("batch", "Batch size (sequences per micro-batch)", ["16", "4", "32", "12", "24", "8"]),
    ("sequence", "Sequence length (tokens)", ["256", "128", "384", "64", "448", "512"]),
    ("optimizer", "Optimizer", ["SGD, momentum 0.9", "Adafactor (torch)", "AdamW 8-bit (bitsandbytes)",
                                "SGD, momentum 0.9", "Adam 8-bit (bitsandbytes)", "AdamW (torch)"]),
    ("precision", "Precision", ["bf16 mixed (autocast, fp32 master)", "bf16 (pure 16-bit)", "fp32",
                                "bf16 (pure 16-bit)", "bf16 mixed (autocast, fp32 master)", "fp32"]),
    ("checkpointing", "Gradient checkpointing", [True, False, True, False, True, False]),
    # Every model but the default's first pick is new to the server: its shape is built then.
    ("model", "Catalog model", ["gpt2", "bert-base-uncased", "qwen2.5-0.5b", "llama-3.2-1b", "roberta-base",
                                "distilbert-base-cased"]),
    ("GPU", "GPU", ["A100 · 40 GB", "H100 · 80 GB", "L4 / A10 / RTX 4090 · 24 GB", "H200 · 141 GB",
                    "A100 · 80 GB", "T4 · 16 GB"]),
]
NUMBER_INPUTS = {"batch", "sequence"}
TOGGLES = {"checkpointing"}
PAGE_ROUTE = ["What fits", "Techniques", "Multiple GPUs", "Report", "Plan"]

# Runs in every page before its own scripts: the last DOM mutation's time, the first input
# event after arm(), and every message on Streamlit's websocket (time, direction, bytes,
# script_finished status or -1).
PAGE_PROBE = r"""
(() => {
  const B = window.__bench = {lastMut: 0, liveRegionMutations: 0, armed: false, tInput: null, ws: [],
                              wsCreated: null, wsOpen: null};
  // A screen reader's announcement log (a visually hidden role=log aria-live region: a select
  // box's "4 options available") drops its old lines on timers, hundreds of ms after the page
  // is drawn: counted apart, not as the page moving.
  const inLiveLog = (node) => {
    const element = node.nodeType === 1 ? node : node.parentElement;
    return element !== null && element.closest('[role="log"][aria-live]') !== null;
  };
  new MutationObserver((records) => {
    if (records.every(r => inLiveLog(r.target))) { B.liveRegionMutations += records.length; return; }
    B.lastMut = performance.now();
  }).observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
  B.arm = () => { B.armed = true; B.tInput = null; };
  // Main-thread tasks over 50 ms (start, duration): the browser's own work, drawing included.
  B.long = [];
  try {
    new PerformanceObserver((list) => { for (const e of list.getEntries()) B.long.push([e.startTime, e.duration]); })
      .observe({type: 'longtask', buffered: true});
  } catch (e) { /* no Long Tasks API */ }
  for (const type of ['pointerdown', 'keydown']) {
    addEventListener(type, () => { if (B.armed) { B.armed = false; B.tInput = performance.now(); } }, true);
  }
  // A ForwardMsg's top-level fields; field 6 (varint) is script_finished.
  const scriptFinished = (b) => {
    let i = 0;
    const varint = () => { let r = 0, s = 0, x; do { x = b[i++]; r += (x & 0x7f) * 2 ** s; s += 7; } while (x & 0x80 && i < b.length); return r; };
    while (i < b.length) {
      const tag = varint(), field = Math.floor(tag / 8), wire = tag & 7;
      if (wire === 0) { const v = varint(); if (field === 6) return v; }
      else if (wire === 2) { const length = varint(); i += length; }
      else if (wire === 1) { i += 8; } else if (wire === 5) { i += 4; } else { return -1; }
    }
    return -1;
  };
  const Native = window.WebSocket;
  class Spy extends Native {
    constructor(url, protocols) {
      super(url, protocols);
      this.__stream = String(url).includes('/_stcore/stream');
      if (!this.__stream) return;
      B.wsCreated = performance.now();
      this.addEventListener('open', () => { B.wsOpen = performance.now(); });
      this.addEventListener('message', (e) => {
        const d = e.data, bytes = d.byteLength ?? d.size ?? d.length;
        B.ws.push([performance.now(), 'in', bytes, d instanceof ArrayBuffer ? scriptFinished(new Uint8Array(d)) : -1]);
      });
    }
    send(d) {
      if (this.__stream) B.ws.push([performance.now(), 'out', d.byteLength ?? d.length ?? d.size, -1]);
      return super.send(d);
    }
  }
  window.WebSocket = Spy;
})();
"""

# True once the page is complete after `since` (see the module docstring).
COMPLETE = r"""
({since, signature, path, plan, quietMs}) => {
  const B = window.__bench;
  if (!B.ws.some(m => m[0] >= since && m[1] === 'in' && (m[3] === 0 || m[3] === 3))) return false;
  if (document.querySelector('[data-testid="stStatusWidget"]')) return false;
  for (const chart of document.querySelectorAll('[data-testid="stPlotlyChart"]')) {
    if (!chart.querySelector('.main-svg') || !chart.querySelector('.main-svg g.trace path')) return false;
  }
  const main = document.querySelector('[data-testid="stMain"]');
  if (!main) return false;
  if (plan && !/(^|\n)(Fits|Does not fit): /.test(main.innerText)) return false;
  if (signature !== null && window.__signature() === signature) return false;
  if (path !== null && location.pathname !== path) return false;
  return performance.now() - B.lastMut >= quietMs;
}
"""
SIGNATURE = r"""
window.__signature = () => [...document.querySelectorAll(
  '[data-testid="stMain"] [data-testid="stMetricValue"], [data-testid="stMain"] [data-testid="stAlert"]')]
  .map(e => e.innerText).join('|');
"""


def summarise(values: list[float]) -> dict:
    """p50/p95 (nearest rank), max and count of seconds."""
    if not values:
        return {"n": 0, "p50_s": None, "p95_s": None, "max_s": None}
    return {"n": len(values), "p50_s": round(percentile(values, 50), 3), "p95_s": round(percentile(values, 95), 3),
            "max_s": round(max(values), 3)}


def verdict(value: float | None, target: float | None) -> str:
    if target is None:
        return "-"
    if value is None:
        return "FAIL (not measured)"
    return "pass" if value <= target else "FAIL"


def result_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(measure, value, target, pass/fail) for the Markdown table, from the JSON results."""
    def seconds(value):
        return "n/a" if value is None else f"{value:.3f} s"

    rows = []
    first = results["first_session_s"]
    rows.append(("complete Plan page, first session of a fresh server", seconds(first),
                 f"<= {TARGETS_S['first session']:g} s", verdict(first, TARGETS_S["first session"])))
    later = results["later_sessions"]
    for stat in ("p50_s", "max_s"):
        name = "median" if stat == "p50_s" else "max"
        rows.append((f"complete Plan page, later sessions ({later['n']}), {name}", seconds(later[stat]),
                     f"<= {TARGETS_S['later session']:g} s", verdict(later[stat], TARGETS_S["later session"])))
    floor = results.get("streamlit_floor")
    if floor:
        rows.append((f"for scale: a page of one alert and one metric (Streamlit's floor here), later sessions "
                     f"({floor['later_sessions']['n']}), median", seconds(floor["later_sessions"]["p50_s"]), "-", "-"))
    kinds = results.get("element_kinds_floor")
    if kinds:
        rows.append((f"for scale: a page of one of each element kind the Plan page draws, nothing computed, later "
                     f"sessions ({kinds['later_sessions']['n']}), median", seconds(kinds["later_sessions"]["p50_s"]),
                     "-", "-"))
    cached = results.get("cached_sessions")
    if cached:
        rows.append((f"complete Plan page, later sessions with a warm HTTP cache ({cached['n']}, new tabs), median",
                     seconds(cached["p50_s"]), f"<= {TARGETS_S['later session']:g} s (not the issue's measure)",
                     verdict(cached["p50_s"], TARGETS_S["later session"])))
    for kind, stats in results["sidebar_changes"].items():
        target = TARGETS_S["model change p95" if kind == "model" else "sidebar change p95"]
        rows.append((f"sidebar change: {kind} ({stats['n']}), p50", seconds(stats["p50_s"]), "-", "-"))
        rows.append((f"sidebar change: {kind} ({stats['n']}), p95", seconds(stats["p95_s"]), f"<= {target:g} s",
                     verdict(stats["p95_s"], target)))
    for page, stats in results["page_switches"].items():
        rows.append((f"page switch to {page} ({stats['n']}), p50 / p95",
                     f"{seconds(stats['p50_s'])} / {seconds(stats['p95_s'])}", "-", "-"))
    load = results.get("load_test")
    if load is not None:
        summary = load["summary"]
        n = summary["concurrent sessions"]
        rows.append((f"load test, {n} sessions x {summary['re-renders per session']} re-renders, p50",
                     seconds(summary["re-render p50 (s)"]), "-", "-"))
        rows.append((f"load test, {n} sessions, re-render p95", seconds(summary["re-render p95 (s)"]),
                     f"<= {TARGETS_S['load test p95']:g} s",
                     verdict(summary["re-render p95 (s)"], TARGETS_S["load test p95"])))
        errors = len(load["errors"]) + summary["sessions not finished in budget"]
        rows.append((f"load test, {n} sessions, errors", str(errors), "0",
                     verdict(errors, TARGETS_S["load test errors"])))
    rows.append(("load average (1 min) before / after", f"{results['loadavg_before']} / {results['loadavg_after']}",
                 "-", "-"))
    return rows


def markdown(results: dict) -> str:
    rows = result_rows(results)
    lines = ["# Browser speed: the dashboard in headless Chromium", "",
             f"Command: `{results['command']}`", "",
             f"Machine: {results['machine']}; run {results['date']}.", "",
             (f"Load: /proc/loadavg {results['loadavg_before_full']} before, {results['loadavg_after_full']} after"
              f" ({results['load_note']})."), "",
             ("Times are the page's own clock (performance.now()): from opening the URL, or from the input event, "
             "to the last DOM mutation of the complete page (script_finished received, status widget gone, every "
             f"Plotly chart drawn, the verdict and the new numbers shown, then {QUIET_MS} ms without a mutation; a "
             "screen reader's hidden announcement log is not counted). "
             "Later sessions are new browser contexts (cold HTTP cache) on the warm server; the warm-cache row "
             "opens new tabs in one context that has loaded the page once. The load test is "
             "benchmarks/load_test.py's (websocket clients, no browser drawing) on its own fresh server."), "",
             "| measure | value | target | result |", "|---|---|---|---|"]
    lines += [f"| {m} | {v} | {t} | {r} |" for m, v, t, r in rows]
    diagnosis = results.get("diagnosis_summary")
    if diagnosis:
        lines += ["", "## Where the time goes", ""] + [f"- {line}" for line in diagnosis]
    errors = results.get("errors") or []
    lines += ["", "Errors: " + ("none" if not errors else "; ".join(errors[:20]))]
    return "\n".join(lines) + "\n"


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


# --- the browser --------------------------------------------------------------------------


def launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def new_context(browser):
    context = browser.new_context(viewport=VIEWPORT)
    context.add_init_script(PAGE_PROBE)
    context.add_init_script(SIGNATURE)
    return context


class Tab:
    """One browser context and its page, with the probe installed."""

    def __init__(self, browser, url: str, cdp: bool = False, context=None):
        self.shared = context is not None  # a tab in a context it does not own: closes only its page
        self.context = context if self.shared else new_context(browser)
        self.page = self.context.new_page()
        # Playwright's view of each request, as Resource Timing lacks some on-demand chunks.
        self.requests: list[tuple[str, dict]] = []
        self.page.on("requestfinished", lambda request: self.requests.append((request.url, request.timing)))
        self.url = url
        self.cdp = self.context.new_cdp_session(self.page) if cdp else None
        if self.cdp is not None:
            self.cdp.send("Performance.enable")
            self.cdp.send("Profiler.enable")
            self.cdp.send("Profiler.setSamplingInterval", {"interval": 250})  # microseconds

    def close(self) -> None:
        (self.page if self.shared else self.context).close()

    def now(self) -> float:
        return self.page.evaluate("performance.now()")

    def probe(self) -> dict:
        return self.page.evaluate("({lastMut: __bench.lastMut, tInput: __bench.tInput, "
                                  "ws: __bench.ws, long: __bench.long, wsCreated: __bench.wsCreated, "
                                  "wsOpen: __bench.wsOpen, liveRegionMutations: __bench.liveRegionMutations})")

    def wait_complete(self, since: float, signature: str | None, path: str | None, plan: bool,
                      timeout_ms: float) -> None:
        self.page.wait_for_function(COMPLETE, arg={"since": since, "signature": signature, "path": path,
                                                   "plan": plan, "quietMs": QUIET_MS},
                                    polling=25, timeout=timeout_ms)

    def signature(self) -> str:
        return self.page.evaluate("window.__signature()")

    def metrics(self) -> dict:
        found = self.cdp.send("Performance.getMetrics")["metrics"]
        return {m["name"]: m["value"] for m in found}


def ws_phases(probe: dict, since: float) -> dict:
    """The websocket timeline after `since` (ms in the page's clock) up to the page complete."""
    after = [m for m in probe["ws"] if m[0] >= since]
    sent = next((m[0] for m in after if m[1] == "out"), None)
    received = [m for m in after if m[1] == "in"]
    # The last script_finished seen (a page load may run the script more than once).
    finished = next((m[0] for m in reversed(received) if m[3] in (0, 3)), None)
    first_in = next((m[0] for m in received if sent is None or m[0] >= sent), None)
    upto = [m for m in received if finished is None or m[0] <= finished]
    done = max(probe["lastMut"], finished or 0.0)
    long_tasks = [(t, d) for t, d in probe.get("long", []) if since <= t <= done]
    biggest = sorted(upto, key=lambda m: -(m[2] or 0))[:2]  # the two charts' deltas, on the Plan page
    return {"input_to_send_ms": None if sent is None else round(sent - since, 1),
            "send_to_first_message_ms": None if sent is None or first_in is None else round(first_in - sent, 1),
            "send_to_script_finished_ms": None if sent is None or finished is None else round(finished - sent, 1),
            # Complete: drawn (the last DOM mutation) and finished (no mutation may follow the message).
            "done_ms": done,
            "script_finished_to_done_ms": None if finished is None else round(max(probe["lastMut"] - finished, 0), 1),
            "messages": len(upto), "bytes_received": sum(m[2] or 0 for m in upto),
            # The browser's main thread in tasks over 50 ms between the action and the complete page.
            "long_tasks": len(long_tasks), "long_tasks_ms": round(sum(d for _, d in long_tasks), 1),
            "long_tasks_after_script_finished_ms": round(sum(d for t, d in long_tasks
                                                             if finished is not None and t >= finished), 1),
            "largest_messages": [{"at_ms": round(m[0] - (sent or since), 1), "bytes": m[2]} for m in biggest]}


def open_plan(browser, url: str, profile: bool = False, context=None) -> dict:
    """A new session: open the URL, wait for the complete Plan page; times in the page's clock.
    In a new browser context unless `context` (then a new tab of it, its HTTP cache warm)."""
    tab = Tab(browser, url, cdp=profile, context=context)
    try:
        if profile:
            tab.cdp.send("Profiler.start")
            before = tab.metrics()
        tab.page.goto(url, wait_until="commit")
        tab.wait_complete(0.0, None, None, True, FIRST_TIMEOUT_MS)
        probe = tab.probe()
        nav = tab.page.evaluate("""(() => { const n = performance.getEntriesByType('navigation')[0];
            const r = performance.getEntriesByType('resource').map(e => ({name: e.name, type: e.initiatorType,
              start: e.startTime, end: e.responseEnd, bytes: e.transferSize, decoded: e.decodedBodySize}));
            return {domContentLoaded: n.domContentLoadedEventEnd, load: n.loadEventEnd, responseEnd: n.responseEnd,
                    resources: r}; })()""")
        result = {"ws_created_ms": probe["wsCreated"], "ws_open_ms": probe["wsOpen"],
                  "dom_content_loaded_ms": nav["domContentLoaded"], "load_event_ms": nav["load"],
                  **ws_phases(probe, 0.0)}
        first_in = next((m[0] for m in probe["ws"] if m[1] == "in"), None)
        result["first_message_ms"] = first_in
        scripts = [r for r in nav["resources"] if r["name"].split("?")[0].endswith(".js")]
        origin = tab.page.evaluate("performance.timeOrigin")
        seen = {r["name"] for r in scripts}
        for request_url, timing in tab.requests:
            if request_url.split("?")[0].endswith(".js") and request_url not in seen and timing.get("startTime"):
                start = timing["startTime"] - origin
                scripts.append({"name": request_url, "type": "playwright", "start": start,
                                "end": start + max(timing.get("responseEnd", 0), 0), "bytes": None, "decoded": None})
        result["js_files_missing_from_resource_timing"] = sum(r["type"] == "playwright" for r in scripts)
        # Boot JS: what the page fetched before opening the websocket; the rest are chunks fetched
        # on demand when an element first needs them (Plotly's when the first chart delta arrives).
        boot = [r for r in scripts if r["start"] <= (probe["wsCreated"] or 0)]
        lazy = [r for r in scripts if r["start"] > (probe["wsCreated"] or 0)]
        result["js_files"] = len(scripts)
        result["lazy_js_files"] = len(lazy)
        result["js_bytes_decoded"] = sum(r["decoded"] or 0 for r in scripts)
        result["js_last_response_end_ms"] = round(max((r["end"] for r in scripts), default=0), 1)
        result["boot_js"] = {"files": len(boot), "bytes_decoded": sum(r["decoded"] or 0 for r in boot),
                             "bytes_transferred": sum(r["bytes"] or 0 for r in boot),
                             "last_response_end_ms": round(max((r["end"] for r in boot), default=0), 1)}
        result["lazy_js"] = [{"file": _file_of(r["name"]), "start_ms": round(r["start"], 1),
                              "end_ms": round(r["end"], 1), "bytes_decoded": r["decoded"],
                              "bytes_transferred": r["bytes"]}
                             for r in sorted(lazy, key=lambda r: -(r["decoded"] or 0))[:6]]
        plotly = [r for r in scripts if "PlotlyChart" in r["name"]]
        result["plotly_chunk"] = ({"start_ms": round(plotly[0]["start"], 1), "end_ms": round(plotly[0]["end"], 1),
                                   "bytes_transferred": plotly[0]["bytes"]} if plotly else None)
        result["resource_entries"] = len(nav["resources"])
        if profile:
            after = tab.metrics()
            result["main_thread"] = main_thread(before, after)
            result["js_profile"] = profile_by_file(tab.cdp.send("Profiler.stop")["profile"])
        return result
    finally:
        tab.close()


def main_thread(before: dict, after: dict) -> dict:
    """Main-thread busy time between two Performance.getMetrics readings (ms)."""
    keys = {"TaskDuration": "task_ms", "ScriptDuration": "script_ms", "LayoutDuration": "layout_ms",
            "RecalcStyleDuration": "style_ms"}
    return {name: round(1000 * (after.get(k, 0) - before.get(k, 0)), 1) for k, name in keys.items()}


def _file_of(url: str) -> str:
    file = url.rsplit("/", 1)[-1].split("?")[0]
    return re.sub(r"\.[A-Za-z0-9_-]{8}\.js$", ".js", file)  # drop Vite's content hash


def profile_by_file(profile: dict, top: int = 8) -> dict:
    """Sampled time (ms) of a CDP CPU profile by script file, a native frame (getBoundingClientRect,
    a DOM call) counted to the nearest script file calling it; 'PlotlyChart.js' is Plotly's chunk.
    Also the top functions by self time."""
    nodes = {n["id"]: n for n in profile["nodes"]}
    parent = {child: n["id"] for n in profile["nodes"] for child in n.get("children", [])}
    self_us: dict[int, float] = {}
    for node_id, delta in zip(profile["samples"], profile["timeDeltas"]):
        self_us[node_id] = self_us.get(node_id, 0.0) + delta
    by_file: dict[str, float] = {}
    by_function: dict[str, float] = {}
    for node_id, us in self_us.items():
        frame = nodes[node_id]["callFrame"]
        name = frame["functionName"] or "(anonymous)"
        own = _file_of(frame.get("url") or "")
        by_function[f"{name} ({own or 'native'})"] = by_function.get(f"{name} ({own or 'native'})", 0.0) + us
        file, walk = own, node_id
        while not file and walk in parent:
            walk = parent[walk]
            file = _file_of(nodes[walk]["callFrame"].get("url") or "")
        file = file or name  # (idle), (program), (garbage collector): no script above them
        by_file[file] = by_file.get(file, 0.0) + us
    ordered = sorted(by_file.items(), key=lambda kv: -kv[1])
    return {"by_file_ms": {k: round(v / 1000, 1) for k, v in ordered[:top]},
            "top_functions_ms": {k: round(v / 1000, 1) for k, v in sorted(by_function.items(), key=lambda kv: -kv[1])
                                 [:top]},
            "total_ms": round(sum(self_us.values()) / 1000, 1)}


def do_sidebar_change(tab: Tab, kind: str, label: str, value) -> None:
    sidebar = tab.page.get_by_test_id("stSidebar")
    if kind in NUMBER_INPUTS:
        field = sidebar.get_by_label(label)
        field.fill(str(value))
        tab.page.evaluate("__bench.arm()")
        field.press("Enter")  # a number input commits on Enter or blur
    elif kind in TOGGLES:
        tab.page.evaluate("__bench.arm()")
        sidebar.get_by_test_id("stCheckbox").filter(has_text=label).locator("label").click()
    else:
        option = tab.page.get_by_role("option", name=value, exact=True)
        for attempt in range(4):  # a click right after a rerun can land before the list opens
            combobox = sidebar.get_by_role("combobox", name=label, exact=True)
            combobox.click()
            combobox.fill(value)  # filters the list: a long one (the catalog) shows only its first rows
            try:
                option.wait_for(timeout=3_000)
                break
            except Exception:
                if attempt == 3:
                    raise
                tab.page.keyboard.press("Escape")
        tab.page.evaluate("__bench.arm()")
        option.click()


def measure_change(tab: Tab, action, signature: str | None, path: str | None, plan: bool,
                   profile: bool = False) -> dict:
    """Time one action to the complete page: seconds and the websocket phases."""
    if profile:
        tab.cdp.send("Profiler.start")
        before = tab.metrics()
    live_before = tab.probe()["liveRegionMutations"]
    action()
    since = tab.probe()["tInput"]
    if since is None:
        raise RuntimeError("no input event seen")
    tab.wait_complete(since, signature, path, plan, CHANGE_TIMEOUT_MS)
    probe = tab.probe()
    phases = ws_phases(probe, since)
    result = {"s": round((phases.pop("done_ms") - since) / 1000, 4), **phases,
              "live_region_mutations": probe["liveRegionMutations"] - live_before}
    if profile:
        result["main_thread"] = main_thread(before, tab.metrics())
        result["js_profile"] = profile_by_file(tab.cdp.send("Profiler.stop")["profile"])
    return result


def sidebar_changes(tab: Tab, changes_per_kind: int, profile: bool = False) -> dict:
    measured: dict[str, list[dict]] = {}
    for kind, label, values in SIDEBAR_CHANGES:
        runs = []
        # The last ones: each list ends on the default, so the next kind starts from the default
        # scenario (a --quick run that left pure bf16 behind timed a model change that probed).
        for value in values[-changes_per_kind:]:
            signature = tab.signature()
            runs.append({"value": value, **measure_change(
                tab, lambda kind=kind, label=label, value=value: do_sidebar_change(tab, kind, label, value),
                signature, None, True, profile)})
        measured[kind] = runs
    return measured


def page_switches(tab: Tab, rounds: int) -> dict:
    measured: dict[str, list[dict]] = {name: [] for name in PAGE_ROUTE}
    nav = tab.page.get_by_test_id("stSidebarNav")
    for _ in range(rounds):
        for name in PAGE_ROUTE:
            link = nav.get_by_test_id("stSidebarNavLink").filter(
                has=tab.page.get_by_text(name, exact=True))
            path = "/" + (link.get_attribute("href") or "").split("/", 3)[-1]

            def click(link=link):
                tab.page.evaluate("__bench.arm()")
                link.click()

            measured[name].append({"path": path, **measure_change(tab, click, None, path, name == "Plan")})
    return measured


# --- without a browser --------------------------------------------------------------------


def websocket_client(port: int, sessions: int, rerenders: int) -> tuple[list[float], list[float]]:
    """load_test's protocol, one session at a time on the warm server: script time plus transport,
    no drawing. (first renders of new sessions, re-renders)."""
    firsts, times = [], []
    for _ in range(sessions):
        results, errors, _ = asyncio.run(load_test.drive(f"ws://127.0.0.1:{port}/_stcore/stream", 1, rerenders,
                                                         60.0, 120.0))
        if errors:
            raise RuntimeError("; ".join(errors))
        firsts.append(results[0][0])
        times += results[0][1]
    return firsts, times


def server_script_profile(repeats: int) -> dict:
    """The Plan page's script through AppTest (no server, no websocket): rerun times per change and
    a cProfile of the batch changes, top cumulative entries."""
    from streamlit.testing.v1 import AppTest

    app = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
    t0 = time.perf_counter()
    app.run()
    first = time.perf_counter() - t0
    new_sessions = []
    for _ in range(repeats):  # a new session's first run, the process warm (a later browser session)
        other = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
        t0 = time.perf_counter()
        other.run()
        new_sessions.append(time.perf_counter() - t0)
    timings: dict[str, list[float]] = {"batch": [], "checkpointing": [], "optimizer": [], "sequence": []}
    # AppTest runs the script in a thread of its own, and cProfile sees only the thread that
    # enables it: a profiler inside every thread's run() while `profiling` is set, one per
    # thread (one profiler enabled in two threads at once mixes their times up).
    profiles: list[cProfile.Profile] = []
    profiling = threading.Event()
    native_run = threading.Thread.run

    def profiled_run(thread):
        if not profiling.is_set():
            return native_run(thread)
        profiler = cProfile.Profile()
        profiles.append(profiler)
        profiler.enable()
        try:
            return native_run(thread)
        finally:
            profiler.disable()

    threading.Thread.run = profiled_run
    for i in range(repeats):
        for kind, key, value in (("batch", "batch_size", 16 if i % 2 == 0 else 8),
                                 ("checkpointing", "gradient_checkpointing", i % 2 == 0),
                                 ("optimizer", "optimizer", "sgd" if i % 2 == 0 else "adamw"),
                                 ("sequence", "seq_len", 256 - 64 * i)):  # a new length each time
            widget = app.toggle(key=key) if kind == "checkpointing" else (
                app.number_input(key=key) if kind in ("batch", "sequence") else app.selectbox(key=key))
            widget.set_value(value)
            t0 = time.perf_counter()
            if kind == "batch":
                profiling.set()
            try:
                app.run()
            finally:
                profiling.clear()
            timings[kind].append(time.perf_counter() - t0)
            if app.exception:
                raise RuntimeError(f"AppTest exception: {app.exception[0].message}")
    threading.Thread.run = native_run
    # Streamlit runs gc.collect(2) after every script run (runner.postScriptGC, on by default),
    # holding the GIL: time it here, where the same modules (torch, transformers) are loaded.
    gc_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect(2)
        gc_s.append(time.perf_counter() - t0)
    stats = pstats.Stats(*profiles, stream=io.StringIO())
    total = sum(timings["batch"])
    entries = []
    for (file, line, name), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        short = file.replace(str(ROOT) + "/", "")
        if "site-packages" in short:
            short = "…/" + short.split("site-packages/", 1)[1]
        entries.append((cumulative, f"{short}:{line}({name})"))
    entries.sort(reverse=True)
    wanted = [(c, n) for c, n in entries if any(part in n for part in (
        "planner/", "app_pages/", "plotly/", "streamlit/elements", "pandas/", "pyarrow/", "app.py", "json/"))]
    return {"first_run_s": round(first, 2), "new_session_first_run_s": summarise(new_sessions),
            "rerun_s": {k: summarise(v) for k, v in timings.items()},
            # Checkpointing's first time on: a technique class whose largest batch is searched anew.
            "first_checkpointing_on_s": round(timings["checkpointing"][0], 3),
            "batch_rerun_cumulative_top": [{"s_per_rerun": round(c / max(1, len(timings["batch"])), 4), "where": n}
                                           for c, n in wanted[:30]],
            "profiled_batch_reruns": len(timings["batch"]), "profiled_total_s": round(total, 3),
            "profiled_threads": len(profiles), "gc_collect_2_s": summarise(gc_s),
            "gc_tracked_objects": len(gc.get_objects()), "modules_loaded": len(sys.modules)}


# For scale: the least a Streamlit page costs a new session here. One alert (the verdict's
# element, so COMPLETE's check holds) and one metric, under the project's config, timed as the
# Plan page is: what the dashboard's sidebar and page add is the difference.
FLOOR_APP = """import streamlit as st

st.success("Fits: a page of one alert and one metric")
st.metric("Peak", "1.00 GiB")
"""


# For scale too: one of each element kind the Plan page draws (the sidebar's radio, select box,
# number input and toggle; an alert, a metric and an SVG chart in HTML Markdown), nothing
# computed. A kind's JavaScript is fetched when a session first draws one, six requests at a
# time over HTTP/1.1 (`lazy_js_files` counts them): what these kinds cost a new session.
ELEMENT_KINDS_APP = """import streamlit as st

with st.sidebar:
    st.radio("Model from", ["Catalog", "Upload", "Hub"])
    st.selectbox("Catalog model", ["a", "b", "c"])
    st.number_input("Batch size", min_value=1, value=8)
    st.toggle("Gradient checkpointing")
st.success("Fits: a page of one of each element kind the Plan page draws")
st.metric("Peak", "1.00 GiB")
st.markdown("<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 40 10' width='100%'>"
            "<rect width='8' height='8'><title>a bar</title></rect></svg>", unsafe_allow_html=True)
"""


def streamlit_floor(later_n: int, app: str = FLOOR_APP) -> dict:
    """The page `app`'s first session on its own fresh server and `later_n` later ones."""
    from playwright.sync_api import sync_playwright

    port = load_test.free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as data_dir:
        script = Path(data_dir) / "floor_app.py"
        script.write_text(app)
        server = load_test.start_server(port, data_dir, script=script)
        try:
            with sync_playwright() as playwright:
                browser = launch(playwright)
                try:
                    first = open_plan(browser, url)
                    later = [open_plan(browser, url) for _ in range(later_n)]
                finally:
                    browser.close()
        finally:
            load_test.stop_server(server)
    return {"app": app, "first_session_s": round(first["done_ms"] / 1000, 3),
            "later_sessions": summarise([r["done_ms"] / 1000 for r in later]), "later_session_runs": later}


def machine() -> str:
    cpu = load_test.cpu_model()
    try:
        version = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        version = "chromium ?"
    import streamlit
    return (f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
            f"Streamlit {streamlit.__version__}, {version}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer of everything, small load test")
    parser.add_argument("--out", help=f"the Markdown table (a .json beside it); default {DEFAULT_OUT}, "
                                      "with --quick /tmp/browser_speed_quick.md")
    parser.add_argument("--no-load-test", action="store_true")
    parser.add_argument("--no-floor", action="store_true", help="skip timing the one-alert page (Streamlit's floor)")
    parser.add_argument("--no-diagnosis", action="store_true", help="skip the profiled pass and AppTest cProfile")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the Markdown beside this results JSON")
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        saved["diagnosis_summary"] = diagnosis_summary(saved)
        Path(args.render).write_text(json.dumps(saved, indent=1, default=str) + "\n")
        Path(args.render).with_suffix(".md").write_text(markdown(saved))
        return 0
    out = Path(args.out) if args.out else (Path("/tmp/browser_speed_quick.md") if args.quick else DEFAULT_OUT)
    later_n, cached_n, changes_n, rounds = (2, 1, 2, 1) if args.quick else (5, 2, 6, 2)
    load_sessions, load_rerenders = (4, 2) if args.quick else (20, 5)

    from playwright.sync_api import sync_playwright

    results: dict = {"command": " ".join([".venv/bin/python", "benchmarks/browser_speed.py", *sys.argv[1:]]
                                         if argv is None else ["benchmarks/browser_speed.py", *argv]),
                     "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "loadavg_before_full": loadavg(), "errors": []}
    results["loadavg_before"] = results["loadavg_before_full"].split()[0]
    started = time.perf_counter()
    port = load_test.free_port()
    url = f"http://127.0.0.1:{port}"
    diagnosis: dict = {}
    with tempfile.TemporaryDirectory() as data_dir:
        t0 = time.perf_counter()
        server = load_test.start_server(port, data_dir)
        results["server_start_to_healthy_s"] = round(time.perf_counter() - t0, 2)
        try:
            with sync_playwright() as playwright:
                browser = launch(playwright)
                try:
                    first = open_plan(browser, url)
                    results["first_session"] = first
                    results["first_session_s"] = round(first["done_ms"] / 1000, 3)
                    print(f"first session: {results['first_session_s']} s", flush=True)
                    later = [open_plan(browser, url) for _ in range(later_n)]
                    results["later_session_runs"] = later
                    results["later_sessions"] = summarise([r["done_ms"] / 1000 for r in later])
                    print(f"later sessions: {results['later_sessions']}", flush=True)
                    # A user coming back in the same browser: new tabs of one context, JS from its HTTP cache.
                    context = new_context(browser)
                    try:
                        open_plan(browser, url, context=context)  # fills the cache
                        cached = [open_plan(browser, url, context=context) for _ in range(cached_n)]
                    finally:
                        context.close()
                    results["cached_session_runs"] = cached
                    results["cached_sessions"] = summarise([r["done_ms"] / 1000 for r in cached])
                    print(f"later sessions, warm HTTP cache: {results['cached_sessions']}", flush=True)

                    tab = Tab(browser, url)
                    try:
                        tab.page.goto(url, wait_until="commit")
                        tab.wait_complete(0.0, None, None, True, FIRST_TIMEOUT_MS)
                        changes = sidebar_changes(tab, changes_n)
                        results["sidebar_change_runs"] = changes
                        results["sidebar_changes"] = {k: summarise([r["s"] for r in v]) for k, v in changes.items()}
                        print(f"sidebar changes: {results['sidebar_changes']}", flush=True)
                        switches = page_switches(tab, rounds)
                        results["page_switch_runs"] = switches
                        results["page_switches"] = {k: summarise([r["s"] for r in v]) for k, v in switches.items()}
                        print(f"page switches: {results['page_switches']}", flush=True)
                    finally:
                        tab.close()

                    if not args.no_diagnosis:
                        diagnosis["profiled_later_session"] = open_plan(browser, url, profile=True)
                        tab = Tab(browser, url, cdp=True)
                        try:
                            tab.page.goto(url, wait_until="commit")
                            tab.wait_complete(0.0, None, None, True, FIRST_TIMEOUT_MS)
                            profiled = {}
                            for kind, label, values in SIDEBAR_CHANGES:
                                if kind not in ("batch", "model", "checkpointing"):
                                    continue
                                runs = []
                                for value in values[:2]:
                                    signature = tab.signature()
                                    runs.append({"value": value, **measure_change(
                                        tab, lambda kind=kind, label=label, value=value: do_sidebar_change(tab, kind, label, value),
                                        signature, None, True, profile=True)})
                                profiled[kind] = runs
                            diagnosis["profiled_sidebar_changes"] = profiled
                        finally:
                            tab.close()
                finally:
                    browser.close()
            if not args.no_diagnosis:
                firsts, client = websocket_client(port, 2, 4 if args.quick else 5)
                diagnosis["websocket_client_rerender"] = summarise(client)
                diagnosis["websocket_client_new_session"] = summarise(firsts)
        finally:
            load_test.stop_server(server)

    if not args.no_floor:
        results["streamlit_floor"] = streamlit_floor(later_n)
        print(f"Streamlit's floor, later sessions: {results['streamlit_floor']['later_sessions']}", flush=True)
        results["element_kinds_floor"] = streamlit_floor(later_n, ELEMENT_KINDS_APP)
        print(f"The Plan page's element kinds, later sessions: {results['element_kinds_floor']['later_sessions']}",
              flush=True)
    if not args.no_load_test:
        summary, errors, _ = load_test.run_load_test(load_sessions, load_rerenders)
        results["load_test"] = {"summary": summary, "errors": errors}
        results["errors"] += [f"load test: {e}" for e in errors]
        print(f"load test: {summary}", flush=True)
    if not args.no_diagnosis:
        diagnosis["server_script_apptest"] = server_script_profile(2)
    results["diagnosis"] = diagnosis
    results["diagnosis_summary"] = diagnosis_summary(results)
    results["loadavg_after_full"] = loadavg()
    results["loadavg_after"] = results["loadavg_after_full"].split()[0]
    busy = max(float(results["loadavg_before"]), float(results["loadavg_after"]))
    results["load_note"] = ("other load was running: the 1-minute load average exceeded 1.0"
                            if busy > 1.0 else "no other significant load seen")
    results["wall_s"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(results))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(markdown(results))
    print(f"wrote {out} and {out.with_suffix('.json')} in {results['wall_s']} s")
    return 0


def plotly_text(session: dict) -> str:
    chunk = session.get("plotly_chunk")
    if not chunk:
        return "not in Resource Timing"
    return f"fetched {round(chunk['start_ms'])}-{round(chunk['end_ms'])} ms"


def diagnosis_summary(results: dict) -> list[str]:
    """Plain lines for the Markdown: medians of the phases measured above."""
    lines = []
    runs = [r for kind, v in results.get("sidebar_change_runs", {}).items() if kind != "model" for r in v]

    def med(key, rows):
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.median(values), 1) if values else None

    if runs:
        lines.append(f"Sidebar change (all kinds but model, {len(runs)} changes), medians: input to BackMsg sent "
                     f"{med('input_to_send_ms', runs)} ms; sent to first ForwardMsg {med('send_to_first_message_ms', runs)} "
                     f"ms; sent to script_finished {med('send_to_script_finished_ms', runs)} ms; script_finished to "
                     f"last DOM mutation {med('script_finished_to_done_ms', runs)} ms; "
                     f"{med('messages', runs)} messages, {med('bytes_received', runs)} bytes received; the browser's "
                     f"main thread in tasks over 50 ms: {med('long_tasks_ms', runs)} ms (of it after script_finished "
                     f"{med('long_tasks_after_script_finished_ms', runs)} ms).")
    every_change = [r for v in results.get("sidebar_change_runs", {}).values() for r in v]
    live = [r["live_region_mutations"] for r in every_change if "live_region_mutations" in r]
    if live:
        lines.append(f"Mutations of a screen reader's hidden announcement log, not counted as the page moving (see the "
                     f"module docstring): {sum(live)} in {sum(1 for n in live if n)} of {len(live)} sidebar changes.")
    floor = results.get("streamlit_floor")
    if floor:
        lines.append(f"For scale, Streamlit's floor here (a page of one alert and one metric, its own server, the same "
                     f"config and browser): first session {floor['first_session_s']} s, later sessions p50 "
                     f"{floor['later_sessions']['p50_s']} s, max {floor['later_sessions']['max_s']} s.")
    kinds = results.get("element_kinds_floor")
    if kinds:
        lines.append(f"For scale, a page of one of each element kind the Plan page draws (a radio, a select box, a number "
                     f"input and a toggle in the sidebar; an alert, a metric and an SVG chart in HTML Markdown), "
                     f"nothing computed: first session {kinds['first_session_s']} s, later sessions p50 "
                     f"{kinds['later_sessions']['p50_s']} s, max {kinds['later_sessions']['max_s']} s.")

    def lazy_files(runs):
        counts = [r["lazy_js_files"] for r in runs if "lazy_js_files" in r]
        return statistics.median(counts) if counts else "n/a"

    plan_runs = results.get("later_session_runs", [])
    if plan_runs:
        lines.append("JavaScript files a later session fetches after its websocket opens (an element kind's code, "
                     "fetched when first drawn, six requests at a time over HTTP/1.1), medians: the Plan page "
                     f"{lazy_files(plan_runs)}"
                     + (f", the one-alert page {lazy_files(floor['later_session_runs'])}" if floor else "")
                     + (f", the element kinds' page {lazy_files(kinds['later_session_runs'])}" if kinds else "") + ".")
    diagnosis = results.get("diagnosis", {})
    client = diagnosis.get("websocket_client_rerender")
    if client and client.get("p50_s") is not None:
        fresh = diagnosis["websocket_client_new_session"]
        lines.append(f"The same server from a bare websocket client (no browser, one session at a time): a re-render "
                     f"(batch, sequence, accumulation, checkpointing) p50 {client['p50_s']} s, p95 {client['p95_s']} s; "
                     f"a new session's first render p50 {fresh['p50_s']} s, max {fresh['max_s']} s.")
    apptest = diagnosis.get("server_script_apptest")
    if apptest:
        reruns = ", ".join(f"{k} p50 {v['p50_s']} s" for k, v in apptest["rerun_s"].items())
        top = "; ".join(f"{e['where']} {e['s_per_rerun']} s" for e in apptest["batch_rerun_cumulative_top"][:8])
        first_on = apptest.get("first_checkpointing_on_s")
        if first_on is not None:
            reruns += f" (checkpointing's first time on, a new largest-batch search: {first_on} s)"
        lines.append(f"Server script alone (AppTest, no websocket): re-runs {reruns}; a new session's first run "
                     f"p50 {apptest['new_session_first_run_s']['p50_s']} s; the process's first run "
                     f"{apptest['first_run_s']} s (imports). Under cProfile (about 2x slower), cumulative per batch "
                     f"re-run: {top}. A full gc.collect(2), which Streamlit runs after every script run "
                     f"(runner.postScriptGC), takes {apptest['gc_collect_2_s']['p50_s']} s here "
                     f"({apptest['gc_tracked_objects']:,} tracked objects, {apptest['modules_loaded']:,} modules).")
    profiled = diagnosis.get("profiled_sidebar_changes", {})
    for kind, kind_runs in profiled.items():
        thread = [r["main_thread"] for r in kind_runs]
        files: dict[str, list[float]] = {}
        for r in kind_runs:
            for file, ms in r["js_profile"]["by_file_ms"].items():
                files.setdefault(file, []).append(ms)
        top = ", ".join(f"{f} {round(statistics.median(v))}" for f, v in
                        sorted(files.items(), key=lambda kv: -statistics.median(kv[1]))[:5])
        busy = {key: round(statistics.median(t[key] for t in thread)) for key in thread[0]}
        lines.append(f"Profiled {kind} change (median of {len(kind_runs)}; the profiler slows it): main thread busy "
                     f"{busy['task_ms']} ms, of it script {busy['script_ms']} ms, layout {busy['layout_ms']} ms, "
                     f"style {busy['style_ms']} ms; time by script file, a DOM call counted to its caller "
                     f"(ms): {top}.")
    for name, session in (("First session (fresh server)", results.get("first_session")),
                          ("A later session (profiled)", diagnosis.get("profiled_later_session"))):
        if not session:
            continue
        boot = session["boot_js"]
        lazy = ", ".join(f"{c['file']} ({(c['bytes_decoded'] or 0) / 2**20:.1f} MiB) fetched "
                         f"{round(c['start_ms'])}-{round(c['end_ms'])} ms" for c in session["lazy_js"][:2])
        line = (f"{name}: DOMContentLoaded at {round(session['dom_content_loaded_ms'])} ms; boot JS "
                f"{boot['files']} files, {boot['bytes_decoded'] / 2**20:.1f} MiB, fetched by "
                f"{round(boot['last_response_end_ms'])} ms; websocket open at {round(session['ws_open_ms'] or 0)} ms; "
                f"first ForwardMsg {session['send_to_first_message_ms']} ms and script_finished "
                f"{session['send_to_script_finished_ms']} ms after the first BackMsg; largest JS fetched after the "
                f"websocket opened (Resource Timing, which misses the lazily imported Plotly chunk in some "
                f"sessions): {lazy}; Plotly's chunk: {plotly_text(session)}; "
                f"complete at {round(session['done_ms'])} ms, {session['script_finished_to_done_ms']} ms after "
                "script_finished.")
        if "main_thread" in session:
            line += (f" Main thread busy {session['main_thread']['task_ms']} ms (script "
                     f"{session['main_thread']['script_ms']} ms); time by file (ms): {session['js_profile']['by_file_ms']}.")
        lines.append(line)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
