"""Load test: N concurrent sessions against a real dashboard server on localhost.

Starts `streamlit run app.py` on 127.0.0.1 (a free port), warms it with one session, then
opens N websocket sessions at once (the browser's protocol: /_stcore/stream, BackMsg
rerun_script with widget states, ForwardMsg deltas until script_finished). Each session
renders the Plan page once, then re-renders it R times, each time changing one scenario
widget (batch size, sequence length, accumulation, checkpointing) so the estimate, the
table and both charts are recomputed and sent. A re-render's time runs from sending the
widget change to receiving script_finished: server-side script time plus the transport of
every delta, as a browser sees it (minus its own drawing).

The server's CPU time over the same phase (/proc, Linux) divided by the renders made is the
work one render costs it: the percentiles also follow whatever else the two cores run.

Any exception element, a run that does not finish successfully, or a session that fails
counts as an error. Bounded: N x R re-renders, each under --render-timeout-s, the whole
run under --budget-s.

    .venv/bin/python benchmarks/load_test.py                 # 20 sessions x 5 re-renders
    .venv/bin/python benchmarks/load_test.py --out benchmarks/results/load_test.md

(Streamlit's AppTest is not thread-safe: AppTest sessions in threads fail with
KeyErrors inside AppTest itself, so concurrency is measured against a real server.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import websockets
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

ROOT = Path(__file__).resolve().parents[1]
# (widget key, WidgetState field, values a session cycles through)
CHANGES = [("batch_size", "int_value", [16, 4, 32]), ("seq_len", "int_value", [256, 512, 64]),
           ("grad_accum", "int_value", [4, 1, 8]), ("gradient_checkpointing", "bool_value", [True, False, True])]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Session:
    def __init__(self, url: str, render_timeout_s: float):
        self.url, self.timeout = url, render_timeout_s
        self.ids: dict[str, str] = {}  # widget key -> widget id
        self.states: dict[str, tuple[str, object]] = {}  # widget id -> (field, value) sent every rerun
        self.errors: list[str] = []

    async def render(self, ws) -> float:
        message = BackMsg()
        message.rerun_script.query_string = ""
        message.rerun_script.page_script_hash = ""
        for widget_id, (field, value) in self.states.items():
            state = message.rerun_script.widget_states.widgets.add()
            state.id = widget_id
            setattr(state, field, value)
        start = time.perf_counter()
        await ws.send(message.SerializeToString())
        while True:
            forward = ForwardMsg()
            forward.ParseFromString(await asyncio.wait_for(ws.recv(), self.timeout))
            kind = forward.WhichOneof("type")
            if kind == "delta" and forward.delta.WhichOneof("type") == "new_element":
                element = forward.delta.new_element
                inner = getattr(element, element.WhichOneof("type"))
                if element.WhichOneof("type") == "exception":
                    self.errors.append(f"exception: {inner.message[:150]}")
                widget_id = getattr(inner, "id", "")
                if widget_id.startswith("$$ID-"):
                    self.ids[widget_id.rsplit("-", 1)[-1]] = widget_id
            elif kind == "script_finished":
                if forward.script_finished not in (0, 2):  # successfully; early for a rerun
                    self.errors.append(f"script finished with status {forward.script_finished}")
                return time.perf_counter() - start

    async def run(self, index: int, rerenders: int, start: asyncio.Event) -> tuple[float | None, list[float]]:
        times: list[float] = []
        first = None
        try:
            async with websockets.connect(self.url, subprotocols=["streamlit"], max_size=None,
                                          open_timeout=self.timeout) as ws:
                await start.wait()
                first = await self.render(ws)
                for step in range(rerenders):
                    key, field, values = CHANGES[(index + step) % len(CHANGES)]
                    if key not in self.ids:
                        self.errors.append(f"widget {key!r} not shown")
                        break
                    self.states[self.ids[key]] = (field, values[(index // len(CHANGES) + step) % len(values)])
                    times.append(await self.render(ws))
        except Exception as error:  # a failed session is a finding, not a crash of the benchmark
            self.errors.append(f"{type(error).__name__}: {error}"[:200])
        return first, times


async def drive(url: str, sessions: int, rerenders: int, render_timeout_s: float, budget_s: float):
    start = asyncio.Event()
    clients = [Session(url, render_timeout_s) for _ in range(sessions)]
    tasks = [asyncio.create_task(c.run(i, rerenders, start)) for i, c in enumerate(clients)]
    await asyncio.sleep(0.2)
    start.set()
    done, pending = await asyncio.wait(tasks, timeout=budget_s)
    for task in pending:
        task.cancel()
    results = [t.result() if t in done else (None, []) for t in tasks]
    errors = [f"session {i}: {e}" for i, c in enumerate(clients) for e in c.errors]
    return results, errors, len(pending)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(15)
    except subprocess.TimeoutExpired:
        server.kill()


def start_server(port: int, data_dir: str, script: Path | None = None) -> subprocess.Popen:
    """The dashboard as scripts/dashboard.sh starts it (the README's command): scripts/serve.py,
    with the project's .streamlit/config.toml (cwd). `script`: another Streamlit script instead,
    run by `streamlit run` under the same config."""
    env = {**os.environ, "PLANNER_DATA_DIR": data_dir}
    command = ([sys.executable, str(ROOT / "scripts" / "serve.py")] if script is None
               else [sys.executable, "-m", "streamlit", "run", str(script)])
    server = subprocess.Popen([*command, "--server.port", str(port), "--server.address", "127.0.0.1",
                               "--server.headless", "true", "--browser.gatherUsageStats", "false"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1)
            return server
        except OSError:
            if server.poll() is not None:
                raise RuntimeError("the streamlit server exited while starting")
            time.sleep(0.25)
    server.terminate()
    raise RuntimeError("the streamlit server did not answer /_stcore/health in 60 s")


def cpu_model() -> str:
    """The processor's name as /proc/cpuinfo gives it; "" where there is none. Timings of
    one machine compare; a changed host shows here."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far, all its threads (Linux's
    /proc/<pid>/stat, fields 14 and 15, in clock ticks); None where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_load_test(sessions: int = 20, rerenders: int = 5, render_timeout_s: float = 60.0,
                  budget_s: float = 300.0) -> tuple[dict, list[str], int]:
    """(summary, errors, sessions unfinished) of one load test on a freshly started server."""
    port = free_port()
    with tempfile.TemporaryDirectory() as data_dir:
        server = start_server(port, data_dir)
        try:
            url = f"ws://127.0.0.1:{port}/_stcore/stream"
            t0 = time.perf_counter()
            asyncio.run(drive(url, 1, 1, 120.0, 180.0))  # warm: imports, catalog, first shape build
            warm_s = time.perf_counter() - t0
            t0, cpu0 = time.perf_counter(), process_cpu_s(server.pid)
            results, errors, unfinished = asyncio.run(drive(url, sessions, rerenders, render_timeout_s, budget_s))
            wall, cpu1 = time.perf_counter() - t0, process_cpu_s(server.pid)
        finally:
            stop_server(server)

    times = [t for _, session_times in results for t in session_times]
    firsts = [first for first, _ in results if first is not None]
    summary = {
        "concurrent sessions": sessions, "re-renders per session": rerenders,
        "re-renders done": len(times), "sessions with an error": len({e.split(":")[0] for e in errors}),
        "sessions not finished in budget": unfinished,
        "re-render p50 (s)": round(percentile(times, 50), 3), "re-render p95 (s)": round(percentile(times, 95), 3),
        "re-render max (s)": round(max(times), 3) if times else None,
        "re-render mean (s)": round(statistics.fmean(times), 3) if times else None,
        "first render p95 (s)": round(percentile(firsts, 95), 3),
        "wall time (s)": round(wall, 1), "server warm-up render (s)": round(warm_s, 1),
        # The server's own work, first renders included: steadier from run to run than the
        # percentiles, which follow whatever else the two cores run meanwhile.
        "server CPU per render (ms)": None if cpu0 is None or cpu1 is None or not results else
        round(1000 * (cpu1 - cpu0) / (len(times) + len(firsts)), 1),
    }
    return summary, errors, unfinished


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--rerenders", type=int, default=5)
    parser.add_argument("--render-timeout-s", type=float, default=60.0)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--out", help="write a Markdown summary here")
    args = parser.parse_args(argv)

    summary, errors, unfinished = run_load_test(args.sessions, args.rerenders, args.render_timeout_s, args.budget_s)
    for key, value in summary.items():
        print(f"{key:<34}{value}")
    for error in errors[:20]:
        print("ERROR", error)
    if args.out:
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}"
        lines = ["# Load test: concurrent sessions on the Plan page", "",
                 f"Command: `.venv/bin/python benchmarks/load_test.py --sessions {args.sessions} "
                 f"--rerenders {args.rerenders} --out {args.out}`", "",
                 f"Machine: {machine}; run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
                 "One `streamlit run app.py` server on 127.0.0.1; each session is a websocket client speaking the "
                 "browser's protocol. All sessions start together; every re-render changes one scenario widget so "
                 "the estimate, table and charts are recomputed and sent. Time: from sending the change to "
                 "`script_finished` (server script time + transport; not the browser's drawing).",
                 "", "| measure | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in summary.items()]
        lines += ["", "Errors: " + ("none" if not errors else "; ".join(errors[:20]))]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if errors or unfinished else 0


if __name__ == "__main__":
    raise SystemExit(main())
