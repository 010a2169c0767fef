"""Config dict -> ModelShape, by building the model on the meta device.

The only module of `planner` that imports torch and transformers (lazily, inside the
function): the meta device gives every parameter's exact shape with no memory and no
download, for any architecture transformers ships. `trust_remote_code` is never
enabled, so a config can never make us run code from the internet.
"""

from __future__ import annotations

import copy
import json
import warnings

from planner.build_guard import MAX_PARAMETERS, check_build_size, module_budget
from planner.errors import PlannerInputError
from planner.model_shape import ArchFamily, FsdpUnit, FsdpUnitKind, MlpKind, ModelShape, NormKind, ParamTensor
from planner.scenario import Task

_FAMILY_BY_MODEL_TYPE = {
    "bert": ArchFamily.ENCODER,
    "roberta": ArchFamily.ENCODER,
    "xlm-roberta": ArchFamily.ENCODER,
    "distilbert": ArchFamily.ENCODER,
    "electra": ArchFamily.ENCODER,
    "gpt2": ArchFamily.GPT2,
    "opt": ArchFamily.OPT,
    "gpt_neox": ArchFamily.GPT_NEOX,
    "llama": ArchFamily.LLAMA,
    "mistral": ArchFamily.LLAMA,
    "qwen2": ArchFamily.LLAMA,
    "qwen3": ArchFamily.LLAMA,
    "gemma": ArchFamily.LLAMA,
    "phi": ArchFamily.PHI,
}

_AUTO_CLASS_BY_TASK = {
    Task.SEQUENCE_CLASSIFICATION: "AutoModelForSequenceClassification",
    Task.CAUSAL_LM: "AutoModelForCausalLM",
    Task.MASKED_LM: "AutoModelForMaskedLM",
    Task.TOKEN_CLASSIFICATION: "AutoModelForTokenClassification",
    Task.SEQ2SEQ_LM: "AutoModelForSeq2SeqLM",
}

# Keys the planner itself reads as sizes (planner.build_guard bounds every size the
# architecture reads): whatever their value, they must be positive integers.
_SIZE_KEYS = (
    "hidden_size", "n_embd", "dim", "d_model",
    "num_hidden_layers", "n_layer", "n_layers",
    "num_attention_heads", "n_head", "n_heads",
    "num_key_value_heads", "intermediate_size", "n_inner", "hidden_dim", "ffn_dim",
    "vocab_size", "max_position_embeddings", "n_positions", "head_dim",
)


def _first_attr(config, names: tuple[str, ...], default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _validate_sizes(config_dict: dict) -> None:
    for key in _SIZE_KEYS:
        if key not in config_dict or config_dict[key] is None:
            continue
        value = config_dict[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlannerInputError(f"config field {key!r} must be a positive integer, got {value!r}")


def _intermediate_size(config, hidden: int, family: ArchFamily) -> int:
    value = _first_attr(config, ("intermediate_size", "n_inner", "hidden_dim", "ffn_dim"))
    # GPT-2's n_inner=None means 4 * n_embd (GPT2MLP in modeling_gpt2.py).
    return int(value) if value else 4 * hidden


def _rotary_fraction(config, family: ArchFamily) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    partial = partial if partial is not None else _first_attr(config, ("partial_rotary_factor", "rotary_pct"))
    if partial is None:
        return 1.0 if family in (ArchFamily.LLAMA, ArchFamily.GPT_NEOX, ArchFamily.PHI) else 0.0
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise PlannerInputError(f"config field 'partial_rotary_factor' (or 'rotary_pct') must be a number in (0, 1], "
                                f"got {partial!r}: the share of each head that rotary embeddings rotate")
    return float(partial)


def load_transformers_config(config_dict: dict, task: Task, num_labels: int):
    """A transformers PretrainedConfig from a plain dict; PlannerInputError when it cannot be one."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    # Config validation chatter (legacy activation names, token ids) is not the user's error.
    transformers.logging.set_verbosity_error()

    if not isinstance(config_dict, dict):
        raise PlannerInputError("a model config must be a JSON object")
    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise PlannerInputError("config has no 'model_type': it must be a transformers config.json")
    if model_type not in CONFIG_MAPPING:
        raise PlannerInputError(
            f"architecture {model_type!r} is not known to transformers {transformers.__version__}: "
            "use a supported model_type or upgrade transformers"
        )
    _validate_sizes(config_dict)
    kwargs = copy.deepcopy({k: v for k, v in config_dict.items() if k != "model_type"})
    if task.uses_labels:
        kwargs.pop("id2label", None)
        kwargs.pop("label2id", None)
        kwargs["num_labels"] = num_labels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.for_model(model_type, **kwargs)
    except Exception as error:  # transformers raises many types for bad fields
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PlannerInputError(f"config for {model_type!r} is invalid: {message}") from None
    check_build_size(config)  # before anything is built, on every path (shapes, probe, runs)
    return config


def _check_attention_sizes(config) -> None:
    """The sizes the planner's activation model reads: an attention transformer's width, depth,
    heads and vocabulary (a state-space model such as Mamba or RWKV has no heads to plan)."""
    sizes = {name: getattr(config, name, None)
             for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")}
    missing = [name for name, value in sizes.items() if value is None]
    if missing:
        raise PlannerInputError(
            f"architecture {config.model_type!r} has no {', '.join(missing)}: the planner models attention "
            "transformers (encoders, decoders), not state-space or recurrent models such as Mamba or RWKV")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlannerInputError(f"config field {name!r} must be a positive integer, got {value!r}")
    heads = sizes["num_attention_heads"]
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise PlannerInputError(
            f"num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads!r}: "
            "each key/value head serves a whole group of query heads; fix one of them")


def build_model_shape(config_dict: dict, task: Task, num_labels: int = 2, name: str = "model") -> ModelShape:
    """Exact parameter shapes for `config_dict` with the head `task` needs."""
    import torch
    import transformers

    config = load_transformers_config(config_dict, task, num_labels)
    _check_attention_sizes(config)
    family = _FAMILY_BY_MODEL_TYPE.get(config.model_type, ArchFamily.UNKNOWN)
    auto_class = getattr(transformers, _AUTO_CLASS_BY_TASK[task])
    try:
        with warnings.catch_warnings(), torch.device("meta"), module_budget():
            warnings.simplefilter("ignore")
            model = auto_class.from_config(config, trust_remote_code=False)
    except PlannerInputError:
        raise
    except ValueError as error:
        if "Unrecognized configuration class" in str(error):
            raise PlannerInputError(
                f"transformers has no {task.value} head for model_type {config.model_type!r}: choose another task"
            ) from None
        raise PlannerInputError(f"cannot build {config.model_type!r}: {str(error).splitlines()[0]}") from None
    except Exception as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PlannerInputError(f"cannot build {config.model_type!r} from this config: {first_line}") from None

    # named_parameters() yields each tensor once, so tied embeddings are counted once.
    params = tuple(ParamTensor(n, tuple(p.shape)) for n, p in model.named_parameters())
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:  # exact on the (bounded) meta build; no real model is this large
        raise PlannerInputError(f"config describes a model of {count:,} parameters, above {MAX_PARAMETERS:,}: "
                                "check its sizes")
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(_first_attr(config, ("num_key_value_heads",), heads) or heads)
    head_dim = int(_first_attr(config, ("head_dim",), hidden // heads) or hidden // heads)
    activation = str(_first_attr(config, ("hidden_act", "activation_function", "activation"), "gelu"))
    hidden_dropout = float(_first_attr(config, ("hidden_dropout_prob", "resid_pdrop", "hidden_dropout", "dropout"), 0.0))
    embedding_dropout = float(_first_attr(config, ("embd_pdrop", "hidden_dropout_prob", "dropout"), 0.0))
    if family in (ArchFamily.LLAMA, ArchFamily.GPT_NEOX, ArchFamily.OPT):
        embedding_dropout = 0.0  # these decoders apply no dropout to the embeddings (measured for OPT)
    attention_dropout = float(
        _first_attr(config, ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout"), 0.0)
    )
    input_embeddings = model.get_input_embeddings()
    output_embeddings = model.get_output_embeddings() if task.has_lm_head else None
    tied = output_embeddings is not None and output_embeddings.weight is input_embeddings.weight
    max_positions = _first_attr(config, ("max_position_embeddings",))
    # Each table once (a tied table is one tensor), under the name named_parameters() gives it.
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    embedding_params = {n: p for n, p in model.named_parameters() if id(p) in embedding_weights}
    embedding_elements = sum(p.numel() for p in embedding_params.values())
    return ModelShape(
        name=name,
        model_type=config.model_type,
        architecture=type(model).__name__,
        family=family,
        task=task,
        num_labels=num_labels,
        params=params,
        hidden_size=hidden,
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_intermediate_size(config, hidden, family),
        vocab_size=int(config.vocab_size),
        max_positions=int(max_positions) if max_positions else None,
        mlp=MlpKind.GATED if family is ArchFamily.LLAMA else MlpKind.PLAIN,
        norm=NormKind.RMSNORM if family is ArchFamily.LLAMA else NormKind.LAYERNORM,
        activation=activation,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        embedding_dropout=embedding_dropout,
        rotary_fraction=_rotary_fraction(config, family),
        tied_embeddings=bool(tied),
        float_buffer_elements=sum(b.numel() for b in model.buffers() if b.is_floating_point()),
        other_buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers() if not b.is_floating_point()),
        embedding_elements=embedding_elements,
        embedding_param_names=frozenset(embedding_params),
        fsdp_units=_fsdp_units(model, input_embeddings, output_embeddings, tied),
        source_config=json.dumps(config_dict, sort_keys=True, default=str),
        supports_sdpa=bool(getattr(model, "_supports_sdpa", False)),
        supports_checkpointing=bool(getattr(model, "supports_gradient_checkpointing", False)),
        sliding_window=_effective_sliding_window(config),
    )


def _effective_sliding_window(config) -> int | None:
    """The attention window some layer uses, or None: whether a sequence reaches it changes
    what the mask helpers allocate (masking_utils._ignore_causal_mask_sdpa)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool):
        return None
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        return window if any("sliding" in str(kind) for kind in types) else None
    return None if getattr(config, "use_sliding_window", True) is False else window


def _bottom_up(module) -> list:
    """Modules children first, the root last (accelerate's get_module_children_bottom_up)."""
    order = []
    for child in module.children():
        order += _bottom_up(child)
    return order + [module]


def _fsdp_units(model, input_embeddings, output_embeddings, tied: bool) -> tuple[FsdpUnit, ...]:
    """The parameter groups of Accelerate's FSDP2 plugin with `transformer_based_wrap`
    (accelerate/utils/fsdp_utils.py `fsdp2_prepare_model`): every module whose class is in
    the model's `_no_split_modules`, bottom-up; the untied input embedding; one group of
    the final norm (the last "Norm" child of the base model, `_find_final_norm`) and the
    output embedding, with the input embedding when tied; the root with the rest."""
    names = {id(p): n for n, p in model.named_parameters()}
    taken: set[int] = set()

    def claim(modules) -> frozenset[str]:
        found = {id(p) for m in modules if m is not None for p in m.parameters()} - taken
        taken.update(found)
        return frozenset(names[i] for i in found)

    wrapped = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [claim([m]) for m in _bottom_up(model)[:-1] if type(m).__name__ in wrapped]
    embedding = frozenset() if tied else claim([input_embeddings])
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    final_norm = None
    for child in base.children() if base is not None else ():
        if "Norm" in type(child).__name__:
            final_norm = child
    tail = claim([final_norm, input_embeddings, output_embeddings] if tied else [final_norm, output_embeddings])
    root = claim([model])
    units = [FsdpUnit(FsdpUnitKind.INPUT_EMBEDDING, embedding)]
    units += [FsdpUnit(FsdpUnitKind.BLOCK, b) for b in blocks]
    units += [FsdpUnit(FsdpUnitKind.TAIL, tail), FsdpUnit(FsdpUnitKind.ROOT, root)]
    return tuple(u for u in units if u.param_names)
