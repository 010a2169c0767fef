"""What the probe tests share: tiny configs at any depth, an estimate beside a measured step
of the same scenario, and the comparison at the issue's 0.1% bar."""

import pytest

from conftest import tiny_config
from planner.estimate import Confidence, Phase, estimate
from planner.loading import model_shape_for_config
from planner.scenario import scenario_from_values
from runners.measure import measure_in_process
from runners.request import Engine, Mode

TOLERANCE = 0.001


@pytest.fixture(autouse=True)
def own_probe_cache(tmp_path, monkeypatch):
    # Fresh probes: never a table another run stored.
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    from planner.probe import cache

    monkeypatch.setattr(cache, "_MEMORY", {})


def deep(name: str, layers: int) -> dict:
    """A tiny config with more blocks than the probe runs (it runs four when all blocks are alike)."""
    config = tiny_config(name)
    key = {"tiny-distilbert": "n_layers", "tiny-gpt2": "n_layer"}.get(name, "num_hidden_layers")
    config[key] = layers
    return config


def compare(config: dict, values: dict, mode: Mode = Mode.SIMULATE):
    scenario = scenario_from_values(device="cpu", **values)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, "tiny")
    estimated = estimate(shape, scenario)
    assert estimated.confidence is Confidence.PROBED, estimated.notes
    measured = measure_in_process(config, "tiny", dict(device="cpu", **values), mode,
                                  engine=Engine(values.get("engine", "accelerate")))["measured"]
    return estimated, measured


def assert_close(estimated, measured, label: str) -> None:
    peak = measured["peak_bytes"]
    error = (estimated.peak_bytes - peak) / peak
    assert abs(error) <= TOLERANCE, f"{label}: estimated {estimated.peak_bytes:,} B, measured {peak:,} B ({error:+.4%})"
    phases = {p.phase.value: p.total for p in estimated.phases}
    for phase in (Phase.FORWARD.value, Phase.BACKWARD.value):
        got, want = phases[phase], measured["phase_peak_bytes"][phase]
        assert abs(got - want) <= TOLERANCE * want, f"{label} {phase}: {got:,} B against {want:,} B"
