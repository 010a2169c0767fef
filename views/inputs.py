"""The sidebar's values and what they mean to the planner, with no Streamlit here.

app.py draws one widget per field of SidebarValues, keyed by the field's name, with its
initial value from DEFAULTS; pages read them back with SidebarValues.from_state and turn
them into planner inputs (a config, a Scenario, a capacity in bytes) with the functions below.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from planner.catalog import catalog_config, catalog_entries
from planner.config_source import config_from_bytes, config_model_name, is_hub_model_id
from planner.config_task import config_task
from planner.errors import PlannerInputError
from planner.finetune import ALL_LINEAR, FINETUNE_KEYS, QUANT_TYPES, Method
from planner.gpus import GPUS, MAX_GPU_GIB, GpuSpec, capacity_bytes_from_gib
from planner.gpus import capability_values as gpu_capability_values  # the sidebar's own reads its preset
from planner.scenario import (
    MAX_BATCH_SIZE,
    MAX_GRAD_ACCUM,
    MAX_NUM_LABELS,
    MAX_SEQ_LEN,
    Attention,
    CudaSegments,
    Device,
    Optimizer,
    Precision,
    Scenario,
    Task,
    scenario_from_values,
)
from planner.strategy import MAX_DEVICES, ParallelPlan, Strategy, parse_strategy
from planner.units import format_bytes
from runners.config_store import config_hash, load_config, short_hash, store_config


class ModelSource(enum.Enum):
    CATALOG = "catalog"
    UPLOAD = "upload"
    HUB = "hub"  # a model id fetched from the Hugging Face hub (online only)


MODEL_SOURCE_LABELS = {ModelSource.CATALOG.value: "Catalog", ModelSource.UPLOAD.value: "Upload config.json",
                       ModelSource.HUB.value: "Hub model id"}
# Sources whose config names its own head: the task follows its `architectures`.
CONFIG_SOURCES = (ModelSource.UPLOAD.value, ModelSource.HUB.value)

OPTIMIZER_LABELS = {
    Optimizer.ADAMW.value: "AdamW (torch)",
    Optimizer.ADAM.value: "Adam (torch)",
    Optimizer.SGD.value: "SGD, momentum 0.9",
    Optimizer.ADAFACTOR.value: "Adafactor (torch)",
    Optimizer.HF_ADAFACTOR.value: "Adafactor (transformers)",
    Optimizer.ADAM8BIT.value: "Adam 8-bit (bitsandbytes)",
    Optimizer.ADAMW8BIT.value: "AdamW 8-bit (bitsandbytes)",
    Optimizer.PAGED_ADAMW8BIT.value: "Paged AdamW 8-bit (bitsandbytes)",
}

PRECISION_LABELS = {
    Precision.FP32.value: "fp32",
    Precision.BF16_MIXED.value: "bf16 mixed (autocast, fp32 master)",
    Precision.FP16_MIXED.value: "fp16 mixed (autocast, fp32 master)",
    Precision.BF16.value: "bf16 (pure 16-bit)",
}

# The sidebar's strategy, read only with more than one GPU (one GPU holds everything).
STRATEGY_LABELS = {
    Strategy.DDP.value: "DDP (a full replica per GPU)",
    Strategy.ZERO1.value: "ZeRO-1 (optimizer state sharded)",
    Strategy.ZERO2.value: "ZeRO-2 (and gradients sharded)",
    Strategy.ZERO3.value: "ZeRO-3 (and parameters sharded)",
    Strategy.FSDP_SHARD_GRAD_OP.value: "FSDP shard grad op (parameters sharded, kept after forward)",
    Strategy.FSDP_FULL_SHARD.value: "FSDP full shard (parameters sharded, freed after forward)",
}

# The fine-tuning method (planner.finetune): its widgets' keys are FINETUNE_KEYS, the CLI's
# and `planner batch`'s names, so a link carries a plan as the planner reads it.
FINETUNE_LABELS = {Method.FULL.value: "Full", Method.LORA.value: "LoRA", Method.QLORA.value: "QLoRA"}
QUANT_TYPE_LABELS = {"nf4": "nf4 (4-bit NormalFloat)", "fp4": "fp4 (4-bit float)"}
assert tuple(QUANT_TYPE_LABELS) == QUANT_TYPES
MAX_LORA_R = 1 << 16  # beyond any adapter rank in use; the link's parser bounds it

CUSTOM_GPU = "Custom"
# Each preset is one planner.gpus row, its capacity that row's: the total the driver reports
# (nvidia-smi memory.total, or rocm-smi for the MI300X), not the marketing "GB", except the
# RTX 4060 Ti 16 GB, whose datasheet figure is all that is sourced (GpuSpec.capacity_basis
# says which; GpuSpec.capacity_source where each comes from). The 24 GB row shared by three
# cards takes the smallest of them (A10, 23028 MiB) so "fits" stays true on all three.
# T4 first: the default, the lessons' GPU; then by capacity.
_PRESET_ROWS: dict[str, str] = {
    "T4 · 16 GB": "t4",
    "RTX 4060 · 8 GB": "rtx4060",
    "RTX 3060 · 12 GB": "rtx3060",
    "V100 · 16 GB": "v100-16gb",
    "RTX 4060 Ti · 16 GB": "rtx4060ti-16gb",
    "RTX 4080 · 16 GB": "rtx4080",
    "L4 / A10 / RTX 4090 · 24 GB": "a10",
    "RTX 3090 · 24 GB": "rtx3090",
    "RTX 4090 · 24 GB": "rtx4090",
    "V100 · 32 GB": "v100-32gb",
    "A100 · 40 GB": "a100-40gb",
    "L40S · 48 GB": "l40s",
    "RTX A6000 · 48 GB": "a6000",
    "A100 · 80 GB": "a100-80gb",
    "H100 · 80 GB": "h100",
    "H200 · 141 GB": "h200",
    "MI300X · 192 GB (ROCm)": "mi300x",
}
GPU_PRESETS: dict[str, int | None] = {
    **{preset: GPUS[key].capacity_bytes for preset, key in _PRESET_ROWS.items()},
    CUSTOM_GPU: None,  # read from gpu_custom_gib
}
# The planner.gpus row behind each preset: its compute capability and driver reservation
# size the CUDA overheads (planner.cuda_overheads), its throughput the step times. A custom
# size has none, and the overheads take their larger figures.
GPU_PRESET_KEYS: dict[str, str | None] = {**_PRESET_ROWS, CUSTOM_GPU: None}


def preset_caption(preset: str) -> str:
    """The line under the GPU box: the preset's capacity and how it was obtained."""
    key = GPU_PRESET_KEYS.get(preset)
    if key is None:
        return ""
    gpu = GPUS[key]
    return f"{format_bytes(gpu.capacity_bytes)} ({gpu.capacity_bytes:,} bytes), {gpu.capacity_basis}"


DEFAULT_MODEL = "distilbert-base-cased"  # the lessons' model


def default_task(catalog_model: str) -> str:
    """The task a catalog model is usually fine-tuned for (encoders classify, the rest model language)."""
    entry = catalog_entries().get(catalog_model)
    return (entry.default_task if entry is not None else Task.CAUSAL_LM).value


@dataclass(frozen=True)
class UploadedConfig:
    name: str
    data: bytes


def uploaded_task(upload) -> str | None:
    """The task an uploaded config's `architectures` names; None for no file, a file that
    does not parse (the page says why) or no known head."""
    if upload is None:
        return None
    try:
        return config_task_value(config_from_bytes(upload.getvalue(), upload.name))
    except PlannerInputError:
        return None


def config_task_value(config: dict) -> str | None:
    """The task a config's `architectures` names; None for no known head."""
    found = config_task(config)
    return found.task.value if found is not None else None


def remember_upload(upload) -> str:
    """Store an upload that parses as a config (runners.config_store) and return its hash for
    the link; "" for no file or a file that does not parse (the page says why).
    PlannerInputError when it parses but cannot be stored."""
    if upload is None:
        return ""
    data = upload.getvalue()
    try:
        config_from_bytes(data, upload.name)
    except PlannerInputError:
        return ""
    return store_config(data)


def upload_label(config: dict, digest: str) -> str:
    """An uploaded config's display name: its model's name and the upload's short hash."""
    return f"{config_model_name(config)} · {short_hash(digest)}"


@dataclass(frozen=True)
class SidebarValues:
    """Raw widget values, named as their widget keys (the user-facing strings the planner parses)."""

    model_source: str
    catalog_model: str
    config_upload: UploadedConfig | None
    config_hash: str  # the stored upload a link names ("" for none): runners.config_store
    hub_model_id: str
    task: str
    num_labels: int
    batch_size: int
    seq_len: int
    target_len: int  # read for seq2seq-lm only
    grad_accum: int
    optimizer: str
    precision: str
    gradient_checkpointing: bool
    attn: str
    device: str
    gpu_preset: str
    gpu_custom_gib: float
    gpu_count: int
    strategy: str
    finetune: str  # planner.finetune.Method's value
    lora_r: int
    lora_alpha: float | None  # None: 2 x r, PEFT's examples' choice
    lora_dropout: float
    lora_targets: str  # `all-linear` or comma-separated module names
    quant_type: str
    double_quant: bool
    expandable_segments: bool  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (CUDA only)

    @classmethod
    def from_state(cls, state: Mapping) -> SidebarValues:
        """Values from st.session_state (or any mapping); a widget not drawn this run reads its default."""
        values = {f.name: state.get(f.name, DEFAULTS.get(f.name)) for f in fields(cls)}
        upload = values["config_upload"]
        if upload is not None and not isinstance(upload, UploadedConfig):
            # st.file_uploader's UploadedFile: a BytesIO with a .name
            values["config_upload"] = UploadedConfig(name=upload.name, data=upload.getvalue())
        return cls(**values)


# Initial widget values. config_upload is absent: Streamlit forbids setting a file uploader's state.
DEFAULTS: dict[str, object] = {
    "model_source": ModelSource.CATALOG.value,
    "catalog_model": DEFAULT_MODEL,
    "config_hash": "",
    "hub_model_id": "",
    "task": default_task(DEFAULT_MODEL),
    "num_labels": 2,
    "batch_size": 8,
    "seq_len": 512,
    "target_len": 128,
    "grad_accum": 1,
    "optimizer": Optimizer.ADAMW.value,
    "precision": Precision.FP32.value,
    "gradient_checkpointing": False,
    "attn": Attention.SDPA.value,
    "device": Device.CUDA.value,
    "gpu_preset": "T4 · 16 GB",
    "gpu_custom_gib": 16.0,
    "gpu_count": 1,
    "strategy": Strategy.DDP.value,
    # planner.finetune.FineTune()'s defaults
    "finetune": Method.FULL.value,
    "lora_r": 16,
    "lora_alpha": None,
    "lora_dropout": 0.05,
    "lora_targets": ALL_LINEAR,
    "quant_type": "nf4",
    "double_quant": True,
    "expandable_segments": False,
}
assert set(FINETUNE_KEYS) <= set(DEFAULTS)


def model_config(values: SidebarValues, hub_config: Callable[[str], dict] | None = None) -> tuple[dict, str] | None:
    """(config dict, display name) of the chosen model; None while the upload (or, for a
    link, the stored upload its hash names) or the hub id is still empty. `hub_config`
    fetches a hub id's config (the page passes a cached fetch; None: no hub here)."""
    if values.model_source == ModelSource.UPLOAD.value:
        if values.config_upload is not None:
            data, source = values.config_upload.data, values.config_upload.name
        elif values.config_hash:
            data, source = load_config(values.config_hash), "the stored config.json"
        else:
            return None
        return (config := config_from_bytes(data, source)), upload_label(config, config_hash(data))
    if values.model_source == ModelSource.HUB.value:
        model_id = (values.hub_model_id or "").strip()
        if not model_id:
            return None
        if not is_hub_model_id(model_id):
            raise PlannerInputError(f"{model_id[:200]!r} is not a hub model id like 'owner/name'")
        if hub_config is None:
            raise PlannerInputError("hub model ids are fetched by the dashboard only")
        return hub_config(model_id), model_id
    return catalog_config(values.catalog_model), values.catalog_model


def scenario_for(values: SidebarValues) -> Scenario:
    return scenario_from_values(
        task=values.task,
        batch_size=values.batch_size,
        seq_len=values.seq_len,
        optimizer=values.optimizer,
        precision=values.precision,
        gradient_checkpointing=values.gradient_checkpointing,
        grad_accum=values.grad_accum,
        attn=values.attn,
        device=values.device,
        num_labels=values.num_labels,
        **finetune_values(values),
        **alloc_conf_values(values),
        **target_values(values),
        **capability_values(values),
    )


def target_values(values: SidebarValues) -> dict:
    """The target length as the planner takes it: for seq2seq-lm only (it refuses it elsewhere)."""
    return {"target_len": values.target_len} if values.task == Task.SEQ2SEQ_LM.value else {}


def capability_values(values: SidebarValues) -> dict:
    """The preset GPU's compute capability as the planner takes it, on CUDA only: its kernels run
    the step (a T4 has no flash attention; planner.probe.cache.kernel_class). A custom size names
    no GPU, and is planned on Ampere's kernels."""
    return gpu_capability_values(values.device, preset_gpu(values))


def alloc_conf_values(values: SidebarValues) -> dict:
    """The sidebar's PYTORCH_CUDA_ALLOC_CONF as the planner takes it (`cuda_alloc_conf`), on
    CUDA only: a CPU plan has no caching allocator, and the planner refuses the key there."""
    if values.device != Device.CUDA.value or not values.expandable_segments:
        return {}
    return {"cuda_alloc_conf": CudaSegments.EXPANDABLE.value}


def finetune_values(values: SidebarValues) -> dict:
    """The sidebar's fine-tuning method as planner.scenario.scenario_from_values takes it
    (FINETUNE_KEYS; the LoRA settings only with adapters, QLoRA's only with QLoRA)."""
    chosen = {"finetune": values.finetune}
    if values.finetune in (Method.LORA.value, Method.QLORA.value):
        chosen.update(lora_r=values.lora_r, lora_alpha=values.lora_alpha, lora_dropout=values.lora_dropout,
                      lora_targets=values.lora_targets)
    if values.finetune == Method.QLORA.value:
        chosen.update(quant_type=values.quant_type, double_quant=values.double_quant)
    return chosen


def lora_settings(values: SidebarValues) -> dict:
    """The sidebar's LoRA and QLoRA settings whatever its method (FINETUNE_KEYS less the
    method), for comparing full fine-tuning, LoRA and QLoRA side by side."""
    return {key: getattr(values, key) for key in FINETUNE_KEYS if key != "finetune"}


# The planner's own bounds, as the widgets' max_value and the link's parser read them.
MAXIMA: dict[str, int | float] = {"num_labels": MAX_NUM_LABELS, "batch_size": MAX_BATCH_SIZE, "seq_len": MAX_SEQ_LEN,
                                  "target_len": MAX_SEQ_LEN,
                                  "grad_accum": MAX_GRAD_ACCUM, "gpu_count": MAX_DEVICES,
                                  "gpu_custom_gib": MAX_GPU_GIB, "lora_r": MAX_LORA_R}


def capacity_bytes(values: SidebarValues) -> int:
    """Device memory to compare the peak against, in bytes."""
    if values.gpu_preset not in GPU_PRESETS:
        raise PlannerInputError(f"unknown GPU preset {values.gpu_preset!r}: choose one of {', '.join(GPU_PRESETS)}")
    preset = GPU_PRESETS[values.gpu_preset]
    if preset is not None:
        return preset
    return capacity_bytes_from_gib(values.gpu_custom_gib, "GPU capacity")


def preset_gpu(values: SidebarValues) -> GpuSpec | None:
    """The known GPU of the sidebar's preset; None for a custom size."""
    capacity_bytes(values)  # the preset's one-line error, if it is not one
    key = GPU_PRESET_KEYS[values.gpu_preset]
    return GPUS[key] if key is not None else None


def parallel_plan_for(values: SidebarValues) -> ParallelPlan:
    """The GPU count and, with several, the strategy that spreads the plan over them."""
    strategy = Strategy.SINGLE if values.gpu_count == 1 else parse_strategy(values.strategy)
    return ParallelPlan(values.gpu_count, strategy)


def total_capacity_bytes(values: SidebarValues) -> int:
    """Capacity of all the GPUs together (display only: every plan is judged per GPU)."""
    count = values.gpu_count
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PlannerInputError(f"number of GPUs must be a positive integer, got {count!r}")
    return capacity_bytes(values) * count


def base_values(values: SidebarValues) -> dict:
    """The sidebar's scenario as the user-facing values planner.scenario_from_values takes."""
    return {
        "task": values.task, "num_labels": values.num_labels, "batch_size": values.batch_size,
        "seq_len": values.seq_len, "optimizer": values.optimizer, "precision": values.precision,
        "gradient_checkpointing": values.gradient_checkpointing, "grad_accum": values.grad_accum,
        "attn": values.attn, "device": values.device, **alloc_conf_values(values), **target_values(values),
        **capability_values(values),
    }
