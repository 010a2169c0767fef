"""Estimated time of one optimizer step (all micro-batches of an accumulation cycle, the
optimizer step and, with several GPUs, the gradient all-reduce): what ranks the fit
finder's technique combinations (planner.fit). A roofline-style model, not a profiler.

Pieces, per GPU:
- Matmul FLOPs. Training ≈ 6·N·T (2·N·T forward, 4·N·T backward) for N multiplied
  parameters and T tokens: Kaplan et al. 2020, "Scaling Laws for Neural Language
  Models", §2.1 / Table 1; Hoffmann et al. 2022 (Chinchilla), Appendix F. N excludes
  embedding tables (looked up, not multiplied) and includes the LM head (tied or not).
- Attention FLOPs. The score and value matmuls (QKᵀ and softmax·V) are 2·s²·d each per
  layer and sequence forward, so 4·L·s²·d forward and 12·L·s²·d for training with d the
  attention width (heads × head_dim): Chinchilla Appendix F ("logits" and "attention
  reduction"); Narayanan et al. 2021 (Megatron-LM), §5.1, the s/(6h) term. Counted in
  full (no causal halving: SDPA kernels skip masked tiles only partly).
- Gradient checkpointing recomputes each block's forward during backward: one more
  forward, 2·N·T + 4·L·s²·d (Megatron's 96 vs 72 coefficient, Narayanan et al. 2021).
- Compute time = FLOPs / (peak × utilisation × small-batch factor). Peak is the GPU's
  dense bf16 tensor-core rate for bf16 and bf16-mixed, its FP32 rate for fp32 (TF32 is
  off for matmuls by default in PyTorch); see planner.gpus. `utilisation` is the model
  FLOPs utilisation (MFU) a well-tuned large micro-batch reaches: 0.4 by default, in the
  range PaLM (Chowdhery et al. 2022, Table 3: 46%) and Megatron report; the user sets it.
- Small micro-batches use the GPU less well (launch overheads, skinny matmuls). A simple
  saturating factor t / (t + T_HALF) on the tokens t of one micro-batch stands in for
  that: half utilisation at T_HALF tokens, 0.9 at 9·T_HALF. So splitting the same tokens
  into more, smaller micro-batches (accumulation) costs time, as it does in practice.
- LoRA (a frozen base with trainable adapters): backward computes the activation gradients
  through the frozen linears (2·N·T) but no weight gradients for them, so the base costs
  4·N·T instead of 6·N·T, the adapters' own N_a trainable parameters 6·N_a·T, and attention
  as above (it has no weights); the optimizer steps the N_a trainable elements only. Hu et
  al. 2022 ("LoRA: Low-Rank Adaptation of Large Language Models", §4.2) report the
  resulting speed-up (about 25% on GPT-3 175B) from not computing most weight gradients.
- Optimizer step: memory-bound (a few FLOPs per element), so bytes read and written per
  parameter element / (HBM bandwidth × HBM_EFFICIENCY). Bytes per element with p the
  master-weight element size (4 for fp32 and bf16-mixed, 2 for pure bf16) and gradients
  of the same size:
    AdamW:       param r+w, grad r, m and v r+w at p bytes     = 2p + p + 4p = 7p
    8-bit AdamW: param r+w, grad r, two 1-byte states r+w       = 3p + 4
    Adafactor:   param r+w, grad read three times (squared, row/col means, update),
                 an update temporary written and read (factored state is tiny) = 2p + 3p + 2p = 7p
    SGD (momentum): param r+w, grad r, momentum r+w             = 5p
- Several GPUs: the plan's wire bytes per optimizer step (planner.parallel: for DDP one
  ring all-reduce of the gradients, 2·(n−1)/n × gradient bytes; for ZeRO and FSDP the
  reduce-scatters and all-gathers, (n−1)/n × payload each; Patarasuk & Yuan 2009) over
  the per-direction link bandwidth, counted as not overlapped with compute. A sharded
  optimizer state is stepped 1/n per GPU.

Known limitations: one utilisation for every kernel; no causal-attention discount, no
FlashAttention vs math-path difference, no dropout/normalisation/elementwise time (memory
bound, a few percent at large batch, more for small models); the small-batch factor is a
heuristic, not fitted; T4 has no bf16 tensor cores (its fp16 rate is used); the optimizer
step assumes multi-tensor (foreach) kernels and ignores per-tensor launch costs, which
dominate for tiny models; communication ignores overlap with backward and latency;
data loading, the host and the first (state-building) step are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerInputError
from planner.gpus import GpuSpec
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate
from planner.scenario import Checkpointing, Optimizer, Precision, Scenario, Task

DEFAULT_UTILISATION = 0.4  # MFU of a large micro-batch; user-adjustable
T_HALF_TOKENS = 512  # tokens per micro-batch at which the small-batch factor is 1/2
HBM_EFFICIENCY = 0.8  # share of peak HBM bandwidth a streaming elementwise kernel reaches


def matmul_parameters(shape: ModelShape) -> int:
    """N in 6·N·T: parameters that multiply activations (embedding tables excluded, the
    LM head included even when it is tied to the input embeddings)."""
    n = shape.num_parameters - shape.embedding_elements
    if shape.tied_embeddings and shape.task in (Task.CAUSAL_LM, Task.MASKED_LM):
        n += shape.vocab_size * shape.hidden_size
    return n


def training_flops(shape: ModelShape, batch_size: int, seq_len: int, recompute: bool,
                   adapter_parameters: int | None = None) -> float:
    """FLOPs of one micro-batch's forward and backward (plus one more forward when recomputing).
    `adapter_parameters`: LoRA's trainable parameters, the rest frozen (no weight gradients)."""
    tokens = batch_size * seq_len
    attention_width = shape.num_heads * shape.head_dim
    weights = 2.0 * matmul_parameters(shape) * tokens  # forward matmuls with the weights
    attention = 4.0 * shape.num_layers * seq_len**2 * attention_width * batch_size
    passes = 4.0 if recompute else 3.0  # backward = 2 × forward, recomputation one more forward
    if adapter_parameters is None:
        return (weights + attention) * passes
    adapters = 2.0 * adapter_parameters * tokens
    # Frozen weights: forward and the activation gradient only (one pass less than trained ones).
    return weights * (passes - 1) + (adapters + attention) * passes


def optimizer_bytes_per_element(optimizer: Optimizer, precision: Precision) -> int:
    p = 2 if precision is Precision.BF16 else 4
    if optimizer in (Optimizer.ADAM8BIT, Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        return 3 * p + 4
    if optimizer is Optimizer.SGD:
        return 5 * p
    return 7 * p  # Adam(W) (fused or not) and both Adafactors: see the module docstring


def small_batch_factor(tokens_per_micro_batch: int) -> float:
    return tokens_per_micro_batch / (tokens_per_micro_batch + T_HALF_TOKENS)


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # all micro-batches' forward + backward (+ recomputation)
    optimizer_s: float
    communication_s: float
    flops: float  # per GPU per optimizer step

    @property
    def total_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.communication_s


def step_time(shape: ModelShape, scenario: Scenario, gpu: GpuSpec, num_devices: int = 1,
              utilisation: float = DEFAULT_UTILISATION, parallel: ParallelEstimate | None = None,
              trainable_parameters: int | None = None) -> StepTime:
    """Time of one optimizer step of `scenario` (micro-batch, accumulation, per GPU) on `gpu`;
    `parallel` (the plan's multi-device estimate) gives the traffic and the sharding, DDP's
    gradient all-reduce when it is not given. A LoRA scenario needs `trainable_parameters`
    (its estimate's, PEFT's count)."""
    if not 0 < utilisation <= 1:
        raise PlannerInputError(f"utilisation must be in (0, 1], got {utilisation!r}")
    if num_devices < 1:
        raise PlannerInputError(f"number of devices must be a positive integer, got {num_devices!r}")
    adapters = scenario.finetune.uses_adapters
    if adapters and trainable_parameters is None:
        raise PlannerInputError("a LoRA step time needs its trainable parameters (the estimate's count)")
    recompute = scenario.checkpointing is Checkpointing.EVERY_LAYER
    micro_flops = training_flops(shape, scenario.batch_size, scenario.seq_len, recompute,
                                 trainable_parameters if adapters else None)
    peak = gpu.fp32_flops if scenario.precision is Precision.FP32 else gpu.bf16_flops
    rate = peak * utilisation * small_batch_factor(scenario.tokens_per_micro_batch)
    compute_s = scenario.grad_accum_steps * micro_flops / rate
    elements = trainable_parameters if adapters else shape.num_parameters
    if parallel is not None and parallel.plan.strategy.shards_optimizer_state:
        elements = -(-elements // num_devices)
    optimizer_s = elements * optimizer_bytes_per_element(scenario.optimizer, scenario.precision) / (
        gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    communication_s = 0.0
    if parallel is not None:
        communication_s = parallel.comm_wire_bytes_per_step / gpu.link_bytes_per_s
    elif num_devices > 1:
        grad_bytes = elements * (2 if scenario.precision is Precision.BF16 else 4)
        communication_s = 2 * (num_devices - 1) / num_devices * grad_bytes / gpu.link_bytes_per_s
    return StepTime(compute_s, optimizer_s, communication_s, scenario.grad_accum_steps * micro_flops)
