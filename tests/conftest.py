"""Shared fixtures: tiny configs of the three families the tests build for real on CPU."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS = Path(__file__).resolve().parent / "configs"


def tiny_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.fixture
def tiny_configs_dir() -> Path:
    return CONFIGS


def pytest_terminal_summary(terminalreporter):
    """Print how many generated inputs the reliability tests tried (shown with or without -s)."""
    for name, module in list(sys.modules.items()):
        tried = getattr(module, "TRIED", None) if name.endswith("test_bad_input_properties") else None
        if tried:
            parts = ", ".join(f"{count} {kind}" for kind, count in sorted(tried.items()))
            terminalreporter.write_line(f"bad input tried: {sum(tried.values())} inputs ({parts}); "
                                        "every one an estimate or a one-line PlannerInputError")
    for name, module in list(sys.modules.items()):
        survived = getattr(module, "FAULTS_SURVIVED", None) if name.endswith("test_reliability") else None
        if survived:
            terminalreporter.write_line(f"faults injected and survived: {len(survived)} ({', '.join(survived)})")
