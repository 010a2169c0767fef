"""What a simulated (FakeTensorMode) training step needs so it takes the real run's path.

Context managers, each active only for the duration of one simulated step:

- `all_ones_padding_masks()`: transformers (5.x, masking_utils) decides whether it may drop
  the 2-D `attention_mask` with checks that read its values (`fast_all(padding_mask)`,
  `padding_mask.all()`), and skips those checks, answering "keep the mask", whenever
  `is_tracing(padding_mask)` is true, which it is for every FakeTensor
  (`utils.import_utils.is_tracing` ORs in `is_fake_tensor`). A real run on an unpadded
  batch drops the mask; a simulated one would materialise a (b, 1, s, s) mask, and because
  `integrations.sdpa_attention.use_gqa_in_sdpa` needs `attention_mask is None`, also
  `repeat_kv` the keys and values of grouped-query attention, and pass `is_causal=False`.
  ../shared/DESIGN.md (Known facts) measured this as +b·a·s²·4 bytes at an OPT peak.
  The two predicates that make the decision for SDPA, `_ignore_causal_mask_sdpa` and
  `_ignore_bidirectional_mask_sdpa`, are wrapped so that a fake padding mask is passed as
  `None`: for an all-ones mask every branch of both predicates then answers exactly as the
  real values would ("no token is padded"), and nothing else reads the values. Everything
  downstream (`sdpa_attention_forward`'s GQA choice and `is_causal`) follows from the mask
  being `None`, so it needs no patch. The eager path never drops the causal mask; it only
  combines the padding mask elementwise, which fake tensors do as real ones do.
  Contract: inside this context every fake padding mask is all ones. The simulator only
  builds batches it has checked to be all ones (`the simulator and the probe`).

- `scalar_stand_ins()`: `.item()` on a fake tensor has no value (FakeTensorMode raises
  DataDependentOutputException). torch's Adafactor reads its step counter and parameter /
  update norms with `.item()` to compute Python-float step sizes. A stand-in value changes
  those scalars but no tensor's shape, dtype or lifetime, so memory bookkeeping is exact.
  Only floating-point scalars are stood in: an integer or boolean `.item()` usually steers
  control flow (how much to allocate, which path to take), and guessing it would silently
  simulate a different run, so it still raises.

- `grouped_mm_in_every_dtype()`: transformers' mixture-of-experts layers (5.x,
  `integrations.moe.grouped_mm_experts_forward`, the default experts implementation) run
  `torch._grouped_mm`. Its CPU kernel takes fp32 (and the fp32 weights a bf16-mixed run
  keeps), but its meta kernel (`torch._meta_registrations._meta_grouped_mm_common`) copies
  the CUDA kernel's checks and refuses anything but bf16, so fake tensors could not run
  an fp32 or mixed-precision expert layer. Inside this context a fake `_grouped_mm` of
  another dtype returns the output the meta kernel builds
  (`_create_grouped_mm_output_tensor`: the same size rule for all four 2-D/3-D cases,
  contiguous on a CPU build) in the input's dtype; bf16 still takes the meta kernel. The
  kernel's inputs are the saved tensors of its backward, so nothing else changes.
  Routing does not change memory on this path: every token's top-k copies form one
  (tokens x top_k, width) tensor sorted by expert, whatever the router chooses.

- `adapters_cast_in_place()`: PEFT moves each new adapter to its base layer's device and
  dtype with `Module.to` (`BaseTunerLayer._move_adapter_to_device_of_base_layer`,
  `LoraModel._replace_module`), and `Module._apply` must swap a fake parameter for the
  converted one, which fails (a fake tensor carries weak references). Inside this context
  a `Module.to` of an all-fake module that stays on its device converts only what changes
  dtype, in place through `.data`, exactly as `.to(dtype=...)` would leave it: the same
  tensors in the same dtypes. Any real move still goes to `Module.to`. PEFT also trains
  a sequence classifier's head as a `copy.deepcopy` (`ModulesToSaveWrapper`), and a
  deep-copied fake tensor gets a fake mode of its own (which no op may mix with the
  model's, and which crashed a later simulation in a dropout kernel): the copy of an
  all-fake module is given fresh fake tensors of the same shape, strides, dtype and
  requires_grad in the model's mode (a fake tensor's values are never read).

- `fake_weight_init()`: building a model on fake tensors where its weight init reads
  values (torch's `trunc_normal_` rejection loop, ModernBERT): such an init leaves a fake
  tensor as it is.

- `batch_values()`: a fake tensor has no values, so an op whose output size depends on them
  (`nonzero`) raises DynamicOutputShapeException. Models run such ops on the batch, not on
  weights: DeBERTa-v2's sequence classifier keeps the labelled rows with
  `(labels >= 0).nonzero()`. A batch faked with `fake_batch` remembers its real values (the
  small real batch the run itself would use), and inside this context every op whose fake
  inputs all have values is also run on the values: its outputs get values in turn. A
  `nonzero` (or an integer `.item()`) of such a tensor is then answered from the values: the
  fake output has the real one's size, exactly what the real run allocates. Anything
  touched by a tensor without values (a weight, an activation) has none, so routing by a
  router's scores still raises, and a write into a tensor from one without values drops its
  values. Only outputs of at most MAX_VALUE_ELEMENTS elements get values (a (b, s, s) mask
  built from the attention mask at long sequences does not), so the real work stays
  batch-sized: a few small ops per step.

Known limitations: the mask patch targets the SDPA/eager mask helpers of transformers 5.x
`masking_utils`; other value-reading shortcuts (packed-sequence detection when no
attention_mask is given, the recurrent-layer mask of hybrid models, the flex-attention
mask) still see a fake tensor as "tracing". The simulator always passes an attention_mask
and supports sdpa/eager only, so they are not reached.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import sys

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    in_kernel_invocation_manager,
    unset_fake_temporarily,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

STAND_IN_FLOAT = 1.0  # positive and finite: every Adafactor formula that reads a scalar stays defined


def _without_fake_padding_mask(predicate, mask_position: int = 0):
    @functools.wraps(predicate)
    def wrapper(*args, **kwargs):
        if "padding_mask" in kwargs:
            if isinstance(kwargs["padding_mask"], FakeTensor):
                kwargs["padding_mask"] = None
        elif len(args) > mask_position and isinstance(args[mask_position], FakeTensor):
            args = args[:mask_position] + (None,) + args[mask_position + 1:]
        return predicate(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def all_ones_padding_masks():
    """Let transformers drop fake all-ones padding masks as it drops real ones (see module doc)."""
    from transformers import masking_utils

    originals = {name: getattr(masking_utils, name)
                 for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")}
    try:
        for name, predicate in originals.items():
            setattr(masking_utils, name, _without_fake_padding_mask(predicate))
        yield
    finally:
        for name, predicate in originals.items():
            setattr(masking_utils, name, predicate)


class _ScalarStandIns(TorchDispatchMode):
    """Answers `.item()` on floating-point fake tensors with STAND_IN_FLOAT (see module doc)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            (tensor,) = args
            # A fake tensor that still carries its constant answers with the real value.
            if (isinstance(tensor, FakeTensor) and tensor.dtype.is_floating_point
                    and getattr(tensor, "constant", None) is None):
                return STAND_IN_FLOAT
        return func(*args, **kwargs)


@contextlib.contextmanager
def scalar_stand_ins():
    """Enter after (inside) the FakeTensorMode, so `.item()` reaches this mode first."""
    with _ScalarStandIns():
        yield


def _grouped_mm_output(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return NotImplemented  # the meta kernel's own path
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    with in_kernel_invocation_manager(fake_mode):
        output = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
    return FakeTensor(fake_mode, output, mat_a.fake_device)


@contextlib.contextmanager
def grouped_mm_in_every_dtype():
    """Let fake tensors run `torch._grouped_mm` in the dtypes its CPU kernel takes (see module doc)."""
    grouped_mm = torch.ops.aten._grouped_mm.default
    if grouped_mm in fake_impls.op_implementations_dict:  # already inside (nested simulations)
        yield
        return
    fake_impls.op_implementations_dict[grouped_mm] = _grouped_mm_output
    try:
        yield
    finally:
        fake_impls.op_implementations_dict.pop(grouped_mm, None)


def _fake_module_to(original):
    @functools.wraps(original)
    def to(module, *args, **kwargs):
        tensors = list(module.parameters()) + list(module.buffers())
        if not tensors or not all(isinstance(t, FakeTensor) for t in tensors):
            return original(module, *args, **kwargs)
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and any(t.device != torch.device(device) for t in tensors):
            return original(module, *args, **kwargs)  # a real move: let Module.to say what fails
        for tensor in tensors:
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
        return module

    return to


def _fake_module_deepcopy(original):
    @functools.wraps(original)
    def deepcopy(x, memo=None, *args):
        if isinstance(x, torch.nn.Module):
            tensors = list(x.parameters()) + list(x.buffers())
            if tensors and all(isinstance(t, FakeTensor) for t in tensors):
                memo = {} if memo is None else memo
                for tensor in tensors:
                    with tensor.fake_mode:
                        fresh = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
                    if isinstance(tensor, torch.nn.Parameter):
                        fresh = torch.nn.Parameter(fresh, requires_grad=tensor.requires_grad)
                    memo[id(tensor)] = fresh
        return original(x, memo, *args)

    return deepcopy


@contextlib.contextmanager
def adapters_cast_in_place():
    """Build PEFT adapters on a fake-tensor model (see module doc)."""
    to, deepcopy = torch.nn.Module.to, copy.deepcopy
    torch.nn.Module.to, copy.deepcopy = _fake_module_to(to), _fake_module_deepcopy(deepcopy)
    try:
        yield
    finally:
        torch.nn.Module.to, copy.deepcopy = to, deepcopy


def _skip_fake(initializer):
    @functools.wraps(initializer)
    def wrapper(tensor, *args, **kwargs):
        return tensor if isinstance(tensor, FakeTensor) else initializer(tensor, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def fake_weight_init():
    """Build a model on fake tensors whose init reads values: torch 2.13's `trunc_normal_`
    (ModernBERT's init) draws and redraws until no value is out of bounds (`mask.any()`,
    `.item()`), which a fake tensor cannot answer. An in-place init of a fake tensor writes
    no value and allocates nothing the step sees, so inside this context it returns the
    tensor as it is (as torch's own init does for meta tensors); real tensors are drawn."""
    from transformers import initialization

    original = torch.nn.init.trunc_normal_
    registered = initialization.TORCH_INIT_FUNCTIONS.get("trunc_normal_")
    torch.nn.init.trunc_normal_ = _skip_fake(original)
    if registered is not None:
        initialization.TORCH_INIT_FUNCTIONS["trunc_normal_"] = _skip_fake(registered)
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_ = original
        if registered is not None:
            initialization.TORCH_INIT_FUNCTIONS["trunc_normal_"] = registered


_VALUES = WeakIdKeyDictionary()  # fake tensor -> the real tensor it stands for (batch-derived only)
# Values are computed only for outputs up to this many elements (a batch is b x s, at most a
# few million tokens); a larger one (a (b, s, s) mask built from the attention mask) gets none.
MAX_VALUE_ELEMENTS = 1 << 24
# Ops whose output size is read from values: answered from them (the fake kernel raises).
_SIZED_BY_VALUES = (torch.ops.aten.nonzero.default,)
# Off, an op sized by values raises as on plain fake tensors (the probe then falls back to
# real tensors): tests switch it off to check that fallback.
ANSWER_SIZES_FROM_VALUES = True
_INDEX = torch.ops.aten.index.Tensor


def fake_batch(fake_mode, batch: dict) -> dict:
    """Fake copies of a real batch's tensors that remember their values (batch_values())."""
    faked = {}
    for name, tensor in batch.items():
        faked[name] = fake_mode.from_tensor(tensor)
        _VALUES[faked[name]] = tensor
    return faked


def _is_valued_mask(index) -> bool:
    return isinstance(index, FakeTensor) and index.dtype in (torch.bool, torch.uint8) and index in _VALUES


def _masks_as_positions(indices: list) -> list:
    """A boolean mask index is the positions where it is true (how ATen's index kernel reads it,
    `expandTensors`): one long index per mask dimension, fake, with those positions as values.
    The kernel makes these inside one op, so they are not the step's tensors: built outside
    the dispatch modes (from_tensor), only the op's output is seen."""
    out = []
    for index in indices:
        if not _is_valued_mask(index):
            out.append(index)
            continue
        with unset_fake_temporarily():
            where = _VALUES[index].nonzero().unbind(1)
        for positions in where:
            fake = index.fake_mode.from_tensor(positions.contiguous())
            _VALUES[fake] = positions
            out.append(fake)
    return out


class _BatchValues(TorchDispatchMode):
    """Runs ops on the values of fake tensors that have them (see module doc)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fakes = [t for t in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(t, FakeTensor)]
        if ANSWER_SIZES_FROM_VALUES and func is _INDEX and args[0] not in _VALUES and any(_is_valued_mask(index) for index in args[1]):
            # Activations picked by a mask made from the batch (an encoder-decoder classifier's
            # `hidden[input_ids == eos]`): the fake kernel cannot size it, the positions can.
            return func(args[0], _masks_as_positions(args[1]))
        if not fakes or not all(t in _VALUES for t in fakes):
            schema = getattr(func, "_schema", None)
            if schema is not None and schema.is_mutable:  # written from something without values: they are gone
                for argument, value in zip(schema.arguments, args):
                    if argument.alias_info is not None and argument.alias_info.is_write and value in _VALUES:
                        del _VALUES[value]
            return func(*args, **kwargs)
        sized_by_values = (func is torch.ops.aten._local_scalar_dense.default
                           or (ANSWER_SIZES_FROM_VALUES and func in _SIZED_BY_VALUES))
        out = None
        if not sized_by_values:
            try:
                out = func(*args, **kwargs)
            except DynamicOutputShapeException:  # unique_consecutive, masked_select ...: sized by the values
                if not ANSWER_SIZES_FROM_VALUES:
                    raise
                sized_by_values = True
        if out is not None:
            if any(isinstance(t, torch.Tensor) and t.numel() > MAX_VALUE_ELEMENTS for t in pytree.tree_leaves(out)):
                return out  # too large to compute for real (a (b, s, s) mask at long sequences): no values
        real_args, real_kwargs = pytree.tree_map_only(FakeTensor, _VALUES.__getitem__, (args, kwargs))
        with unset_fake_temporarily():
            real = func(*real_args, **real_kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return real
        if out is None:  # sized by the values: the fake output takes the real one's size
            device = fakes[0].device
            out = pytree.tree_map_only(torch.Tensor, lambda r: torch.empty_strided(
                r.shape, r.stride(), dtype=r.dtype, device=device), real)
        for fake, value in zip(pytree.tree_leaves(out), pytree.tree_leaves(real)):
            if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor):
                _VALUES[fake] = value
        return out


@contextlib.contextmanager
def batch_values():
    """Enter after (inside) the FakeTensorMode and scalar_stand_ins: a value wins over a stand-in."""
    with _BatchValues():
        yield


@contextlib.contextmanager
def _quiet_fake_kernel_failures():
    # FakeTensorMode logs a traceback at ERROR level before it raises a failing meta kernel;
    # the exception itself carries the message, and the caller turns it into one line.
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def simulation(fake_mode, gpu=None):
    """Fake tensors and the patches that keep a simulated step on the real run's path
    (the simulate runner and the probe both enter this). `gpu` (a planner.probe.fake_cuda
    CudaGpu or architecture name such as "sm90"): the step takes CUDA's attention backend,
    dropout kernel, autocast lists and optimizer default on that GPU instead of the CPU's;
    None, the CPU's (and nothing is yielded)."""
    if gpu is None:
        kernels = contextlib.nullcontext()
    else:
        from planner.probe.fake_cuda import cuda_kernels

        kernels = cuda_kernels(gpu)
    # A 4-bit model imported bitsandbytes; its matmul then runs as on CUDA (planner.probe.fake_quantized).
    four_bit = contextlib.nullcontext()
    if gpu is not None and "bitsandbytes" in sys.modules:
        from planner.probe.fake_quantized import gemm_4bit_as_on_cuda

        four_bit = gemm_4bit_as_on_cuda()
    with (fake_mode, scalar_stand_ins(), batch_values(), all_ones_padding_masks(), grouped_mm_in_every_dtype(),
          _quiet_fake_kernel_failures(), four_bit, kernels as choices):
        yield choices  # with a gpu, the record of its attention choices (fake_cuda.cuda_kernels)


def fake_quantile_maps(optimizer, fake_mode) -> None:
    """bitsandbytes' 8-bit optimizers build their two 256-entry quantile maps in the
    constructor, as real tensors, and put them into the state at the first step; fake
    copies keep them countable (they are optimizer state in the real run) and keep the
    8-bit update kernel's inputs all fake."""
    qmaps = getattr(optimizer, "name2qmap", None)
    if qmaps:
        for name, qmap in qmaps.items():
            if isinstance(qmap, torch.Tensor) and not isinstance(qmap, FakeTensor):
                qmaps[name] = fake_mode.from_tensor(qmap)
