"""LoRA and QLoRA model states (planner.adapters) against independent counts: a published
figure, r·(in + out) summed over the layers a target list names, and the storage of a model
transformers and bitsandbytes really quantised on this CPU."""

import json
import tempfile
import warnings

import pytest
import torch

from conftest import tiny_config
from planner.adapters import adapter_count, lora_config, quantized_base
from planner.errors import PlannerInputError
from planner.finetune import FineTune, Method, finetune_from_values
from planner.loading import load_model_shape, model_shape_for_config
from planner.scenario import Task


def _lora(targets, r=16) -> FineTune:
    return finetune_from_values("lora", lora_r=r, lora_targets=targets)


def test_llama_2_7b_query_and_value_adapters_are_the_published_count():
    # PEFT's own example figure (the issue quotes it): r=16 on q_proj and v_proj.
    shape = load_model_shape("llama-2-7b", Task.CAUSAL_LM)
    assert adapter_count(shape.source_config, Task.CAUSAL_LM, 2, _lora("q_proj,v_proj")).trainable_parameters \
        == 8_388_608


def _linear_layers(shape) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of every linear layer but the output layer, from the built model itself."""
    import transformers
    from transformers.pytorch_utils import Conv1D

    from planner.shapes_from_config import load_transformers_config

    config = load_transformers_config(json.loads(shape.source_config), Task.CAUSAL_LM, 2)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    output = model.get_output_embeddings()
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not output:
            layers[name] = (module.in_features, module.out_features)
        elif isinstance(module, Conv1D):
            layers[name] = tuple(module.weight.shape)  # Conv1D stores (in, out)
    return layers


# Eight catalog models, two named target lists each and all-linear.
MODELS = {
    "llama-2-7b": ("q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj"),
    "llama-3.2-1b": ("q_proj,v_proj", "gate_proj,up_proj,down_proj"),
    "qwen2-0.5b": ("q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj"),
    "gemma-2b": ("q_proj,v_proj", "o_proj,down_proj"),
    "phi-2": ("q_proj,v_proj", "fc1,fc2"),
    "gpt2": ("c_attn", "c_attn,c_proj"),
    "opt-1.3b": ("q_proj,v_proj", "fc1,fc2"),
    "pythia-160m": ("query_key_value", "query_key_value,dense"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_trainable_parameters_are_r_times_in_plus_out_over_the_targeted_layers(name):
    shape = load_model_shape(name, Task.CAUSAL_LM)
    layers = _linear_layers(shape)
    r = 16
    for targets in (*MODELS[name], "all-linear"):
        names = None if targets == "all-linear" else targets.split(",")
        chosen = [dims for layer, dims in layers.items()
                  if names is None or layer.rsplit(".", 1)[-1] in names]
        expected = sum(r * (fan_in + fan_out) for fan_in, fan_out in chosen)
        got = adapter_count(shape.source_config, Task.CAUSAL_LM, 2, _lora(targets, r))
        assert got.trainable_parameters == expected, (name, targets)
        assert got.trainable_bytes == 4 * expected  # fp32 adapters on an fp32 base


def test_bf16_adapters_are_kept_in_fp32_as_peft_casts_them():
    shape = model_shape_for_config(tiny_config("tiny-llama"), Task.CAUSAL_LM, 2, "tiny")
    count = adapter_count(shape.source_config, Task.CAUSAL_LM, 2, _lora("q_proj,v_proj"), "bfloat16")
    assert count.trainable_bytes == 4 * count.trainable_parameters


def test_a_sequence_classifier_trains_its_head_in_full():
    shape = model_shape_for_config(tiny_config("tiny-llama"), Task.SEQUENCE_CLASSIFICATION, 3, "tiny")
    with_head = adapter_count(shape.source_config, Task.SEQUENCE_CLASSIFICATION, 3, _lora("q_proj,v_proj"))
    lm = model_shape_for_config(tiny_config("tiny-llama"), Task.CAUSAL_LM, 2, "tiny")
    adapters = adapter_count(lm.source_config, Task.CAUSAL_LM, 2, _lora("q_proj,v_proj")).trainable_parameters
    hidden = tiny_config("tiny-llama")["hidden_size"]
    assert with_head.trainable_parameters == adapters + 3 * hidden  # the `score` head, no bias


def test_a_target_the_model_lacks_is_one_line():
    shape = model_shape_for_config(tiny_config("tiny-llama"), Task.CAUSAL_LM, 2, "tiny")
    with pytest.raises(PlannerInputError) as refused:
        adapter_count(shape.source_config, Task.CAUSAL_LM, 2, _lora("c_attn"))
    assert "\n" not in str(refused.value) and "c_attn" in str(refused.value)


@pytest.mark.parametrize("values,words", [
    ({"lora_r": 0}, "rank"), ({"lora_alpha": -2.0}, "alpha"), ({"lora_dropout": float("nan")}, "dropout"),
    ({"lora_dropout": 5.0}, "dropout"), ({"quant_type": "int4"}, "nf4"), ({"lora_targets": "q_proj;rm -rf"}, "targets"),
    ({"method": "dora"}, "full, lora, qlora"),
])
def test_bad_fine_tuning_values_are_one_line(values, words):
    with pytest.raises(PlannerInputError) as refused:
        finetune_from_values(**{"method": "lora", **values})
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_defaults_are_peft_and_qlora_defaults():
    chosen = finetune_from_values("qlora")
    assert (chosen.method, chosen.lora_r, chosen.alpha, chosen.lora_dropout, chosen.lora_targets,
            chosen.quant_type, chosen.double_quant) == (Method.QLORA, 16, 32, 0.05, "all-linear", "nf4", True)


def _stored_bytes(model) -> tuple[int, int]:
    """(4-bit weights and their quantisation state, other parameter elements) of a really
    quantised model, each storage counted once."""
    storages, others = {}, 0
    for parameter in model.parameters():
        state = getattr(parameter, "quant_state", None)
        if state is None:
            others += parameter.numel()
            continue
        tensors = [parameter, state.absmax, state.code]
        if state.state2 is not None:
            tensors += [state.offset, state.state2.absmax, state.state2.code]
        for tensor in tensors:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values()), others


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_quantised_base_is_what_bitsandbytes_stores(name):
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    raw = tiny_config(name)
    shape = model_shape_for_config(raw, Task.CAUSAL_LM, 2, name)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        for quant_type in ("nf4", "fp4"):
            for double_quant in (True, False):
                settings = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                              bnb_4bit_use_double_quant=double_quant,
                                              bnb_4bit_compute_dtype=torch.bfloat16)
                model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=settings, device_map="cpu")
                stored, others = _stored_bytes(model)
                planned = quantized_base(shape.source_config, Task.CAUSAL_LM, 2, double_quant, quant_type)
                assert (planned.quantized_bytes, planned.unquantized_elements) == (stored, others), \
                    (quant_type, double_quant)


def test_a_configuration_peft_itself_refuses_is_one_line():
    """DistilBERT's classifier under all-linear: PEFT's SEQ_CLS task saves the head in full
    (modules_to_save) and all-linear also adapts it; get_peft_model raises TypeError for a
    user too. The planner says so in one line instead of a traceback."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(**tiny_config("tiny-distilbert"))
    with pytest.raises(TypeError):
        get_peft_model(AutoModelForSequenceClassification.from_config(config), lora_config(FineTune(Method.LORA),
                                                                                          Task.SEQUENCE_CLASSIFICATION))
    shape = model_shape_for_config(tiny_config("tiny-distilbert"), Task.SEQUENCE_CLASSIFICATION, 2, "tiny")
    with pytest.raises(PlannerInputError, match="PEFT refuses this LoRA configuration"):
        adapter_count(shape.source_config, Task.SEQUENCE_CLASSIFICATION, 2, FineTune(Method.LORA))
