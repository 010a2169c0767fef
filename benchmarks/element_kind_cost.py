"""What each Streamlit element kind the Plan page draws costs a new browser session here.

One page per kind: Streamlit's floor (one alert and one metric, as benchmarks/browser_speed.py
times it) plus one element of that kind, each on its own fresh server, timed as the browser
benchmark times the Plan page (`streamlit_floor`: a first session, then later sessions in new
browser contexts, cold HTTP cache). A kind's JavaScript is fetched when a session first draws
one, so the difference to the floor page is what that kind adds to a new session's first page.
Writes benchmarks/results/element_kind_cost.md.

Run: .venv/bin/python benchmarks/element_kind_cost.py [--later N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import browser_speed  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "element_kind_cost.md"
SVG = ("<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 40 10' width='100%'>"
       "<rect width='8' height='8'><title>a bar</title></rect></svg>")
# Each kind as the dashboard draws it (app.py's sidebar, the Plan page).
KINDS = {
    "floor (alert and metric only)": "",
    "radio (sidebar, horizontal)": 'with st.sidebar:\n    st.radio("Model from", ["Catalog", "Upload", "Hub"], horizontal=True)\n',
    "select box (sidebar)": 'with st.sidebar:\n    st.selectbox("Catalog model", ["a", "b", "c"])\n',
    "number input (sidebar)": 'with st.sidebar:\n    st.number_input("Batch size", min_value=1, value=8, step=1)\n',
    "toggle (sidebar)": 'with st.sidebar:\n    st.toggle("Gradient checkpointing")\n',
    "SVG in HTML Markdown": f'st.markdown("{SVG}", unsafe_allow_html=True)\n',
    "Markdown table": 'st.markdown("| a | b |\\n|---|--:|\\n| 1 | 2 |")\n',
    "expander": 'with st.expander("Allocated, reserved and CUDA overheads"):\n    st.write("x")\n',
    "columns": 'a, b = st.columns(2)\na.metric("Largest batch", "87")\nb.metric("Largest sequence", "512")\n',
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--later", type=int, default=5, help="later sessions per page (default 5)")
    args = parser.parse_args()
    before = browser_speed.loadavg()
    rows = []
    for kind, code in KINDS.items():
        # The floor page itself, with the kind's element after its alert and metric.
        result = browser_speed.streamlit_floor(args.later, browser_speed.FLOOR_APP + code)
        lazy = statistics.median(run["lazy_js_files"] for run in result["later_session_runs"])
        rows.append((kind, result["first_session_s"], result["later_sessions"]["p50_s"], lazy))
        print(f"{kind}: first {rows[-1][1]:.3f} s, later p50 {rows[-1][2]:.3f} s, {lazy:g} JS files", flush=True)
    floor = rows[0][2]
    lines = ["# What each element kind costs a new session", "",
             f"Command: `.venv/bin/python benchmarks/element_kind_cost.py --later {args.later}`; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {browser_speed.machine()}.", "",
             f"Load: /proc/loadavg {before} before, {browser_speed.loadavg()} after.", "",
             "Each page is the floor page (one alert, one metric) plus one element of the kind, on its own "
             "fresh server; later sessions are new browser contexts (cold HTTP cache), timed to the complete "
             "page as benchmarks/browser_speed.py times the Plan page.", "",
             "| element kind | first session (s) | later sessions, median (s) | over the floor (s) | "
             "JS files fetched after the websocket opens (median) |",
             "|---|---:|---:|---:|---:|"]
    for kind, first, later, lazy in rows:
        lines.append(f"| {kind} | {first:.3f} | {later:.3f} | {later - floor:+.3f} | {lazy:g} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
