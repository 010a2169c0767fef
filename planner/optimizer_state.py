"""Optimizer state bytes, exact: what `optimizer.state` holds after the first step, on the
training device.

Each formula was checked byte for byte against the real optimizer (tests/test_optimizer_state.py
builds it, takes a step and sums the unique storages):
- torch AdamW / Adam: exp_avg and exp_avg_sq in the parameter's dtype, plus a 0-d fp32
  `step` per parameter tensor (torch/optim/adam.py `_init_group`). With neither `fused`
  nor `capturable` (the default) `step` is deliberately hosted on the CPU, so on CUDA it
  takes no device memory; the fused AdamW (`adamw_torch_fused`, Trainer's default) keeps
  it on the device.
- torch SGD, momentum 0.9: one momentum_buffer in the parameter's dtype.
- torch Adafactor: row and column variances (parameter dtype) for tensors with >= 2 dims
  (shape[:-1] and shape[:-2] + shape[-1:]), a full variance otherwise, plus a CPU-hosted
  0-d fp32 `step` (torch/optim/_adafactor.py).
- transformers Adafactor (TrainingArguments optim="adafactor": scale_parameter=False,
  relative_step=False): exp_avg_sq_row/col or exp_avg_sq, always fp32 (it upcasts 16-bit
  gradients first), plus a 0-d fp32 `RMS` on the device; its `step` is a Python int.
- bitsandbytes Adam8bit / AdamW8bit / PagedAdamW8bit (bnb 0.50, Optimizer2State.init_state):
  tensors under 4,096 elements keep two fp32 states; larger ones two uint8 states plus
  one fp32 absmax per 256-element block per state; the two 256-entry fp32 quantile maps
  (`qmap1`, `qmap2`) are shared by every tensor, so they count once. `step` is an int.
  When transformers' Trainer builds them (optim="adamw_bnb_8bit" / "paged_adamw_8bit") it
  registers every nn.Embedding weight for 32-bit state (`register_module_override`,
  trainer.py `create_optimizer`): two fp32 states for those tensors.
  PagedAdamW8bit on CUDA puts state1 and state2 of a tensor of 100,000 elements or more in
  CUDA unified memory (`Optimizer8bit.get_state_buffer` -> `functional.get_paged`:
  cudaMallocManaged through `cget_managed_ptr`, wrapped as a CPU torch tensor): they count
  as state here but live outside torch's caching allocator, unrounded (`paged_state_bytes`);
  absmax and the quantile maps stay ordinary CUDA tensors. On CPU bnb uses plain buffers.
  Measured on an H200 (benchmarks/results/gpu_check.md, Qwen2.5-0.5B, Trainer
  paged_adamw_8bit): max_memory_allocated 1.80 GB below a count with them inside.

On CUDA every allocation is rounded up to the caching allocator's 512-byte block
(c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize), which matters for the many small
tensors (biases, norms, scalars).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable

from planner.model_shape import ModelShape
from planner.scenario import Device, Engine, Optimizer, Precision

FP32_BYTES = 4
# bitsandbytes 8-bit optimizers keep 32-bit state for tensors with fewer elements than
# this (`min_8bit_size=4096` in bnb.optim.Optimizer8bit) and quantise the rest
# block-wise in blocks of 256 elements, one fp32 absmax per block and per state.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK_SIZE = 256
CUDA_ALLOCATION_BLOCK = 512
BNB_QMAP_BYTES = 256 * FP32_BYTES  # each of qmap1, qmap2
# bnb.optim.Optimizer8bit.get_state_buffer: `if not self.is_paged or p.numel() < 1e5` -> an
# ordinary tensor, else a paged (unified memory) buffer.
BNB_PAGED_MIN_ELEMENTS = 100_000
BNB_8BIT_OPTIMIZERS = (Optimizer.ADAM8BIT, Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT)


def parameter_bytes_per_element(precision: Precision) -> int:
    """Bytes per parameter element: pure bf16 stores 16-bit parameters, the rest fp32 masters."""
    return 2 if precision is Precision.BF16 else 4


def allocation(device: Device) -> Callable[[int], int]:
    """Bytes a tensor of `n` bytes takes on `device`: exact on CPU, 512-byte blocks on CUDA."""
    if device is Device.CUDA:
        return lambda n: -(-n // CUDA_ALLOCATION_BLOCK) * CUDA_ALLOCATION_BLOCK
    return lambda n: n


def _per_tensor_state(shape: tuple[int, ...], optimizer: Optimizer, param_bytes: int, on_device) -> int:
    numel = math.prod(shape)
    if optimizer in (Optimizer.ADAMW, Optimizer.ADAM):
        return 2 * on_device(numel * param_bytes)  # + the CPU-hosted step, added by the caller
    if optimizer is Optimizer.ADAMW_FUSED:
        return 2 * on_device(numel * param_bytes) + on_device(FP32_BYTES)
    if optimizer is Optimizer.SGD:
        return on_device(numel * param_bytes)
    if optimizer in (Optimizer.ADAFACTOR, Optimizer.HF_ADAFACTOR):
        element = param_bytes if optimizer is Optimizer.ADAFACTOR else FP32_BYTES
        if len(shape) >= 2:
            factored = (on_device(math.prod(shape[:-1]) * element)
                        + on_device(math.prod(shape[:-2]) * shape[-1] * element))
        else:
            factored = on_device(numel * element)
        rms = on_device(FP32_BYTES) if optimizer is Optimizer.HF_ADAFACTOR else 0
        return factored + rms
    if optimizer in (Optimizer.ADAM8BIT, Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        if numel < BNB_MIN_8BIT_SIZE:
            return 2 * on_device(numel * FP32_BYTES)
        blocks = -(-numel // BNB_BLOCK_SIZE)
        return 2 * on_device(numel) + 2 * on_device(blocks * FP32_BYTES)
    raise ValueError(f"no state model for optimizer {optimizer}")


def pages_state(optimizer: Optimizer, device: Device) -> bool:
    """Whether the optimizer keeps some tensors' state in CUDA unified memory (bitsandbytes' paged one on CUDA)."""
    return optimizer is Optimizer.PAGED_ADAMW8BIT and device is Device.CUDA


def is_paged_buffer(optimizer: Optimizer, device: Device, numel: int) -> bool:
    """Whether bitsandbytes puts this tensor's state1 and state2 in CUDA unified memory."""
    return pages_state(optimizer, device) and numel >= BNB_PAGED_MIN_ELEMENTS


def _bnb_buffer_bytes(numel: int, in_32_bit: bool) -> int:
    """state1 + state2 of one tensor, exact: fp32 in 32-bit state, else one byte each."""
    return 2 * numel * (FP32_BYTES if in_32_bit or numel < BNB_MIN_8BIT_SIZE else 1)


def paged_state_bytes(tensors: Iterable[tuple[str, tuple[int, ...], int]], optimizer: Optimizer,
                      device: Device = Device.CPU, engine: Engine = Engine.ACCELERATE,
                      embedding_names: Collection[str] = ()) -> int:
    """The part of `tensor_state_bytes` that a paged optimizer keeps in CUDA unified memory,
    outside torch's caching allocator (module doc); 0 for any other optimizer or on CPU."""
    if not pages_state(optimizer, device):
        return 0  # no tensor is a paged buffer: not summed per tensor on every estimate
    fp32_embeddings = trainer_keeps_embeddings_in_32_bit(optimizer, engine)
    return sum(_bnb_buffer_bytes(math.prod(shape), fp32_embeddings and name in embedding_names)
               for name, shape, _ in tensors if is_paged_buffer(optimizer, device, math.prod(shape)))


def model_paged_state_bytes(shape: ModelShape, optimizer: Optimizer, precision: Precision,
                            device: Device = Device.CPU, engine: Engine = Engine.ACCELERATE) -> int:
    """`paged_state_bytes` over every parameter of `shape` (full fine-tuning)."""
    if not pages_state(optimizer, device):
        return 0
    param_bytes = parameter_bytes_per_element(precision)
    return paged_state_bytes([(p.name, p.shape, param_bytes) for p in shape.params], optimizer, device, engine,
                             shape.embedding_param_names)


# torch optimizers whose state holds a `step` scalar tensor per parameter, kept on the CPU (not
# capturable, not fused): beside CPU parameters it is state, beside CUDA ones it is host memory.
STEP_TENSOR_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.ADAM, Optimizer.ADAFACTOR)


def trainer_keeps_embeddings_in_32_bit(optimizer: Optimizer, engine: Engine) -> bool:
    """True when Trainer builds a bitsandbytes 8-bit optimizer from its optim string."""
    return engine is Engine.TRAINER and optimizer in (Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT)


@functools.lru_cache(maxsize=4096)
def optimizer_state_bytes(shape: ModelShape, optimizer: Optimizer, precision: Precision,
                          device: Device = Device.CPU, engine: Engine = Engine.ACCELERATE) -> int:
    """Bytes of distinct storage in `optimizer.state` at steady state, on `device`."""
    param_bytes = parameter_bytes_per_element(precision)
    return tensor_state_bytes([(p.name, p.shape, param_bytes) for p in shape.params], optimizer, device, engine,
                              shape.embedding_param_names)


def tensor_state_bytes(tensors: Iterable[tuple[str, tuple[int, ...], int]], optimizer: Optimizer,
                       device: Device = Device.CPU, engine: Engine = Engine.ACCELERATE,
                       embedding_names: Collection[str] = ()) -> int:
    """The state of an optimizer over `tensors` (name, shape, bytes per element): every
    parameter tensor it updates, in its own dtype (LoRA's fp32 adapters on a bf16 base)."""
    on_device = allocation(device)
    fp32_embeddings = trainer_keeps_embeddings_in_32_bit(optimizer, engine)
    tensors = list(tensors)
    total = 0
    for name, shape, param_bytes in tensors:
        numel = math.prod(shape)
        if is_paged_buffer(optimizer, device, numel):  # unified memory: not in 512-byte blocks
            in_32_bit = fp32_embeddings and name in embedding_names
            absmax = 0 if in_32_bit else 2 * on_device(-(-numel // BNB_BLOCK_SIZE) * FP32_BYTES)
            total += _bnb_buffer_bytes(numel, in_32_bit) + absmax
        elif fp32_embeddings and name in embedding_names:
            total += 2 * on_device(math.prod(shape) * FP32_BYTES)  # bnb 32-bit Adam: two fp32 states
        else:
            total += _per_tensor_state(shape, optimizer, param_bytes, on_device)
    if optimizer in STEP_TENSOR_OPTIMIZERS and device is Device.CPU:
        total += FP32_BYTES * len(tensors)  # CPU-hosted `step` tensors live where the params do
    if optimizer in (Optimizer.ADAM8BIT, Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        if any(math.prod(shape) >= BNB_MIN_8BIT_SIZE and not (fp32_embeddings and name in embedding_names)
               for name, shape, _ in tensors):
            total += 2 * on_device(BNB_QMAP_BYTES)  # qmap1 and qmap2, shared
    return total


@functools.lru_cache(maxsize=1024)
def parameter_tensor_bytes(shape: ModelShape, precision: Precision, device: Device = Device.CPU) -> int:
    """Bytes of one copy of every parameter (or of every gradient) on `device`."""
    on_device = allocation(device)
    element = parameter_bytes_per_element(precision)
    return sum(on_device(p.numel * element) for p in shape.params)
