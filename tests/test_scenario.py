"""Scenario validation and names, independent of any model."""

import pytest

from planner.errors import PlannerInputError
from planner.scenario import Checkpointing, Optimizer, Precision, Scenario, Task, scenario_from_values


def test_values_become_enums():
    scenario = scenario_from_values(task="causal-lm", batch_size="4", seq_len=512, optimizer="ADAMW_BNB_8BIT",
                                    precision="bf16-mixed", gradient_checkpointing="true", grad_accum=2)
    assert scenario.optimizer is Optimizer.ADAMW8BIT
    assert scenario.precision is Precision.BF16_MIXED
    assert scenario.checkpointing is Checkpointing.EVERY_LAYER
    assert scenario.tokens_per_micro_batch == 2048


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("batch_size", -2), ("batch_size", 1.5),
                                         ("seq_len", "x"), ("grad_accum", 0), ("batch_size", True)])
def test_non_positive_integers_are_refused(field, value):
    values = {"task": "causal-lm", "batch_size": 1, "seq_len": 8, field: value}
    with pytest.raises(PlannerInputError):
        scenario_from_values(**values)


def test_dataclass_checks_its_invariants():
    with pytest.raises(PlannerInputError):
        Scenario(task=Task.CAUSAL_LM, batch_size=1, seq_len=0)
    with pytest.raises(PlannerInputError):
        Scenario(task="causal-lm", batch_size=1, seq_len=1)
