"""Token classification (a label per token: NER, tagging), planned through the probe and
checked against the simulated step of the same model, the lessons' loop on fake tensors
(runners.simulate_measure), on CPU and on CUDA's kernels, in full and with LoRA.

The head is a linear from each token's hidden state to `num_labels` logits, which the loss
flattens and upcasts to fp32 (transformers.loss.loss_utils.ForTokenClassification); no family
recipe is claimed for it, so a model the probe cannot run is refused in one line.

As in tests/test_probe_more_architectures.py, the simulated step reuses one batch where the
probe, like a real loop, holds each micro-batch apart: the estimate may read above by at most
one batch, input_ids, attention_mask and the per-token labels, 3·b·s int64 (seen with
accumulation, where the previous micro-batch is still referenced).
"""

import importlib
import json
from pathlib import Path

import pytest

from planner.config_task import config_task
from planner.errors import PlannerInputError
from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.scenario import Task, scenario_from_values
from runners.simulate_measure import simulate_step

CONFIGS = Path(__file__).parent / "configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_MEMORY", {})


def test_a_token_classifier_config_is_planned_as_one():
    found = config_task({"architectures": ["BertForTokenClassification"], "model_type": "bert"})
    assert found.task is Task.TOKEN_CLASSIFICATION
    assert Task.TOKEN_CLASSIFICATION.uses_labels and not Task.TOKEN_CLASSIFICATION.has_lm_head


@pytest.mark.parametrize("name,values", [
    ("tiny-distilbert", dict(attn="sdpa")),
    ("tiny-llama", dict(attn="sdpa", precision="bf16-mixed", optimizer="adafactor")),
    ("tiny-gpt2", dict(attn="eager", gradient_checkpointing=True, grad_accum=2)),
    # Named targets: with "all-linear" PEFT also adapts the head its TOKEN_CLS task saves whole,
    # and refuses (the planner relays its words; test below).
    ("tiny-llama", dict(attn="sdpa", finetune="lora", lora_r=4, lora_targets="q_proj,v_proj")),
])
def test_a_token_classifier_equals_its_simulated_step_on_cpu(name, values):
    values = dict(task="token-classification", num_labels=9, batch_size=3, seq_len=40, device="cpu", **values)
    config = _config(name)
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, name)
    planned = estimate(shape, scenario)
    assert planned.confidence is Confidence.PROBED, planned.notes
    measured = simulate_step(config, dict(values))
    above = planned.peak_bytes - measured["peak_bytes"]
    one_batch = 3 * values["batch_size"] * values["seq_len"] * 8
    assert 0 <= above <= one_batch, (planned.peak_bytes, measured["peak_bytes"])
    assert planned.optimizer_state_bytes == measured["optimizer_state_bytes"]


def test_a_token_classifier_on_cuda_kernels_equals_its_simulated_step():
    values = dict(task="token-classification", num_labels=5, batch_size=2, seq_len=48, device="cuda",
                  precision="bf16-mixed")
    config = _config("tiny-llama")
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, "tiny-llama")
    planned = estimate(shape, scenario)
    measured = simulate_step(config, dict(values), gpu=cache.CUDA_PROBE_ARCH)
    # A CUDA plan rounds every weight, gradient and state tensor up to 512 bytes; the simulated
    # step does not (benchmarks/random_differential.py, CUDA plans).
    rounding = 3 * 512 * len(shape.params)
    assert 0 <= planned.peak_bytes - measured["peak_bytes"] <= rounding, (planned.peak_bytes, measured["peak_bytes"])


def test_a_token_classifier_the_probe_cannot_run_is_refused_not_guessed(monkeypatch):
    scenario = scenario_from_values(task="token-classification", num_labels=3, batch_size=2, seq_len=16, device="cpu")
    shape = model_shape_for_config(_config("tiny-distilbert"), scenario.task, scenario.num_labels, "tiny-distilbert")
    monkeypatch.setattr(importlib.import_module("planner.estimate"), "_probed_phases",
                        lambda *args: "a reason the probe gave")
    with pytest.raises(PlannerInputError, match="token classification is planned only through the probe") as refused:
        estimate(shape, scenario)
    assert "a reason the probe gave" in str(refused.value) and "\n" not in str(refused.value)


def test_lora_on_all_linear_layers_of_a_token_classifier_is_refused_in_peft_words():
    scenario = scenario_from_values(task="token-classification", num_labels=3, batch_size=2, seq_len=16, device="cpu",
                                    finetune="lora", lora_targets="all-linear")
    shape = model_shape_for_config(_config("tiny-llama"), scenario.task, scenario.num_labels, "tiny-llama")
    with pytest.raises(PlannerInputError, match="PEFT refuses this LoRA configuration"):
        estimate(shape, scenario)


def test_the_strategy_comparison_leaves_out_what_is_not_planned_and_says_why():
    from planner.strategy import Strategy
    from views.multi_gpu_figures import STRATEGY_ORDER, strategy_plans

    scenario = scenario_from_values(task="token-classification", num_labels=3, batch_size=2, seq_len=16, device="cpu")
    shape = model_shape_for_config(_config("tiny-distilbert"), scenario.task, scenario.num_labels, "tiny-distilbert")
    plans = strategy_plans(shape, scenario, 2)
    planned = plans.planned
    assert set(planned) == {Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2}
    line = plans.not_planned_line()
    left_out = [s.value for s in STRATEGY_ORDER if not s.shards_parameters and s not in planned]
    assert not left_out and line.startswith("Not planned: zero3, ") and "token classification with zero3" in line
