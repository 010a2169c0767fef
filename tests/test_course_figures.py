"""The lessons' printed figures for distilbert-base-cased with a 2-label head, reproduced
by the planner and by the real optimizers on the real-size model (random weights)."""

import pytest

from planner.catalog import catalog_config
from planner.cli import main
from planner.estimate import estimate
from planner.loading import load_model_shape
from planner.optimizer_size import compute_optimizer_size
from planner.scenario import Optimizer, Task, scenario_from_values
from runners.model_factory import build_model, synthetic_batch
from runners.optimizers import build_optimizer

COURSE = {  # optimizer -> (state bytes, elements as the lesson counts them, MB as printed)
    Optimizer.ADAMW: (526_264_752, 131_566_188, 502),
    Optimizer.ADAM8BIT: (134_004_336, None, 128),  # the lesson's element count for 8-bit repeats AdamW's
    Optimizer.HF_ADAFACTOR: (714_432, 178_712, 1),
}


def _scenario(optimizer: Optimizer):
    return scenario_from_values(task="sequence-classification", batch_size=2, seq_len=16,
                                optimizer=optimizer.value, device="cpu")


def test_parameter_count_matches_lesson():
    shape = load_model_shape("distilbert-base-cased", Task.SEQUENCE_CLASSIFICATION, 2)
    assert shape.num_parameters == 65_783_042
    assert shape.stats.num_tensors == 104


@pytest.mark.parametrize("optimizer", list(COURSE))
def test_planner_and_real_optimizer_reproduce_lesson(optimizer):
    expected_bytes, expected_elements, expected_mb = COURSE[optimizer]
    shape = load_model_shape("distilbert-base-cased", Task.SEQUENCE_CLASSIFICATION, 2)
    assert estimate(shape, _scenario(optimizer)).optimizer_state_bytes == expected_bytes

    config = catalog_config("distilbert-base-cased")
    model = build_model(config, _scenario(optimizer))
    real = build_optimizer(model, optimizer)
    model(**synthetic_batch(config, _scenario(optimizer))).loss.backward()
    real.step()
    megabytes, elements = compute_optimizer_size(real.state.values())
    assert round(megabytes) == expected_mb
    assert megabytes * 2**20 == expected_bytes
    if expected_elements is not None:
        assert elements == expected_elements


def test_cli_prints_lesson_figures(capsys):
    """The lesson sums every tensor of `optimizer.state`, wherever it lives: that is the CPU
    figure (on CUDA, AdamW's `step` tensors stay on the host and allocations round up)."""
    import json

    for optimizer, (expected_bytes, _, _) in COURSE.items():
        code = main(["estimate", "--config", "distilbert-base-cased", "--task", "sequence-classification",
                     "--num-labels", "2", "--batch-size", "8", "--seq-len", "128",
                     "--optimizer", optimizer.value, "--device", "cpu", "--json"])
        assert code == 0
        result = json.loads(capsys.readouterr().out)
        assert result["num_parameters"] == 65_783_042
        assert result["optimizer_state_bytes"] == expected_bytes
