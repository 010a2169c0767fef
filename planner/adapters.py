"""Exact model states of LoRA and QLoRA: the adapters PEFT creates and the frozen base as
bitsandbytes stores it.

Both are read from the libraries themselves on a model built on the meta device (every
parameter's shape, no memory), so any architecture PEFT and transformers handle is
counted as a user's own run would build it:
- LoRA: `peft.get_peft_model(model, LoraConfig(...))`, then its
  `get_nb_trainable_parameters()`; the trainable bytes in the dtype PEFT gives them
  (`autocast_adapter_dtype`: bf16/fp16 adapters are kept in fp32). A sequence classifier's
  head is a module PEFT trains in full (`modules_to_save`), and its count says so.
- QLoRA: transformers' bitsandbytes quantizer picks the linear layers it converts
  (`Bnb4BitHfQuantizer.get_modules_to_not_convert`: the output layer and tied weights stay),
  `replace_with_bnb_linear` converts them, and each 4-bit weight of n elements is stored
  as bitsandbytes 0.50 stores it (bitsandbytes/_ops.py fake `quantize_4bit`,
  functional.quantize_4bit and quantize_blockwise):
    packed weight   (n + 1) // 2 bytes (uint8 storage)
    absmax          ceil(n / 64) fp32, or with double quantisation ceil(n / 64) uint8 plus
                    ceil(ceil(n / 64) / 256) fp32 (nested absmax), a 256-entry fp32 code
                    copy and a scalar fp32 offset
    code            the 16-entry fp32 4-bit code (get_4bit_type makes one per weight)
  Everything else stays a float parameter; `peft.prepare_model_for_kbit_training` casts
  it to fp32, which is how QLoRA is run (but for the 4-bit layers' biases, which their first
  forward casts to the compute dtype: `QuantizedBase.quantized_bias_elements`) (tests/test_adapters.py checks all of this against
  a real quantised model and PEFT's own counts).
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from dataclasses import dataclass

from planner.errors import PlannerInputError
from planner.finetune import ALL_LINEAR, FineTune
from planner.scenario import Task

BLOCKSIZE = 64  # bitsandbytes' 4-bit default (transformers does not change it)
NESTED_BLOCKSIZE = 256  # double quantisation of the absmax (functional.quantize_4bit)
CODE_ENTRIES = 16  # get_4bit_type: 16 fp32 values
NESTED_CODE_ENTRIES = 256  # create_dynamic_map: 256 fp32 values, copied per weight
_PEFT_TASK = {Task.CAUSAL_LM: "CAUSAL_LM", Task.SEQUENCE_CLASSIFICATION: "SEQ_CLS", Task.MASKED_LM: None,
              Task.TOKEN_CLASSIFICATION: "TOKEN_CLS", Task.SEQ2SEQ_LM: "SEQ_2_SEQ_LM"}


@dataclass(frozen=True)
class AdapterCount:
    trainable_parameters: int  # PEFT's get_nb_trainable_parameters()[0]
    trainable_bytes: int  # in the dtypes PEFT leaves them
    all_parameters: int  # PEFT's get_nb_trainable_parameters()[1]
    all_bytes: int  # every parameter of the wrapped model (frozen base, adapters, trained head copies)
    trainable: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, bytes per element)
    parameter_bytes: tuple[int, ...] = ()  # each parameter tensor's bytes (all_bytes is their sum)


@dataclass(frozen=True)
class QuantizedBase:
    quantized_weights: int  # how many linear weights bitsandbytes stores in 4 bits
    quantized_elements: int  # their elements
    quantized_bytes: int  # packed weights and quantisation state, as stored
    unquantized_elements: int  # every other parameter element (fp32 after prepare_model_for_kbit_training)
    # The 4-bit layers' biases, among unquantized_elements: Linear4bit.forward casts each in place
    # to the compute dtype at the first forward (`bias.data = bias.data.to(x.dtype)`,
    # bitsandbytes 0.50 nn/modules.py), so a run stores them in bf16 under a bf16 compute dtype.
    quantized_bias_elements: int = 0
    # Per tensor, for a device that allocates each in blocks (CUDA): the bytes of every tensor
    # stored for the 4-bit weights, and each other parameter's (elements, is a 4-bit layer's bias).
    stored_tensors: tuple[int, ...] = ()
    unquantized_tensors: tuple[tuple[int, bool], ...] = ()
    weight_elements: tuple[int, ...] = ()  # each 4-bit weight's elements, in module order


def quantized_weight_tensors(elements: int, double_quant: bool) -> tuple[int, ...]:
    """Bytes of each tensor bitsandbytes stores for one 4-bit weight of `elements` values:
    packed weight, absmax, (nested absmax, nested code, offset,) 4-bit code (module doc)."""
    blocks = -(elements // -BLOCKSIZE)
    packed = (elements + 1) // 2
    code = 4 * CODE_ENTRIES
    if not double_quant:
        return packed, 4 * blocks, code
    nested_blocks = -(blocks // -NESTED_BLOCKSIZE)
    return packed, blocks, 4 * nested_blocks, 4 * NESTED_CODE_ENTRIES, 4, code


def quantized_weight_bytes(elements: int, double_quant: bool) -> int:
    """Bytes bitsandbytes stores for one 4-bit weight of `elements` values (module doc)."""
    return sum(quantized_weight_tensors(elements, double_quant))


def _meta_model(source_config: str, task: Task, num_labels: int, dtype_name: str):
    import torch
    import transformers

    from planner.probe.build import _AUTO_CLASS
    from planner.shapes_from_config import load_transformers_config

    config = load_transformers_config(json.loads(source_config), task, num_labels)
    config.use_cache = False
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, _AUTO_CLASS[task]).from_config(
            config, trust_remote_code=False, dtype=getattr(torch, dtype_name))


def lora_config(finetune: FineTune, task: Task):
    from peft import LoraConfig

    targets = ALL_LINEAR if finetune.lora_targets == ALL_LINEAR else list(finetune.lora_targets)
    return LoraConfig(r=finetune.lora_r, lora_alpha=finetune.alpha, lora_dropout=finetune.lora_dropout,
                      target_modules=targets, task_type=_PEFT_TASK[task])


@functools.lru_cache(maxsize=64)
def adapter_count(source_config: str, task: Task, num_labels: int, finetune: FineTune,
                  dtype_name: str = "float32") -> AdapterCount:
    """LoRA's trainable parameters as PEFT creates and counts them (module doc); the catalog's
    default settings are shipped (planner.shipped_adapters)."""
    if not finetune.uses_adapters:
        raise ValueError("full fine-tuning has no adapters")
    from planner.shipped_adapters import shipped_count

    shipped = shipped_count(source_config, task, num_labels, finetune, dtype_name)  # the catalog's, without torch
    if shipped is not None:
        return shipped
    return built_adapter_count(source_config, task, num_labels, finetune, dtype_name)


def built_adapter_count(source_config: str, task: Task, num_labels: int, finetune: FineTune,
                        dtype_name: str = "float32") -> AdapterCount:
    """adapter_count from PEFT itself, on the meta device (what planner/catalog/adapters/ ships)."""
    from peft import get_peft_model

    model = _meta_model(source_config, task, num_labels, dtype_name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = get_peft_model(model, lora_config(finetune, task))
    except ValueError as error:  # PEFT's words: "Target modules {...} not found in the base model..."
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PlannerInputError(f"LoRA cannot wrap this model: {first[:200]}") from None
    except TypeError as error:
        # PEFT itself refuses (a user's get_peft_model raises the same): for a classifier,
        # task SEQ_CLS saves the head in full (modules_to_save) while all-linear also targets it.
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PlannerInputError(f"PEFT refuses this LoRA configuration ({first[:160]}): name the modules to "
                                "adapt, e.g. --lora-targets with the attention projections") from None
    trainable, total = peft_model.get_nb_trainable_parameters()
    tensors = tuple((name, tuple(p.shape), p.element_size()) for name, p in peft_model.named_parameters()
                    if p.requires_grad)
    trainable_bytes = sum(math.prod(shape) * size for _, shape, size in tensors)
    parameter_bytes = tuple(int(p.numel() * p.element_size()) for p in peft_model.parameters())
    return AdapterCount(int(trainable), int(trainable_bytes), int(total), sum(parameter_bytes), tensors,
                        parameter_bytes)


@functools.lru_cache(maxsize=64)
def quantized_base(source_config: str, task: Task, num_labels: int, double_quant: bool,
                   quant_type: str = "nf4") -> QuantizedBase:
    """The frozen base of QLoRA as transformers quantises it with bitsandbytes (module doc);
    the catalog's at the finder's settings are shipped (planner.shipped_adapters)."""
    from planner.shipped_adapters import shipped_quantized

    shipped = shipped_quantized(source_config, task, num_labels, double_quant, quant_type)  # without torch
    if shipped is not None:
        return shipped
    return built_quantized_base(source_config, task, num_labels, double_quant, quant_type)


def built_quantized_base(source_config: str, task: Task, num_labels: int, double_quant: bool,
                         quant_type: str = "nf4") -> QuantizedBase:
    """quantized_base from transformers and bitsandbytes themselves, on the meta device
    (what planner/catalog/adapters/ ships)."""
    import bitsandbytes as bnb
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.integrations import replace_with_bnb_linear
    from transformers.quantizers import AutoHfQuantizer

    model = _meta_model(source_config, task, num_labels, "float32")
    settings = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                  bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.bfloat16)
    quantizer = AutoHfQuantizer.from_config(settings)
    skip = quantizer.get_modules_to_not_convert(model, settings.llm_int8_skip_modules,
                                                getattr(model, "_keep_in_fp32_modules", None))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=settings)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not quantized:
        raise PlannerInputError("bitsandbytes quantises no layer of this model (it has no torch.nn.Linear "
                                "layers transformers converts): use --finetune lora")
    weights = {id(m.weight) for m in quantized}
    bias_ids = {id(m.bias) for m in quantized if m.bias is not None}
    # Linear4bit's bias stays a float parameter; it is among the others.
    others = tuple((int(p.numel()), id(p) in bias_ids) for p in model.parameters() if id(p) not in weights)
    return quantized_base_from(tuple(m.in_features * m.out_features for m in quantized), others, double_quant)


def quantized_base_from(weight_elements: tuple[int, ...], unquantized: tuple[tuple[int, bool], ...],
                        double_quant: bool) -> QuantizedBase:
    """The QuantizedBase of 4-bit weights of these elements and these other parameters
    ((elements, is a 4-bit layer's bias) each)."""
    stored = tuple(t for n in weight_elements for t in quantized_weight_tensors(n, double_quant))
    biases = sum(n for n, is_bias in unquantized if is_bias)
    return QuantizedBase(len(weight_elements), sum(weight_elements), sum(stored), sum(n for n, _ in unquantized),
                         int(biases), stored, unquantized, weight_elements)

