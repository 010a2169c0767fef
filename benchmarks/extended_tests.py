"""The extended tests: the longer variants the README's test command leaves out (marked
`extended` in tests/; tests/conftest.py says why each is one), run with the suite's two
workers, each test's outcome and seconds written to benchmarks/results/extended_tests.md.

The suite keeps a cheaper test on each of their code paths (another architecture, precision
or option through the same probe or search), which keeps it shorter on two cores;
these run here, before a change lands that touches those paths.

Run: python benchmarks/extended_tests.py   (or `bash scripts/test.sh --extended` for pytest's output)
Exit status: pytest's (0 when every extended test passed).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "extended_tests.md"


def run_extended(report_xml: Path) -> tuple[int, float]:
    """pytest on the extended tests, its JUnit XML at `report_xml`: (exit status, seconds)."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "--extended", "-n", "2", "--dist", "loadscope", "-q",
               "-p", "no:cacheprovider", f"--junitxml={report_xml}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    status = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
    return status, time.perf_counter() - started


def outcomes(report_xml: Path) -> list[tuple[str, str, float]]:
    """(test id, outcome, seconds) per test case in pytest's JUnit XML."""
    rows = []
    for case in ElementTree.parse(report_xml).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test_id = f"{module}.py::{case.get('name')}"
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
        rows.append((test_id, outcome, float(case.get("time", 0.0))))
    return rows


def table(rows: list[tuple[str, str, float]], status: int, wall_s: float) -> str:
    passed = sum(1 for _, outcome, _ in rows if outcome == "passed")
    lines = ["# Extended tests", "",
             f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}; "
             f"{date.today().isoformat()}; command: `python benchmarks/extended_tests.py` "
             "(pytest --extended on two workers).", "",
             f"{passed} of {len(rows)} passed, pytest exit status {status}, {wall_s:.0f} s wall.", "",
             "| test | outcome | seconds |", "|---|---|---:|"]
    lines += [f"| `{test_id}` | {outcome} | {seconds:.1f} |" for test_id, outcome, seconds in sorted(rows)]
    return "\n".join(lines) + "\n"


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        report_xml = Path(folder) / "extended.xml"
        status, wall_s = run_extended(report_xml)
        rows = outcomes(report_xml) if report_xml.exists() else []
    RESULTS.write_text(table(rows, status, wall_s))
    print(f"wrote {RESULTS.relative_to(ROOT)}: {sum(1 for r in rows if r[1] == 'passed')} of {len(rows)} passed")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
