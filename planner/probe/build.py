"""Models and batches for a training step, shared by verification runs and the probe.

A real model with random weights from a config dict (the planner's own config path,
planner.shapes_from_config.load_transformers_config, so a run, a probe and an estimate can
never disagree about the architecture), and synthetic batches for it. Weights are seeded;
`use_cache=False` because a causal LM otherwise keeps a KV cache during training
(../shared/DESIGN.md, Known facts).
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor

from planner.finetune import Method
from planner.scenario import Checkpointing, Precision, Scenario, Task
from planner.shapes_from_config import load_transformers_config

_AUTO_CLASS = {
    Task.SEQUENCE_CLASSIFICATION: "AutoModelForSequenceClassification",
    Task.CAUSAL_LM: "AutoModelForCausalLM",
    Task.MASKED_LM: "AutoModelForMaskedLM",
    Task.TOKEN_CLASSIFICATION: "AutoModelForTokenClassification",
    Task.SEQ2SEQ_LM: "AutoModelForSeq2SeqLM",
}


def build_model(config_dict: dict, scenario: Scenario, seed: int = 0, config=None) -> torch.nn.Module:
    """`config`, when given, is an already loaded (for example depth-reduced) PretrainedConfig."""
    import transformers

    if config is None:
        config = load_transformers_config(config_dict, scenario.task, scenario.num_labels)
    config.use_cache = False
    torch.manual_seed(seed)
    auto_class = getattr(transformers, _AUTO_CLASS[scenario.task])
    # An explicit dtype: transformers 5 otherwise builds in the config's `torch_dtype`
    # (float16 for many published configs); training keeps fp32 master weights, or pure
    # bf16 ones. Built in that dtype rather than converted: a fake-tensor model (simulate
    # mode) cannot be converted in place.
    dtype = torch.bfloat16 if scenario.precision is Precision.BF16 else torch.float32
    from planner.probe.fake_mode import fake_weight_init

    with fake_weight_init():
        model = auto_class.from_config(config, attn_implementation=scenario.attention.value,
                                       trust_remote_code=False, dtype=dtype)
    if scenario.finetune.method is Method.QLORA:
        return quantized_lora(model, scenario)
    if scenario.checkpointing is Checkpointing.EVERY_LAYER:
        model.gradient_checkpointing_enable()
    if scenario.finetune.uses_adapters:
        model = with_adapters(model, scenario)
    model.train()
    return model


COMPUTE_DTYPE = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.BF16_MIXED: torch.bfloat16,
                 Precision.FP16_MIXED: torch.float16}


def quantization_settings(scenario: Scenario):
    """`BitsAndBytesConfig` as a QLoRA user writes it: the scenario's quantisation type and double
    quantisation, the compute dtype the precision computes in."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=scenario.finetune.quant_type,
                              bnb_4bit_use_double_quant=scenario.finetune.double_quant,
                              bnb_4bit_compute_dtype=COMPUTE_DTYPE[scenario.precision])


def quantized_lora(model: torch.nn.Module, scenario: Scenario) -> torch.nn.Module:
    """QLoRA as a user builds it: `from_pretrained(..., quantization_config=BitsAndBytesConfig(...),
    device_map="cpu")`, `prepare_model_for_kbit_training(model, use_gradient_checkpointing=...)`,
    `get_peft_model(model, LoraConfig(...))`. The random model is saved and loaded back through
    `from_pretrained` itself, so transformers' bitsandbytes quantizer decides, as for a user, which
    layers become 4-bit (not the output layer nor tied weights) and how each is stored; the load
    takes the dtype the model was built in. A fake-tensor model takes the same quantiser and
    quantisation without files (planner.probe.fake_quantized), for CUDA plans."""
    import tempfile
    import warnings

    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers.utils import logging

    from planner.adapters import lora_config

    from planner.probe.fake_mode import adapters_cast_in_place
    from planner.probe.fake_quantized import fake_quantized_model

    fake = any(isinstance(p, FakeTensor) for p in model.parameters())
    if fake:  # the same quantiser and quantisation on fake tensors (planner.probe.fake_quantized)
        model = fake_quantized_model(model, quantization_settings(scenario))
    else:
        auto_class = type(model)
        dtype = next(model.parameters()).dtype
        bars = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()  # a run's and the probe's progress is their own
        try:
            with tempfile.TemporaryDirectory(prefix="planner-qlora-") as folder, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.save_pretrained(folder)
                del model
                model = auto_class.from_pretrained(folder, quantization_config=quantization_settings(scenario),
                                                   device_map="cpu", dtype=dtype)
        finally:
            if bars:
                logging.enable_progress_bar()
    model.config.use_cache = False
    with warnings.catch_warnings(), adapters_cast_in_place() if fake else contextlib.nullcontext():
        warnings.simplefilter("ignore")  # transformers' deprecation of is_gradient_checkpointing, read by PEFT
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=scenario.checkpointing is Checkpointing.EVERY_LAYER)
        model = get_peft_model(model, lora_config(scenario.finetune, scenario.task))
    model.train()
    return model


def with_adapters(model: torch.nn.Module, scenario: Scenario) -> torch.nn.Module:
    """LoRA as a user writes it: `get_peft_model(model, LoraConfig(...))` after checkpointing is
    enabled (PEFT then calls `enable_input_require_grads`, so checkpointed blocks of a frozen
    base still reach the adapters' gradients)."""
    from peft import get_peft_model

    from planner.adapters import lora_config
    from planner.probe.fake_mode import adapters_cast_in_place

    if scenario.finetune.method is Method.QLORA:
        raise ValueError("QLoRA is built from a quantised load: build_model builds it (quantized_lora)")
    fake = any(isinstance(p, FakeTensor) for p in model.parameters())
    with adapters_cast_in_place() if fake else contextlib.nullcontext():
        return get_peft_model(model, lora_config(scenario.finetune, scenario.task))


def synthetic_batch(config_dict: dict, scenario: Scenario, seed: int = 0, device: str = "cpu") -> dict:
    """input_ids, an all-ones attention_mask (as a real unpadded batch has) and labels; an
    encoder-decoder's rows end with its end-of-sequence token and hold no other."""
    generator = torch.Generator().manual_seed(seed)
    vocab = int(config_dict.get("vocab_size", 2))
    shape = (scenario.batch_size, scenario.seq_len)
    input_ids = torch.randint(0, vocab, shape, generator=generator)
    eos = config_dict.get("eos_token_id")
    if config_dict.get("is_encoder_decoder") and isinstance(eos, int) and 0 <= eos < vocab and vocab > 1:
        # A tokenizer ends every row with </s>, and an encoder-decoder's sequence classifier
        # reads the decoder's state there (T5, BART: every row must hold the same number).
        input_ids[input_ids == eos] = (eos + 1) % vocab
        input_ids[:, -1] = eos
    batch = {"input_ids": input_ids, "attention_mask": torch.ones(shape, dtype=torch.long)}
    if scenario.task is Task.SEQUENCE_CLASSIFICATION:
        batch["labels"] = torch.randint(0, scenario.num_labels, (scenario.batch_size,), generator=generator)
    elif scenario.task is Task.TOKEN_CLASSIFICATION:
        batch["labels"] = torch.randint(0, scenario.num_labels, shape, generator=generator)
    elif scenario.task is Task.SEQ2SEQ_LM:
        # The model shifts the labels right into its decoder's input (shift_tokens_right).
        batch["labels"] = torch.randint(0, vocab, (scenario.batch_size, scenario.target_len), generator=generator)
    else:
        batch["labels"] = input_ids.clone()
    return {k: v.to(device) for k, v in batch.items()}


MIXED_PRECISION = {Precision.FP32: "no", Precision.BF16: "no", Precision.BF16_MIXED: "bf16",
                   Precision.FP16_MIXED: "fp16"}


def fresh_accelerator(scenario: Scenario, cpu: bool, cuda_kernels: bool = False, **kwargs):
    """The Accelerator of a run of `scenario`, on the CPU (`cpu`) or a GPU. `cuda_kernels`: the
    step runs on fake CPU tensors with CUDA's kernels (planner.probe.fake_cuda), and autocasts as
    accelerate does on a GPU (`autocast_as_on_cuda`)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps process-wide singletons; a run in a process that ran another
    # (tests, benchmarks) must not inherit its precision or accumulation settings.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    # device_placement=False: the caller has put the model and batches where they belong,
    # and a `.to()` of a fake-tensor model (simulate mode) fails on swapping parameters.
    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[scenario.precision],
                              gradient_accumulation_steps=scenario.grad_accum_steps, cpu=cpu, device_placement=False,
                              **kwargs)
    if cuda_kernels:
        autocast_as_on_cuda(accelerator, scenario)
    return accelerator


def autocast_as_on_cuda(accelerator, scenario: Scenario) -> None:
    """Make a CPU Accelerator autocast `scenario`'s precision as accelerate does on a GPU, before
    `prepare` wraps the model's forward.

    accelerate autocasts bf16-mixed on either device, but fp16-mixed only off the CPU
    (Accelerator.__init__ sets `native_amp` for fp16 when the device is not "cpu"): on a CPU it
    runs fp32, so a CUDA plan's step on fake CPU tensors took fp32's activations. With
    `native_amp` on, `prepare` wraps the forward in torch.autocast("cpu", dtype=torch.float16)
    and returns fp32 outputs, as on a GPU; planner.probe.fake_cuda gives autocast CUDA's op lists.
    Its GradScaler is not built: the scaler's step reads `found_inf` with `.item()`, which a fake
    tensor cannot answer, and what it allocates are 0-dim tensors (the scale and its growth
    tracker, kept; the scaled loss, `found_inf` and the inverse scale during the step), one
    512-byte block each on CUDA (torch/amp/grad_scaler.py)."""
    if scenario.precision is Precision.FP16_MIXED:
        accelerator.native_amp = True
