"""ModelShape: everything the planner knows about a model, with no torch in sight.

Built once per (config, task) by `planner.shapes_from_config` from the exact parameter
tensors transformers would create (tied weights counted once), plus the dimensions the
activation model reads. `ParameterStats` holds sums over the tensors, computed once here
so that one estimate costs microseconds, not a tensor walk.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field

from planner.scenario import Task


class ArchFamily(enum.Enum):
    """Which activation recipe applies (planner.activations)."""

    ENCODER = "encoder"  # BERT, RoBERTa, DistilBERT, ELECTRA: post-LayerNorm, dropout everywhere
    GPT2 = "gpt2"
    OPT = "opt"
    GPT_NEOX = "gpt-neox"  # Pythia: parallel residual, partial rotary
    LLAMA = "llama"  # LLaMA, Mistral, Qwen2, Gemma: RMSNorm, rotary, gated MLP, GQA
    PHI = "phi"  # Phi-1/2: parallel attention + MLP under one LayerNorm, partial rotary
    UNKNOWN = "unknown"


class MlpKind(enum.Enum):
    PLAIN = "plain"  # fc1 -> act -> fc2
    GATED = "gated"  # down(act(gate(x)) * up(x))


class NormKind(enum.Enum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


@dataclass(frozen=True)
class ParamTensor:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FsdpUnitKind(enum.Enum):
    BLOCK = "block"  # a module whose class is in the model's _no_split_modules
    INPUT_EMBEDDING = "input embedding"  # the untied input embedding
    TAIL = "tail"  # final norm and output embedding (with the input embedding when tied)
    ROOT = "root"  # whatever the other units left

    @property
    def follows_reshard_setting(self) -> bool:
        """Resharded after forward under FULL_SHARD; the tail and the root never are."""
        return self in (FsdpUnitKind.BLOCK, FsdpUnitKind.INPUT_EMBEDDING)


@dataclass(frozen=True)
class FsdpUnit:
    """Parameters FSDP2 gathers together, as Accelerate's FSDP plugin groups them."""

    kind: FsdpUnitKind
    param_names: frozenset[str]


@dataclass(frozen=True)
class ParameterStats:
    """Per-tensor sums over the unique parameter tensors, in elements (computed once per model)."""

    num_tensors: int
    num_elements: int
    largest_tensor_elements: int
    # Parameters inside the repeated blocks (names with a block index, e.g. "layers.3."):
    # their gradients appear block by block during backward, the rest (head) first.
    block_elements: int
    block_matmul_elements: int  # of which >= 2-D: the weights autocast copies
    matmul_elements: int  # all >= 2-D parameters (embedding tables included)


_BLOCK_INDEX = re.compile(r"\.\d+\.")


def compute_parameter_stats(params: tuple[ParamTensor, ...]) -> ParameterStats:
    largest = total = in_blocks = block_matmul = matmul = 0
    for tensor in params:
        numel = tensor.numel
        total += numel
        matmul += numel if len(tensor.shape) >= 2 else 0
        if _BLOCK_INDEX.search(tensor.name):
            in_blocks += numel
            block_matmul += numel if len(tensor.shape) >= 2 else 0
        largest = max(largest, numel)
    return ParameterStats(
        num_tensors=len(params),
        num_elements=total,
        largest_tensor_elements=largest,
        block_elements=in_blocks,
        block_matmul_elements=block_matmul,
        matmul_elements=matmul,
    )


@dataclass(frozen=True, eq=False)
class ModelShape:
    """A model's parameter tensors and the dimensions activations depend on."""

    name: str  # catalog name or file name, for display
    model_type: str  # config.model_type, e.g. "llama"
    architecture: str  # the transformers class built, e.g. "LlamaForCausalLM"
    family: ArchFamily
    task: Task
    num_labels: int
    params: tuple[ParamTensor, ...]  # unique tensors: tied weights appear once
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int | None  # None when the model has no fixed limit (rotary)
    mlp: MlpKind
    norm: NormKind
    activation: str  # config's activation name, e.g. "gelu_new", "silu"
    hidden_dropout: float  # residual / MLP output dropout probability
    attention_dropout: float  # dropout on attention probabilities
    embedding_dropout: float
    rotary_fraction: float  # share of head_dim that rotary embeddings rotate (0 when none)
    tied_embeddings: bool
    # Registered buffers (position ids, rotary inv_freq), counted with the weights at the
    # dtype they are built in (fp32 for floating ones, whatever the precision).
    float_buffer_elements: int
    other_buffer_bytes: int
    embedding_elements: int  # nn.Embedding weights: looked up, never multiplied, so autocast never copies them
    embedding_param_names: frozenset[str]  # their parameter names
    fsdp_units: tuple[FsdpUnit, ...]  # in forward order of first use: input embedding, blocks, tail, root
    source_config: str | None = None  # the config as canonical JSON: what the probe builds
    sliding_window: int | None = None  # attention window of the layers that have one
    supports_sdpa: bool = True  # the class's `_supports_sdpa`: transformers refuses attn="sdpa" otherwise
    # the class's `supports_gradient_checkpointing`: transformers refuses to enable it otherwise
    supports_checkpointing: bool = True
    stats: ParameterStats = field(init=False)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        object.__setattr__(self, "stats", compute_parameter_stats(self.params))

    @property
    def num_parameters(self) -> int:
        return self.stats.num_elements
