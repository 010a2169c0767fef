"""A real model with random weights from a config dict, and synthetic batches for it.

The same config path as the planner (planner.shapes_from_config.load_transformers_config),
so a run and an estimate can never disagree about the architecture. Weights are seeded;
`use_cache=False` because a causal LM otherwise keeps a KV cache during training
(../shared/DESIGN.md, Known facts).
"""

from __future__ import annotations

# One model factory for verification runs and the planner's probe (beneath both).
from planner.probe.build import build_model, synthetic_batch  # noqa: F401
from planner.scenario import Attention, Scenario


def uses_sdpa(scenario: Scenario) -> bool:
    return scenario.attention is Attention.SDPA
