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


def _tallies() -> tuple[dict, list]:
    """What this process's reliability tests counted: inputs tried by kind, faults survived."""
    tried, survived = {}, []
    for name, module in list(sys.modules.items()):
        if name.endswith("test_bad_input_properties"):
            tried = dict(getattr(module, "TRIED", None) or {})
        if name.endswith("test_reliability"):
            survived = list(getattr(module, "FAULTS_SURVIVED", None) or [])
    return tried, survived


_FROM_WORKERS: dict = {"tried": {}, "survived": []}  # pytest-xdist: the workers' tallies, summed


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the tallies to the controller
        workeroutput["tried"], workeroutput["survived"] = _tallies()


try:
    import xdist  # noqa: F401 (only its hook is needed)
except ImportError:
    pass
else:
    def pytest_testnodedown(node, error):
        output = getattr(node, "workeroutput", {})
        for kind, count in output.get("tried", {}).items():
            _FROM_WORKERS["tried"][kind] = _FROM_WORKERS["tried"].get(kind, 0) + count
        _FROM_WORKERS["survived"] += output.get("survived", [])


def pytest_terminal_summary(terminalreporter):
    """Print how many generated inputs the reliability tests tried (shown with or without -s)."""
    tried, survived = _tallies()
    for kind, count in _FROM_WORKERS["tried"].items():
        tried[kind] = tried.get(kind, 0) + count
    survived += _FROM_WORKERS["survived"]
    if tried:
        parts = ", ".join(f"{count} {kind}" for kind, count in sorted(tried.items()))
        terminalreporter.write_line(f"bad input tried: {sum(tried.values())} inputs ({parts}); "
                                    "every one an estimate or a one-line PlannerInputError")
    if survived:
        terminalreporter.write_line(f"faults injected and survived: {len(survived)} ({', '.join(survived)})")


# Variants of a check a cheaper test in the suite already makes on the same code path (another
# architecture, precision or option through the same probe or search): run by
# `python benchmarks/extended_tests.py` (or `bash scripts/test.sh --extended`), which writes
# benchmarks/results/extended_tests.md, to keep the README's test command short.
def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="run only the tests marked extended (the longer variants), not the suite")


def pytest_configure(config):
    config.addinivalue_line("markers", "extended: a longer variant run by benchmarks/extended_tests.py")


# The longest scopes (a module, or a class of test_probe_random.py), longest first: with
# `--no-loadscope-reorder` (scripts/test.sh) xdist's loadscope hands scopes out in collection
# order and never moves one a worker was given, so a long scope collected late ran alone at the
# end. Without that flag xdist (3.6+) orders scopes by their number of tests instead, and the
# four random-scenario parts (one test each, 50-75 s each) came last: measured 2026-12-04 on a
# fresh HOME (cold probe cache), `bash scripts/test.sh`, one worker idled 112 s of 893. The
# figures below are seconds per scope in that run. Sorting only changes the order, never what runs.
LONGEST_SCOPES_FIRST = (
    "tests/test_fit.py",  # 201 s
    "tests/test_app_finetune.py",  # 132 s
    "tests/test_probe.py",  # 100 s
    "tests/test_probe_random.py::TestRandomScenariosPart1", "tests/test_probe_random.py::TestRandomScenariosPart2",
    "tests/test_probe_random.py::TestRandomScenariosPart3", "tests/test_probe_random.py::TestRandomScenariosPart4",
    "tests/test_seq2seq.py", "tests/test_gpu_measured.py", "tests/test_probe_cache.py",  # 54, 53, 53 s
    "tests/test_activation_model.py",  # 48 s
    "tests/test_app_pages.py", "tests/test_distributed_launch.py", "tests/test_reliability.py",  # 44, 42, 41 s
    "tests/test_probe_more_architectures.py", "tests/test_lora.py", "tests/test_app.py",  # 41, 41, 39 s
    "tests/test_qlora.py", "tests/test_encoder_decoder_probe.py", "tests/test_distributed_comm.py",  # 36, 33, 32 s
)


def _scope_rank(item) -> int:
    for rank, scope in enumerate(LONGEST_SCOPES_FIRST):
        if item.nodeid.startswith(scope + "::"):
            return rank
    return len(LONGEST_SCOPES_FIRST)


def pytest_collection_modifyitems(config, items):
    extended = config.getoption("--extended")
    kept = [item for item in items if (item.get_closest_marker("extended") is not None) == extended]
    kept_ids = {id(item) for item in kept}
    dropped = [item for item in items if id(item) not in kept_ids]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = sorted(kept, key=_scope_rank)  # stable: the rest keep their order
