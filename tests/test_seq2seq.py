"""Sequence-to-sequence training (seq2seq-lm: T5, BART, ...ForConditionalGeneration): the
encoder reads seq_len tokens, the decoder trains on target_len (the labels, shifted right
into its input by the model). Planned through the probe at the scenario's target length (a
table per target length, a function of batch and sequence there), and checked against the
simulated step of the same model on CPU and CUDA kernels.

As in tests/test_encoder_decoder_probe.py, the simulated step reuses one batch where the
probe, like a real loop, holds each micro-batch apart: the estimate may read above by one
view of the labels, b·target_len int64.
"""

import pytest
from transformers import AutoConfig

from planner.config_task import config_task
from planner.errors import PlannerInputError
from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
from planner.parallel import parallel_estimate
from planner.probe import cache
from planner.scenario import Task, scenario_from_values
from planner.strategy import ParallelPlan, Strategy
from runners.simulate_measure import simulate_step


def _tiny(model_type: str, **sizes) -> dict:
    config = AutoConfig.for_model(model_type).to_dict()
    config.update(vocab_size=300, **sizes)
    return config


TINY_T5 = _tiny("t5", d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=3, num_decoder_layers=4,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
TINY_BART = _tiny("bart", d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_layers=3, decoder_layers=4, max_position_embeddings=256)


@pytest.fixture(autouse=True, scope="module")
def _isolated(tmp_path_factory):
    # One probe cache for the module: its tests share technique classes (a class holds every
    # batch above 1 and every sequence at one target length).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLANNER_DATA_DIR", str(tmp_path_factory.mktemp("probes")))
        patch.setattr(cache, "_MEMORY", {})
        yield


def _planned(config: dict, name: str, values: dict):
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, name)
    return shape, estimate(shape, scenario)


def test_a_conditional_generation_config_is_planned_as_seq2seq():
    assert config_task({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}).task is Task.SEQ2SEQ_LM
    scenario = scenario_from_values(task="seq2seq-lm", batch_size=2, seq_len=300)
    assert scenario.target_len == 300  # no target length given: the source's, fixed from then on


@pytest.mark.parametrize("name,config,values", [
    ("t5", TINY_T5, dict(attn="eager")),
    ("bart", TINY_BART, dict(attn="sdpa", precision="bf16-mixed", grad_accum=2)),
    pytest.param("t5", TINY_T5, dict(attn="eager", gradient_checkpointing=True, optimizer="adafactor"),
                 marks=pytest.mark.extended),  # checkpointing T5's two stacks: test_encoder_decoder_probe.py
    ("bart", TINY_BART, dict(attn="sdpa", finetune="lora", lora_r=4, lora_targets="q_proj,v_proj")),
])
def test_seq2seq_equals_its_simulated_step_on_cpu(name, config, values):
    values = dict(task="seq2seq-lm", batch_size=3, seq_len=40, target_len=12, device="cpu", **values)
    _, planned = _planned(config, name, values)
    assert planned.confidence is Confidence.PROBED, planned.notes
    measured = simulate_step(config, dict(values))
    labels_view = values["batch_size"] * values["target_len"] * 8
    assert 0 <= planned.peak_bytes - measured["peak_bytes"] <= labels_view, (planned.peak_bytes,
                                                                            measured["peak_bytes"])
    assert planned.optimizer_state_bytes == measured["optimizer_state_bytes"]


def test_the_target_length_is_what_the_decoder_trains_on():
    """Same source, targets 12 (the class probed above) and 48 tokens: the plans differ, and the
    longer target equals its own simulated step too."""
    values = dict(task="seq2seq-lm", batch_size=2, seq_len=32, device="cpu", attn="eager")
    _, short = _planned(TINY_T5, "t5", dict(values, target_len=12))
    _, long = _planned(TINY_T5, "t5", dict(values, target_len=48))
    measured = simulate_step(TINY_T5, dict(values, target_len=48))
    assert 0 <= long.peak_bytes - measured["peak_bytes"] <= 2 * 48 * 8
    assert long.peak_bytes > short.peak_bytes


def test_seq2seq_on_cuda_kernels_equals_its_simulated_step():
    values = dict(task="seq2seq-lm", batch_size=2, seq_len=48, target_len=20, device="cuda", attn="sdpa",
                  precision="bf16-mixed")
    shape, planned = _planned(TINY_BART, "bart", values)
    measured = simulate_step(TINY_BART, dict(values), gpu=cache.CUDA_PROBE_ARCH)
    # A CUDA plan rounds every weight, gradient and state tensor up to 512 bytes; the simulated step does not.
    rounding = 3 * 512 * len(shape.params) + values["batch_size"] * values["target_len"] * 8
    assert 0 <= planned.peak_bytes - measured["peak_bytes"] <= rounding, (planned.peak_bytes, measured["peak_bytes"])


def test_target_lengths_the_model_or_the_task_cannot_take_are_refused_in_one_line():
    with pytest.raises(PlannerInputError, match="target length 300 exceeds bart's 256 positions"):
        _planned(TINY_BART, "bart", dict(task="seq2seq-lm", batch_size=1, seq_len=64, target_len=300, attn="sdpa"))
    with pytest.raises(PlannerInputError, match="a target length is read for seq2seq-lm only"):
        scenario_from_values(task="causal-lm", batch_size=1, seq_len=64, target_len=16)
    with pytest.raises(PlannerInputError, match="target length must be a positive integer"):
        scenario_from_values(task="seq2seq-lm", batch_size=1, seq_len=64, target_len=0)


def test_seq2seq_with_sharded_parameters_is_refused_not_guessed():
    # Refused before anything is estimated.
    scenario = scenario_from_values(task="seq2seq-lm", batch_size=2, seq_len=32, target_len=8, device="cpu",
                                    attn="eager")
    shape = model_shape_for_config(TINY_T5, scenario.task, scenario.num_labels, "t5")
    with pytest.raises(PlannerInputError, match="sequence-to-sequence training with fsdp-full-shard is not planned"):
        parallel_estimate(shape, scenario, ParallelPlan(2, Strategy.FSDP_FULL_SHARD))


def test_the_sidebar_plans_its_target_length_for_seq2seq_only():
    from views.inputs import DEFAULTS, SidebarValues, base_values, scenario_for

    seq2seq = SidebarValues.from_state(DEFAULTS | {"task": "seq2seq-lm", "seq_len": 256, "target_len": 64})
    assert scenario_for(seq2seq).target_len == 64 and base_values(seq2seq)["target_len"] == 64
    classifier = SidebarValues.from_state(DEFAULTS | {"target_len": 64})
    assert scenario_for(classifier).target_len is None and "target_len" not in base_values(classifier)

