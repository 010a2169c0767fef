"""Optimizer state: the planner's bytes equal the real optimizer's, byte for byte.

Each case builds the real model from a tiny config, the real optimizer, takes a step,
and sums the unique storages in `optimizer.state` (planner.optimizer_size).
"""

import math

import pytest

from conftest import tiny_config
from planner.catalog import catalog_config
from planner.loading import model_shape_for_config
from planner.optimizer_size import optimizer_state_storage
from planner.optimizer_state import model_paged_state_bytes, optimizer_state_bytes
from planner.scenario import Device, Engine, Optimizer, Precision, scenario_from_values
from runners.model_factory import build_model, synthetic_batch
from runners.optimizers import build_optimizer

MODELS = [("tiny-distilbert", "sequence-classification"), ("tiny-gpt2", "causal-lm"), ("tiny-llama", "causal-lm")]


def _real_state_bytes(name: str, task: str, optimizer: Optimizer, precision: Precision) -> int:
    config = tiny_config(name)
    scenario = scenario_from_values(task=task, batch_size=2, seq_len=16, optimizer=optimizer.value,
                                    precision=precision.value, device="cpu")
    model = build_model(config, scenario)
    real_optimizer = build_optimizer(model, optimizer)
    model(**synthetic_batch(config, scenario)).loss.backward()
    real_optimizer.step()
    return optimizer_state_storage(real_optimizer.state.values())[0]


@pytest.mark.parametrize("name,task", MODELS)
@pytest.mark.parametrize("optimizer", list(Optimizer))
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_state_bytes_equal_real_optimizer(name, task, optimizer, precision):
    scenario = scenario_from_values(task=task, batch_size=2, seq_len=16)
    shape = model_shape_for_config(tiny_config(name), scenario.task, 2, name)
    planned = optimizer_state_bytes(shape, optimizer, precision)
    assert planned == _real_state_bytes(name, task, optimizer, precision)


def test_mixed_precision_state_is_fp32_like_fp32():
    # Autocast leaves parameters (and so the optimizer's state) in fp32.
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=16)
    shape = model_shape_for_config(tiny_config("tiny-llama"), scenario.task, 2, "tiny-llama")
    assert (optimizer_state_bytes(shape, Optimizer.ADAMW, Precision.BF16_MIXED)
            == _real_state_bytes("tiny-llama", "causal-lm", Optimizer.ADAMW, Precision.BF16_MIXED))


def test_hf_adafactor_matches_what_training_arguments_builds(tmp_path):
    """runners builds transformers' Adafactor with the kwargs Trainer derives from optim="adafactor"."""
    from transformers import Trainer, TrainingArguments
    from transformers.optimization import Adafactor

    args = TrainingArguments(output_dir=str(tmp_path), optim="adafactor", report_to=[])
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert optimizer_cls is Adafactor
    assert kwargs["scale_parameter"] is False and kwargs["relative_step"] is False


def test_cuda_figures_round_allocations_and_leave_step_on_host():
    """On CUDA the caching allocator hands out 512-byte blocks, and AdamW (neither fused nor
    capturable) hosts `step` on the CPU: the lesson's model has 104 tensors, 2-label head."""
    from planner.loading import load_model_shape
    from planner.scenario import Device, Task

    shape = load_model_shape("distilbert-base-cased", Task.SEQUENCE_CLASSIFICATION, 2)
    on_cpu = optimizer_state_bytes(shape, Optimizer.ADAMW, Precision.FP32, Device.CPU)
    on_cuda = optimizer_state_bytes(shape, Optimizer.ADAMW, Precision.FP32, Device.CUDA)
    blocks = sum(-(-p.numel * 4 // 512) * 512 for p in shape.params)  # one block-rounded fp32 copy
    assert on_cpu == 526_264_752
    assert on_cuda == 2 * blocks
    fused = optimizer_state_bytes(shape, Optimizer.ADAMW_FUSED, Precision.FP32, Device.CUDA)
    assert fused == on_cuda + 512 * len(shape.params)  # fused keeps `step` on the device


@pytest.mark.parametrize("engine", [Engine.ACCELERATE, Engine.TRAINER])
def test_paged_buffers_are_the_ones_bitsandbytes_pages(monkeypatch, engine):
    """bitsandbytes itself decides which state buffers go to unified memory
    (`Optimizer8bit.get_state_buffer`): asked for every parameter of GPT-2 (meta tensors: not
    on the CPU, where it never pages), with `functional.get_paged` recording what it is asked
    for, its paged bytes equal `model_paged_state_bytes` on CUDA, and nothing is paged on CPU."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    import torch

    paged = []

    def record_paged(*shape, dtype=torch.float32, device=None):
        paged.append(math.prod(shape) * dtype.itemsize)
        return torch.empty(shape, dtype=dtype, device="meta")

    monkeypatch.setattr(F, "get_paged", record_paged)
    monkeypatch.setattr(F, "fill", lambda tensor, value: None)
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=8)
    shape = model_shape_for_config(catalog_config("gpt2"), scenario.task, 2, "gpt2")
    fp32_embeddings = engine is Engine.TRAINER  # Trainer's register_module_override (module doc)
    params = [torch.nn.Parameter(torch.empty(p.shape, device="meta")) for p in shape.params]
    optimizer = bnb.optim.PagedAdamW8bit(params, lr=1e-3)
    for p, tensor in zip(params, shape.params):
        in_32_bit = p.numel() < 4096 or (fp32_embeddings and tensor.name in shape.embedding_param_names)
        for _ in ("state1", "state2"):
            optimizer.get_state_buffer(p, dtype=torch.float32 if in_32_bit else torch.uint8)
    assert paged and sum(paged) == model_paged_state_bytes(shape, Optimizer.PAGED_ADAMW8BIT, Precision.FP32,
                                                           Device.CUDA, engine)
    assert model_paged_state_bytes(shape, Optimizer.PAGED_ADAMW8BIT, Precision.FP32, Device.CPU, engine) == 0
    assert model_paged_state_bytes(shape, Optimizer.ADAMW8BIT, Precision.FP32, Device.CUDA, engine) == 0
