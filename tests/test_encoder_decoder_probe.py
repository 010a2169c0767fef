"""Encoder-decoders probed from their own code (planner.probe.run: two stacks of blocks).

Before, the probe refused any model with a second stack of blocks ("a second stack of blocks
(transformer.decoder.block) is not reduced with transformer.encoder.block") and a generic
decoder recipe stood in: T5-small's sequence classifier at 4 x 256 tokens was 42.5% low
against its simulated step. Now both stacks are probed at full depth, blocks numbered on
from the encoder into the decoder, and what their classifiers read from the batch is sized
from its values: the `<eos>` positions (`hidden[input_ids == eos]`, planner.probe.fake_mode)
and T5's `unique_consecutive` check. On CUDA's kernels, T5's position bias trains, so the
memory-efficient kernel returns its gradient with ceil16(s) columns and the padded mask's
slice has a ceil8(s) gradient (planner.probe.fake_cuda), both sized as the kernels size them.

Each estimate is checked against the model's step simulated at full depth (runners'
simulate_step, MemTracker), which reuses one batch every step; the probe runs the previous
step's batch as a batch of its own, and these models keep a view of its input_ids and
labels (T5's and BART's `shift_right`, the loss's `labels.view(-1)`). So the estimate may be
above by at most that batch's input_ids and labels: (b·s + b)·8 bytes, named below.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.probe.fake_mode import fake_batch, simulation
from planner.scenario import scenario_from_values
from runners.simulate_measure import simulate_step

# Encoder and decoder of different depths: the stacks must be told apart by their own counts.
TINY_T5 = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 64, "d_ff": 128,
           "d_kv": 16, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 3, "vocab_size": 300,
           "relative_attention_num_buckets": 8, "relative_attention_max_distance": 20,
           "feed_forward_proj": "gated-gelu", "dropout_rate": 0.1, "is_encoder_decoder": True,
           "tie_word_embeddings": False, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
TINY_BART = {"architectures": ["BartForConditionalGeneration"], "model_type": "bart", "d_model": 64,
             "encoder_layers": 3, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
             "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 300, "max_position_embeddings": 128,
             "dropout": 0.1, "is_encoder_decoder": True, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
             "decoder_start_token_id": 2}
CONFIGS = {"t5": TINY_T5, "bart": TINY_BART}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_MEMORY", {})


def _previous_batch_views(values: dict) -> int:
    """The previous step's input_ids and labels the probe holds apart (module docstring)."""
    return (values["batch_size"] * values["seq_len"] + values["batch_size"]) * 8


def _estimate_and_measure(name: str, values: dict):
    config = CONFIGS[name]
    scenario = scenario_from_values(task="sequence-classification", **values)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, f"tiny-{name}")
    planned = estimate(shape, scenario)
    assert planned.confidence is Confidence.PROBED, planned.notes
    measured = simulate_step(config, dict(values, task="sequence-classification"), gpu=cache.probe_gpu(scenario))
    return shape, planned, measured


FP32_SDPA = dict(batch_size=3, seq_len=20, device="cpu")
BF16_CHECKPOINTED_EAGER = dict(batch_size=2, seq_len=37, device="cpu", precision="bf16-mixed",
                               gradient_checkpointing=True, attn="eager")


# Each model in both sets of techniques; the suite runs one set per model (the other: extended).
@pytest.mark.parametrize("name,values", [
    pytest.param("t5", FP32_SDPA, id="fp32-sdpa-t5", marks=pytest.mark.extended),
    pytest.param("bart", FP32_SDPA, id="fp32-sdpa-bart"),
    pytest.param("t5", BF16_CHECKPOINTED_EAGER, id="bf16-mixed-checkpointed-eager-t5"),
    pytest.param("bart", BF16_CHECKPOINTED_EAGER, id="bf16-mixed-checkpointed-eager-bart", marks=pytest.mark.extended),
])
def test_an_encoder_decoder_classifier_is_probed_and_equals_its_simulated_step(name, values):
    _, planned, measured = _estimate_and_measure(name, values)
    above = planned.peak_bytes - measured["peak_bytes"]
    assert 0 <= above <= _previous_batch_views(values), (name, planned.peak_bytes, measured["peak_bytes"])
    assert planned.optimizer_state_bytes == measured["optimizer_state_bytes"]


def test_t5_on_cuda_kernels_sizes_its_position_bias_gradients_as_the_kernels_do():
    # The memory-efficient kernel (fp32, a float mask) takes T5's bias; it trains.
    values = dict(batch_size=2, seq_len=21, device="cuda")
    shape, planned, measured = _estimate_and_measure("t5", values)
    # The estimate rounds each weight, gradient and AdamW state tensor to the caching
    # allocator's 512-byte blocks; the simulated step counts them at their exact size.
    rounding = 4 * 511 * len(shape.params)
    above = planned.peak_bytes - measured["peak_bytes"]
    assert 0 <= above <= rounding + _previous_batch_views(values), (planned.peak_bytes, measured["peak_bytes"])
    assert "efficient" in measured["attention_backends"], measured["attention_backends"]


def test_t5_in_fp16_autocast_on_cuda_kernels_equals_its_simulated_step():
    """fp16-mixed autocasts on CUDA (planner.probe.build.autocast_as_on_cuda), and T5's code
    takes an fp16-only path (it clamps fp16 hidden states to the type's range): the probe,
    extrapolated from a reduced model, against the full model's simulated step."""
    values = dict(batch_size=2, seq_len=21, device="cuda", precision="fp16-mixed")
    shape, planned, measured = _estimate_and_measure("t5", values)
    rounding = 4 * 511 * len(shape.params)  # as in the test above
    above = planned.peak_bytes - measured["peak_bytes"]
    assert 0 <= above <= rounding + _previous_batch_views(values), (planned.peak_bytes, measured["peak_bytes"])
    fp32 = estimate(shape, scenario_from_values(task="sequence-classification", batch_size=2, seq_len=21,
                                                device="cuda"))
    # Autocast ran: at this size its 16-bit weight copies outweigh the halved activations.
    assert planned.activations_bytes != fp32.activations_bytes


def test_activations_picked_by_a_mask_made_from_the_batch_have_the_real_count():
    mode = FakeTensorMode()
    input_ids = torch.tensor([[5, 7, 1], [1, 4, 1]])  # eos (1) twice in the second row
    batch = fake_batch(mode, {"input_ids": input_ids})
    with simulation(mode):
        hidden = torch.randn(2, 3, 8)  # made in fake mode: no values
        picked = hidden[batch["input_ids"].eq(1), :]
        assert tuple(picked.shape) == (3, 8)
        counts = torch.unique_consecutive(batch["input_ids"].eq(1).sum(1))
        assert tuple(counts.shape) == (2,)  # 1 and 2: sized from the values


def test_a_decoder_run_without_its_encoder_holds_no_state_for_its_cross_attention():
    """BartForCausalLM runs BART's decoder alone: its cross-attention weights exist but no
    encoder output reaches them, so they get no gradient and AdamW keeps no state for them
    (+17% state, +6.6% peak on BART-base before the probe recorded which parameters train)."""
    values = dict(task="causal-lm", batch_size=2, seq_len=19, device="cpu")
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(TINY_BART, scenario.task, scenario.num_labels, "tiny-bart")
    planned = estimate(shape, scenario)
    assert planned.confidence is Confidence.PROBED, planned.notes
    measured = simulate_step(TINY_BART, dict(values))
    assert planned.optimizer_state_bytes == measured["optimizer_state_bytes"]
    # AdamW: two fp32 moments per element and a 4-byte step per tensor, for the cross-attention
    # tensors the real optimizer (measured above) never saw.
    cross_attention = [p for p in shape.params if ".encoder_attn" in p.name]
    assert cross_attention
    every_parameter = sum(2 * 4 * p.numel + 4 for p in shape.params)
    assert every_parameter - planned.optimizer_state_bytes == sum(2 * 4 * p.numel + 4 for p in cross_attention)
    assert 0 <= planned.peak_bytes - measured["peak_bytes"] <= _previous_batch_views(values)
    assert any("get no gradient" in note and "encoder_attn" in note for note in planned.notes)
