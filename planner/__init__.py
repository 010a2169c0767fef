"""planner: analytic training-memory estimates from a model's config.json alone.

Pure functions over frozen dataclasses; torch/transformers are imported only by
planner.shapes_from_config (lazily) to read exact parameter shapes on the meta device.
"""

from planner.errors import PlannerInputError
from planner.estimate import Estimate, Phase, estimate
from planner.loading import load_model_shape, model_shape_for_config
from planner.model_shape import ModelShape
from planner.scenario import (Attention, Checkpointing, Device, Optimizer, Precision, Scenario, Task,
                              scenario_from_values)

__all__ = [
    "Attention", "Checkpointing", "Device", "Estimate", "ModelShape", "Optimizer", "Phase",
    "PlannerInputError", "Precision", "Scenario", "Task", "estimate", "load_model_shape",
    "model_shape_for_config", "scenario_from_values",
]
