"""What the user asks about: the training scenario (task, batch, sequence, optimizer,
precision, techniques, device) as enums and one validated frozen dataclass.

Names and aliases follow ../shared/DESIGN.md ("Interfaces other code relies on").
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from planner.errors import PlannerInputError
from planner.finetune import ALL_LINEAR, FineTune, finetune_from_values

MAX_NUM_LABELS = 1 << 20  # sequence-classification classes; transformers keeps a label name per class
# Beyond any real training step, and small enough that every byte count stays a finite float
# and fits a 64-bit table column (pandas, SQLite, Streamlit's widgets).
MAX_BATCH_SIZE = 1 << 24  # sequences per micro-batch
MAX_SEQ_LEN = 1 << 24  # tokens: above the longest context window published (10M)
MAX_GRAD_ACCUM = 1 << 24  # micro-batches per optimizer step


class Task(enum.Enum):
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    CAUSAL_LM = "causal-lm"
    MASKED_LM = "masked-lm"
    TOKEN_CLASSIFICATION = "token-classification"  # a label per token (NER, tagging)
    SEQ2SEQ_LM = "seq2seq-lm"  # an encoder-decoder trained on target sequences (summaries, translations)

    @property
    def uses_labels(self) -> bool:
        """Whether the head's width is the scenario's number of labels (a classifier's)."""
        return self in (Task.SEQUENCE_CLASSIFICATION, Task.TOKEN_CLASSIFICATION)

    @property
    def has_lm_head(self) -> bool:
        """Whether the head predicts the vocabulary (and may share the embedding's table)."""
        return self in (Task.CAUSAL_LM, Task.MASKED_LM, Task.SEQ2SEQ_LM)


class Optimizer(enum.Enum):
    ADAMW = "adamw"  # torch.optim.AdamW defaults: foreach on CUDA, per-tensor on CPU
    ADAMW_FUSED = "adamw-fused"  # AdamW(fused=True): TrainingArguments' default optim
    ADAM = "adam"
    SGD = "sgd"  # momentum 0.9: one buffer per parameter
    ADAFACTOR = "adafactor"  # torch.optim.Adafactor
    HF_ADAFACTOR = "hf-adafactor"  # transformers' Adafactor, as TrainingArguments(optim="adafactor") builds it
    ADAM8BIT = "adam8bit"
    ADAMW8BIT = "adamw8bit"
    PAGED_ADAMW8BIT = "paged-adamw8bit"


# TrainingArguments `optim` strings. "adafactor" is also a primary name (torch's
# Adafactor); both Adafactors hold byte-identical state for every precision but pure
# bf16, where transformers' keeps fp32 state: ask for "hf-adafactor" to get that one.
OPTIMIZER_ALIASES: dict[str, Optimizer] = {
    "adamw_torch": Optimizer.ADAMW,
    "adamw_torch_fused": Optimizer.ADAMW_FUSED,
    "adamw_bnb_8bit": Optimizer.ADAMW8BIT,
    "paged_adamw_8bit": Optimizer.PAGED_ADAMW8BIT,
}


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"  # autocast; fp32 master weights, gradients and states
    FP16_MIXED = "fp16-mixed"
    BF16 = "bf16"  # pure 16-bit weights, gradients and states


class Checkpointing(enum.Enum):
    NONE = "none"
    EVERY_LAYER = "every-layer"  # model.gradient_checkpointing_enable(): each block's input kept


class Attention(enum.Enum):
    SDPA = "sdpa"
    EAGER = "eager"


class Engine(enum.Enum):
    """The training loop, which decides how long the model's outputs (the logits) live."""

    ACCELERATE = "accelerate"  # the lessons' loop: `outputs` lives until the next forward returns
    TRAINER = "trainer"  # transformers' Trainer: compute_loss drops outputs before backward


class Device(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class CudaSegments(enum.Enum):
    """How PyTorch's CUDA caching allocator reserves memory, as PYTORCH_CUDA_ALLOC_CONF sets
    it (the value is that setting). It decides the reserved peak the verdict replays
    (planner.cuda_allocator), never the live tensors."""

    CUDA_MALLOC = "expandable_segments:False"  # the default: one cudaMalloc per segment, never merged
    EXPANDABLE = "expandable_segments:True"  # one segment per pool that grows by mapping pages


# PYTORCH_CUDA_ALLOC_CONF's other options (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp): real
# settings the allocator replay does not model, so a plan with one is refused, not guessed.
_UNMODELLED_ALLOC_OPTIONS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
                             "roundup_power2_divisions", "release_lock_on_cudamalloc", "per_process_memory_fraction",
                             "graph_capture_record_stream_reuse", "pinned_use_cuda_host_register",
                             "pinned_num_register_threads", "pinned_use_background_threads",
                             "pinned_reserve_segment_size_mb")
MAX_ALLOC_CONF_CHARS = 200


def parse_cuda_alloc_conf(value: object) -> CudaSegments:
    """The segment mode a PYTORCH_CUDA_ALLOC_CONF string sets ("" or None: the default), or a
    one-line error for an option the replay does not model or that torch would refuse."""
    if isinstance(value, CudaSegments):
        return value
    if value is None:
        return CudaSegments.CUDA_MALLOC
    if not isinstance(value, str) or len(value) > MAX_ALLOC_CONF_CHARS or not value.isprintable():
        raise PlannerInputError(f"cuda_alloc_conf must be a PYTORCH_CUDA_ALLOC_CONF string such as "
                                f"'expandable_segments:True', got {str(value)[:40]!r}")
    segments = CudaSegments.CUDA_MALLOC
    for option in filter(None, (part.strip() for part in value.split(","))):
        name, sep, setting = (text.strip() for text in option.partition(":"))
        if not sep:
            raise PlannerInputError(f"PYTORCH_CUDA_ALLOC_CONF option {option[:40]!r} has no value: write it as "
                                    "'name:value', e.g. 'expandable_segments:True'")
        if name == "expandable_segments":
            if setting not in ("True", "False"):  # torch accepts exactly these two
                raise PlannerInputError(f"expandable_segments takes True or False, got {setting[:40]!r}")
            segments = CudaSegments.EXPANDABLE if setting == "True" else CudaSegments.CUDA_MALLOC
        elif name == "backend" and setting == "native":
            continue  # the caching allocator, which is the default
        elif name == "backend" or name in _UNMODELLED_ALLOC_OPTIONS:
            raise PlannerInputError(f"PYTORCH_CUDA_ALLOC_CONF option '{option[:60]}' is not modelled by the "
                                    "planner's allocator replay (only expandable_segments is): leave it out")
        else:
            raise PlannerInputError(f"unknown PYTORCH_CUDA_ALLOC_CONF option {name[:40]!r}: the planner takes "
                                    "expandable_segments:True or expandable_segments:False")
    return segments


def parse_enum(kind: type[enum.Enum], value: str, what: str) -> enum.Enum:
    """Enum member from its user-facing value, or a one-line error listing the choices."""
    if isinstance(value, kind):
        return value
    text = str(value).strip().lower()
    for member in kind:
        if member.value == text:
            return member
    choices = ", ".join(m.value for m in kind)
    raise PlannerInputError(f"unknown {what} {value!r}: choose one of {choices}")


def parse_optimizer(value: str | Optimizer) -> Optimizer:
    if isinstance(value, Optimizer):
        return value
    text = str(value).strip().lower()
    if text in OPTIMIZER_ALIASES:
        return OPTIMIZER_ALIASES[text]
    for member in Optimizer:
        if member.value == text:
            return member
    choices = ", ".join([m.value for m in Optimizer] + sorted(OPTIMIZER_ALIASES))
    raise PlannerInputError(f"unknown optimizer {value!r}: choose one of {choices}")


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlannerInputError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Scenario:
    """One training configuration. Sizes are per micro-batch and per device."""

    task: Task
    batch_size: int  # sequences per micro-batch
    seq_len: int  # tokens per sequence
    optimizer: Optimizer = Optimizer.ADAMW
    precision: Precision = Precision.FP32
    checkpointing: Checkpointing = Checkpointing.NONE
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    attention: Attention = Attention.SDPA
    device: Device = Device.CUDA
    num_labels: int = 2  # only read for the classification tasks (Task.uses_labels)
    engine: Engine = Engine.ACCELERATE
    finetune: FineTune = FineTune()  # full fine-tuning, or LoRA / QLoRA adapters (planner.finetune)
    cuda_segments: CudaSegments = CudaSegments.CUDA_MALLOC  # PYTORCH_CUDA_ALLOC_CONF; read on CUDA only
    # seq2seq-lm: the labels' tokens per sequence, seq_len when not given; None for every other task.
    target_len: int | None = None
    # The CUDA GPU whose kernels run the step, as cudaDeviceProp's (major, minor): SDPA's backend
    # follows it (planner.probe.cache.kernel_class). None: not known, planned on Ampere's and
    # later's kernels. Always None on the CPU.
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _positive_int(self.batch_size, "batch size")
        _positive_int(self.seq_len, "sequence length")
        _positive_int(self.grad_accum_steps, "gradient accumulation steps")
        _positive_int(self.num_labels, "number of labels")
        if self.task is Task.SEQ2SEQ_LM and self.target_len is None:
            # Fixed when the scenario is made: a search over sequence lengths keeps the target.
            object.__setattr__(self, "target_len", self.seq_len)
        if self.target_len is not None:
            _positive_int(self.target_len, "target length")
            if self.target_len > MAX_SEQ_LEN:
                raise PlannerInputError(f"target length must be at most {MAX_SEQ_LEN:,}, got {self.target_len:,}: "
                                        "beyond any real training step")
            if self.task is not Task.SEQ2SEQ_LM:
                raise PlannerInputError("a target length is read for seq2seq-lm only: leave it out for "
                                        f"{self.task.value}")
        if self.num_labels > MAX_NUM_LABELS:  # transformers builds an id2label dict of this size: a hang
            raise PlannerInputError(f"number of labels must be at most {MAX_NUM_LABELS:,}, got {self.num_labels:,}")
        for name, what, most in (("batch_size", "batch size", MAX_BATCH_SIZE),
                                 ("seq_len", "sequence length", MAX_SEQ_LEN),
                                 ("grad_accum_steps", "gradient accumulation steps", MAX_GRAD_ACCUM)):
            if getattr(self, name) > most:
                raise PlannerInputError(f"{what} must be at most {most:,}, got {getattr(self, name):,}: "
                                        "beyond any real training step")
        for name, kind in (("task", Task), ("optimizer", Optimizer), ("precision", Precision),
                           ("checkpointing", Checkpointing), ("attention", Attention), ("device", Device),
                           ("engine", Engine), ("cuda_segments", CudaSegments)):
            if not isinstance(getattr(self, name), kind):
                raise PlannerInputError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.finetune, FineTune):
            raise PlannerInputError(f"finetune must be a FineTune, got {self.finetune!r}")
        capability = self.compute_capability
        if capability is not None:
            if not (isinstance(capability, tuple) and len(capability) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 100 for v in capability)
                    and capability[0] >= 1):
                raise PlannerInputError(f"compute capability must be (major, minor), e.g. 7.5, got {capability!r}")
            if self.device is not Device.CUDA:  # a CPU step takes the CPU's kernels whatever GPU is named
                object.__setattr__(self, "compute_capability", None)

    @property
    def cuda_alloc_conf(self) -> str | None:
        """The PYTORCH_CUDA_ALLOC_CONF this plan's replay takes; None on the CPU (no caching allocator)."""
        return self.cuda_segments.value if self.device is Device.CUDA else None

    @property
    def autocasts(self) -> bool:
        """Whether the step's forward runs under autocast: bf16-mixed on either device, fp16-mixed
        on CUDA only. accelerate runs fp16-mixed as fp32 on a CPU (Accelerator.__init__ turns its
        native AMP on for fp16 off the CPU only), and the Trainer through it likewise."""
        return self.precision is Precision.BF16_MIXED or (self.precision is Precision.FP16_MIXED
                                                          and self.device is Device.CUDA)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.batch_size * self.seq_len


def _as_int(value: object, what: str) -> int:
    """Accepts ints and integral strings (from the CLI or JSON), rejects everything else."""
    if isinstance(value, bool):
        raise PlannerInputError(f"{what} must be a positive integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\+?[0-9]+", value.strip()):  # ASCII digits: "²".isdigit() too
        try:
            return int(value.strip())
        except ValueError:  # over Python's 4300-digit conversion limit
            raise PlannerInputError(f"{what} must be a positive integer, got a {len(value):,}-character number") from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise PlannerInputError(f"{what} must be a positive integer, got {value!r}")


as_int = _as_int  # for other modules' user-facing integers (the CLI's)


def _as_number(value: object, what: str) -> float:
    """A finite number from an int, a float or a numeric string; one line otherwise."""
    if isinstance(value, bool):
        raise PlannerInputError(f"{what} must be a number, got {value!r}")
    if isinstance(value, str) and len(value) < 40:
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, (int, float)) and math.isfinite(value):
        return value
    raise PlannerInputError(f"{what} must be a finite number, got {str(value)[:40]!r}")


def _as_bool(value: object, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"true", "false", "1", "0", "yes", "no"}:
        return value.strip().lower() in {"true", "1", "yes"}
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise PlannerInputError(f"{what} must be true or false, got {value!r}")


def scenario_from_values(
    *,
    task: str,
    batch_size: object,
    seq_len: object,
    optimizer: str = "adamw",
    precision: str = "fp32",
    gradient_checkpointing: object = False,
    grad_accum: object = 1,
    attn: str = "sdpa",
    device: str = "cuda",
    num_labels: object = 2,
    engine: str = "accelerate",
    finetune: str = "full",
    lora_r: object = 16,
    lora_alpha: object = None,
    lora_dropout: object = 0.05,
    lora_targets: str = ALL_LINEAR,
    quant_type: str = "nf4",
    double_quant: object = True,
    cuda_alloc_conf: object = None,
    target_len: object = None,
    compute_capability: object = None,
) -> Scenario:
    """Scenario from user-facing names (CLI flags, JSONL keys, dashboard widgets)."""
    method = finetune_from_values(
        str(finetune), lora_r=_as_int(lora_r, "LoRA rank"),
        lora_alpha=None if lora_alpha is None else _as_number(lora_alpha, "LoRA alpha"),
        lora_dropout=_as_number(lora_dropout, "LoRA dropout"), lora_targets=lora_targets,
        quant_type=str(quant_type), double_quant=_as_bool(double_quant, "double_quant"))
    segments = parse_cuda_alloc_conf(cuda_alloc_conf)
    chosen_device = parse_enum(Device, device, "device")
    if segments is not CudaSegments.CUDA_MALLOC and chosen_device is not Device.CUDA:
        raise PlannerInputError("PYTORCH_CUDA_ALLOC_CONF (cuda_alloc_conf) sets CUDA's caching allocator: "
                                "plan on --device cuda, or leave it out")
    return Scenario(
        task=parse_enum(Task, task, "task"),
        batch_size=_as_int(batch_size, "batch size"),
        seq_len=_as_int(seq_len, "sequence length"),
        optimizer=parse_optimizer(optimizer),
        precision=parse_enum(Precision, precision, "precision"),
        checkpointing=Checkpointing.EVERY_LAYER
        if _as_bool(gradient_checkpointing, "gradient_checkpointing")
        else Checkpointing.NONE,
        grad_accum_steps=_as_int(grad_accum, "gradient accumulation steps"),
        attention=parse_enum(Attention, attn, "attention implementation"),
        device=chosen_device,
        num_labels=_as_int(num_labels, "number of labels"),
        engine=parse_enum(Engine, engine, "engine"),
        finetune=method,
        cuda_segments=segments,
        target_len=None if target_len is None else _as_int(target_len, "target length"),
        compute_capability=parse_compute_capability(compute_capability),
    )


def capability_text(capability: tuple[int, int]) -> str:
    """A compute capability as nvidia-smi prints it and parse_compute_capability reads it: "7.5"."""
    major, minor = capability
    return f"{major}.{minor}"


def parse_compute_capability(value: object) -> tuple[int, int] | None:
    """A compute capability from "7.5", 7.5 or (7, 5); None stays None (not known)."""
    if value is None or (isinstance(value, tuple) and len(value) == 2):
        return value
    if isinstance(value, list) and len(value) == 2:
        return tuple(value)
    text = str(value).strip() if isinstance(value, (str, float)) and not isinstance(value, bool) else ""
    match = re.fullmatch(r"([0-9]{1,2})\.([0-9])", text)
    if match is None:
        raise PlannerInputError(f"compute capability must be major.minor as nvidia-smi prints it (e.g. 7.5 for a "
                                f"T4, 8.0 for an A100), got {str(value)[:40]!r}")
    return int(match.group(1)), int(match.group(2))
