"""The sidebar's values and what they mean to the planner, with no Streamlit here.

app.py draws one widget per field of SidebarValues, keyed by the field's name, with its
initial value from DEFAULTS; pages read them back with SidebarValues.from_state and turn
them into planner inputs (a config, a Scenario, a capacity in bytes) with the functions below.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields

from planner.catalog import catalog_config, catalog_entries
from planner.config_source import config_from_bytes
from planner.config_task import config_task
from planner.errors import PlannerInputError
from planner.gpus import GPUS, MAX_GPU_GIB, GpuSpec, capacity_bytes_from_gib
from planner.scenario import (
    MAX_BATCH_SIZE,
    MAX_GRAD_ACCUM,
    MAX_NUM_LABELS,
    MAX_SEQ_LEN,
    Attention,
    Device,
    Optimizer,
    Precision,
    Scenario,
    Task,
    scenario_from_values,
)
from planner.strategy import MAX_DEVICES, ParallelPlan, Strategy, parse_strategy
from planner.units import MIB


class ModelSource(enum.Enum):
    CATALOG = "catalog"
    UPLOAD = "upload"


MODEL_SOURCE_LABELS = {ModelSource.CATALOG.value: "Catalog", ModelSource.UPLOAD.value: "Upload config.json"}

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

CUSTOM_GPU = "Custom"
# Total memory as `nvidia-smi` reports it (memory.total, MiB), not the marketing "GB":
# T4 15360, L4 23034, A10/A10G 23028, A100 40960 / 81920, H100 80GB HBM3 81559,
# H200 143771. The 24 GB row takes the smallest of its cards (A10) so "fits" stays
# true on all three (an RTX 4090 reports 24564 MiB without ECC).
GPU_PRESETS: dict[str, int | None] = {
    "T4 · 16 GB": 15360 * MIB,
    "L4 / A10 / RTX 4090 · 24 GB": 23028 * MIB,
    "A100 · 40 GB": 40960 * MIB,
    "A100 · 80 GB": 81920 * MIB,
    "H100 · 80 GB": 81559 * MIB,
    "H200 · 141 GB": 143771 * MIB,
    CUSTOM_GPU: None,  # read from gpu_custom_gib
}
# The planner.gpus row behind each preset: its compute capability and driver reservation
# size the CUDA overheads (planner.cuda_overheads). The 24 GB row is the A10, the card its
# capacity is; a custom size has none, and the overheads take their larger figures.
GPU_PRESET_KEYS: dict[str, str | None] = {
    "T4 · 16 GB": "t4",
    "L4 / A10 / RTX 4090 · 24 GB": "a10",
    "A100 · 40 GB": "a100-40gb",
    "A100 · 80 GB": "a100-80gb",
    "H100 · 80 GB": "h100",
    "H200 · 141 GB": "h200",
    CUSTOM_GPU: None,
}

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
        found = config_task(config_from_bytes(upload.getvalue(), upload.name))
    except PlannerInputError:
        return None
    return found.task.value if found is not None else None


@dataclass(frozen=True)
class SidebarValues:
    """Raw widget values, named as their widget keys (the user-facing strings the planner parses)."""

    model_source: str
    catalog_model: str
    config_upload: UploadedConfig | None
    task: str
    num_labels: int
    batch_size: int
    seq_len: int
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
    "task": default_task(DEFAULT_MODEL),
    "num_labels": 2,
    "batch_size": 8,
    "seq_len": 512,
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
}


def model_config(values: SidebarValues) -> tuple[dict, str] | None:
    """(config dict, display name) of the chosen model; None while the upload is still empty."""
    if values.model_source == ModelSource.UPLOAD.value:
        if values.config_upload is None:
            return None
        upload = values.config_upload
        return config_from_bytes(upload.data, upload.name), upload.name
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
    )


# The planner's own bounds, as the widgets' max_value and the link's parser read them.
MAXIMA: dict[str, int | float] = {"num_labels": MAX_NUM_LABELS, "batch_size": MAX_BATCH_SIZE, "seq_len": MAX_SEQ_LEN,
                                  "grad_accum": MAX_GRAD_ACCUM, "gpu_count": MAX_DEVICES,
                                  "gpu_custom_gib": MAX_GPU_GIB}


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
        "attn": values.attn, "device": values.device,
    }
