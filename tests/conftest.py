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
