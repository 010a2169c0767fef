"""The probe's recorder: torch's MemTracker, with every change of its live bytes written down.

MemTracker (torch.distributed._tools.mem_tracker) already keeps exact live bytes by
category (it is the simulate runner's measurement). `Recorder` keeps its accounting
untouched and adds a trace: each storage MemTracker starts to track gets a creation index
and the shape of the tensor that created it, and each addition, deletion or category
change while recording is on becomes one `Event` labelled with where the step is (micro-
batch, forward or backward, and the block being run, read from MemTracker's ModTracker).

On CUDA's kernels (a probe for a CUDA plan) the step takes CUDA's path
(planner.probe.memtracker: gradient sums in place, softmax backward's temporary, dropout's
mask first), and the recorder also writes down, on the storage an op made, what the real
kernel makes beside its outputs that no allocation of the probe stands for: which storages
a cuBLAS routine made (the caching allocator gives each thread's cuBLAS workspace at its
first such call: planner.reserved places it there) and, for a reduction over leading
dimensions of a contiguous tensor (a bias's gradient: `sum_to` over the tokens), its rows
and columns (its launch takes a workspace for as long as it runs when it splits the rows
across blocks: planner.cuda_reduction, whose size is not a polynomial in b and s), and, on
the last output of a fused attention backward, its dimensions, backend and whether cuDNN
would take it (its kernels' scratch: planner.attention_scratch), and on an embedding
backward's output its sizes (planner.embedding_scratch).

Known limitations: a storage larger than the tensor that created it (an op returning a
view of a fresh buffer) or a resized storage has no shape-derived size; the recording is
marked `unsized` and the solver refuses it rather than guessing. Reductions of other
shapes (over the last dimension, or over all elements) are not marked: their kernels reduce
within a block, or their workspace is a few bytes.
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _UpdateType

from planner.attention_scratch import AttentionBackward
from planner.embedding_scratch import EmbeddingBackward
from planner.probe.accumulation import InputBufferSums
from planner.probe.fake_cuda import attention_backward_call
from planner.probe.memtracker import TrainableMemTracker

_aten = torch.ops.aten
# ATen operators that run a cuBLAS or cuBLASLt routine on CUDA (aten/src/ATen/cuda/CUDABlas.cpp
# callers in native/cuda/Blas.cpp); `linear` and `matmul` reach the device as these.
CUBLAS_OPS = frozenset({_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.addmv, _aten.mv,
                        _aten.dot, _aten.vdot, _aten._addmm_activation, _aten._scaled_mm, _aten._int_mm})
# Reductions whose CUDA kernel is Reduce.cuh's `gpu_reduce_kernel` (planner.cuda_reduction).
COLUMN_REDUCTIONS = frozenset({_aten.sum.dim_IntList, _aten.mean.dim})


def column_reduction_shape(func, args, kwargs) -> tuple[int, int, int] | None:
    """(rows, columns, accumulator bytes) of a reduction of a dense floating-point tensor over
    dimensions that all move slower in memory than every dimension it keeps (the rows reduced,
    the columns kept), else None. TensorIterator orders a reduction's dimensions by stride, so
    a transposed gradient reduced over its leading dimensions (a per-head norm's weight, whose
    input came through a transpose) takes the same kernel as a contiguous one."""
    if func not in COLUMN_REDUCTIONS or not args or not isinstance(args[0], torch.Tensor):
        return None
    tensor = args[0]
    dims = args[1] if len(args) > 1 else (kwargs or {}).get("dim")
    if not tensor.is_floating_point() or tensor.dim() < 2 or not dims:
        return None
    reduced = {d % tensor.dim() for d in dims}
    if len(reduced) == tensor.dim():
        return None
    order = [d for d in sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)) if tensor.size(d) != 1]
    expected = 1  # dense: each dimension's stride is the product of the faster ones' sizes
    for d in reversed(order):
        if tensor.stride(d) != expected:
            return None
        expected *= tensor.size(d)
    slow = [d in reduced for d in order]
    if not any(slow) or slow != sorted(slow, reverse=True):  # the reduced dimensions first in memory
        return None
    rows = math.prod(tensor.size(d) for d in reduced)
    accumulator = 8 if tensor.dtype == torch.float64 else 4  # acc_type: float for fp32, bf16 and fp16
    return rows, tensor.numel() // max(rows, 1), accumulator


def embedding_backward_call(func, args, kwargs) -> EmbeddingBackward | None:
    """The sizes of an `embedding_dense_backward` (planner.embedding_scratch), else None."""
    if func is not _aten.embedding_dense_backward.default:
        return None
    named = dict(zip((a.name for a in func._schema.arguments), args)) | dict(kwargs or {})
    grad, indices = named["grad_output"], named["indices"]
    return EmbeddingBackward(indices.numel(), int(named["num_weights"]), grad.size(-1), grad.element_size(),
                             indices.element_size(), indices.is_contiguous(), grad.is_contiguous(),
                             bool(named["scale_grad_by_freq"]))


# MemTracker's reference types, in the planner's category vocabulary (runners.probes too).
CATEGORY = {"Parameter": "weights", "Buffer": "weights", "Gradient": "gradients", "Optstate": "optimizer_state",
            "Activation": "activations", "Temp": "temporaries", "Other": "temporaries"}


@dataclass(frozen=True)
class Event:
    """One change of live bytes: storage `index` enters (+1) or leaves (-1) `category`."""

    micro_batch: int
    backward: bool
    block: int | None  # index of the repeated block being run, None outside the blocks
    index: int  # creation index of the storage
    sign: int
    category: str


@dataclass
class Recording:
    """What one probe at one (batch, sequence) recorded."""

    batch_size: int
    seq_len: int
    sizes: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)  # per storage: shape, itemsize, bytes
    live_at_start: list[tuple[int, str]] = field(default_factory=list)  # (index, category), not weights
    events: list[Event] = field(default_factory=list)
    unsized: list[str] = field(default_factory=list)
    # storage index -> (dimension, kind): a dimension its kernel announced as derived from the
    # sequence length (planner.probe.table.ROUNDINGS; planner.probe.fake_cuda.rounded_sizes_to)
    rounded: dict[int, tuple[int, str]] = field(default_factory=dict)
    # parameters (the probed model's names) the step leaves without a gradient
    no_gradient: list[str] = field(default_factory=list)
    # CUDA probes (module doc): storages a cuBLAS routine made, and storage -> (rows, columns,
    # accumulator bytes) of a column reduction's output
    cublas: list[int] = field(default_factory=list)
    column_reductions: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    # storage -> the fused attention backward whose last output it is (planner.attention_scratch)
    attention_backwards: dict[int, AttentionBackward] = field(default_factory=dict)
    # storage -> the embedding backward whose output it is (planner.embedding_scratch)
    embedding_backwards: dict[int, EmbeddingBackward] = field(default_factory=dict)


class Recorder(TrainableMemTracker):
    """MemTracker that writes down its updates (see the module docstring)."""

    def __init__(self, recording: Recording, stacks: tuple[tuple[str, int], ...],
                 cuda_path: InputBufferSums | None = None) -> None:
        """`stacks`: (ModuleList of blocks, number of its first block), in the order they run;
        an encoder-decoder's decoder block 0 is numbered on from its encoder's last.
        `cuda_path` (a calibrated InputBufferSums, on CUDA's kernels): the step takes CUDA's
        path (planner.probe.memtracker), and what cuBLAS and column reductions make is marked."""
        super().__init__(cuda_path)
        self.recording = recording
        self._making: tuple | None = None  # what the op being dispatched is, for its new storages
        self._stacks = tuple((re.compile(re.escape(prefix) + r"\.(\d+)$"), first) for prefix, first in stacks)
        # Storages the tracker will first see through a view (note_inputs, note_rounded):
        # storage -> (shape, element size) of the tensor that made it.
        self._creators: dict[int, tuple[tuple[int, ...], int]] = {}
        self._rounded_before: dict[int, tuple[int, str]] = {}  # storage -> announced (dim, kind)
        self._index: dict[int, int] = {}  # id(winfo) -> creation index
        self._alive: dict[int, tuple[int, str]] = {}  # id(winfo) -> (index, category)
        self._winfos: dict[int, object] = {}  # keeps winfo ids unique while they are referenced
        self.on = False
        self.micro_batch = 0
        self.backward = False

    def _update_peak_stats(self, peak_state) -> None:
        # The events are the record: no running peak is read from a recorder.
        pass

    def _dispatch_on_cuda(self, func, types, args, kwargs):
        packet = getattr(func, "overloadpacket", None)
        reduction = column_reduction_shape(func, args, kwargs)
        attention = attention_backward_call(func, args, kwargs)
        embedding = embedding_backward_call(func, args, kwargs)
        self._making = (("cublas",) if packet in CUBLAS_OPS else ("reduction", reduction) if reduction
                        else ("attention", []) if attention else ("embedding", []) if embedding else None)
        try:
            return super()._dispatch_on_cuda(func, types, args, kwargs)
        finally:
            if attention is not None and self._making[1]:
                self.recording.attention_backwards[max(self._making[1])] = attention
            if embedding is not None and self._making[1]:  # its one output, the weight's gradient
                self.recording.embedding_backwards[max(self._making[1])] = embedding
            self._making = None

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        winfos = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        self._note_shape(t)
        return winfos

    def _track(self, reftype, t) -> None:  # every op's outputs
        super()._track(reftype, t)
        self._note_shape(t)

    def note_inputs(self, tensors) -> None:
        """Tensors made before the step (the batch): the tracker first sees their storages
        through a view an op returns (a slice of input_ids an encoder-decoder shifts into
        decoder inputs), and the view is not the tensor that made the storage."""
        for t in tensors:
            for storage in get_untyped_storages(t):
                self._creators[storage._cdata] = (tuple(t.shape), t.element_size())
                # A batch dies in the step (the next micro-batch is bound): its address may be
                # reused by a new storage, which must not take its shape.
                weakref.finalize(t, self._creators.pop, storage._cdata, None)

    def _note_shape(self, t) -> None:
        """The first tensor seen on a new storage is the one that created it (note_inputs')."""
        for storage in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(storage, (None, None))
            index = self._index.get(id(winfo)) if winfo is not None else None
            if index is not None and self.recording.sizes[index][0] is None:
                nbytes = self.recording.sizes[index][2]
                # Popped: a storage freed later may leave its address to a new one.
                shape, element_size = self._creators.pop(storage._cdata, (tuple(t.shape), t.element_size()))
                self.recording.sizes[index] = (shape, element_size, nbytes)
                if storage._cdata in self._rounded_before:
                    self.recording.rounded[index] = self._rounded_before.pop(storage._cdata)
                if math.prod(shape) * element_size != nbytes:
                    self.recording.unsized.append(f"storage {index}: {nbytes} B behind a {shape} tensor")

    def note_rounded(self, t, dim: int, kind: str) -> None:
        """`t`'s dimension `dim` is `kind` of the sequence length (its kernel says so). A kernel
        that returns a slice of `t` (the memory-efficient backward's bias gradient) announces
        it before the tracker sees the slice: `t` is then the storage's creating tensor."""
        for storage in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(storage, (None, None))
            index = self._index.get(id(winfo)) if winfo is not None else None
            if index is not None:
                self.recording.rounded[index] = (dim, kind)
            else:
                self._rounded_before[storage._cdata] = (dim, kind)
                self._creators[storage._cdata] = (tuple(t.shape), t.element_size())

    def _label_block(self) -> int | None:
        found = [first + int(match.group(1)) for name in self._mod_tracker.parents
                 for pattern, first in self._stacks if (match := pattern.search(name))]
        if not found:
            return None
        # Forward enters block k before leaving k-1's hooks, backward the other way round.
        return min(found) if self.backward else max(found)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        key = id(winfo)
        if u_type == _UpdateType.ADD:
            index = len(self.recording.sizes)
            self._index[key] = index
            self._winfos[key] = winfo
            # The creating tensor's shape is filled in by _update_and_maybe_create_winfos.
            self.recording.sizes.append((None, winfo.element_size, winfo.mem_consumed))
            category = CATEGORY[winfo.reftype.value]
            self._alive[key] = (index, category)
            if self._making is not None:
                if self._making[0] == "cublas":
                    self.recording.cublas.append(index)
                elif self._making[0] in ("attention", "embedding"):
                    self._making[1].append(index)
                else:
                    self.recording.column_reductions[index] = self._making[1]
            self._emit(index, +1, category)
        elif u_type == _UpdateType.DEL:
            if key not in self._alive:
                return
            index, category = self._alive.pop(key)
            self._emit(index, -1, category)
        elif u_type == _UpdateType.REF:
            if key not in self._alive:  # an empty storage: never counted
                return
            index, category = self._alive[key]
            new_category = CATEGORY[winfo.reftype.value]
            if new_category != category:
                self._emit(index, -1, category)
                self._emit(index, +1, new_category)
                self._alive[key] = (index, new_category)
        else:  # a storage resized in place: no creating shape describes it
            self.recording.unsized.append(f"storage {self._index.get(key)} resized")

    def _emit(self, index: int, sign: int, category: str) -> None:
        if self.on:
            self.recording.events.append(Event(self.micro_batch, self.backward, self._label_block(), index, sign,
                                               category))

    def start(self) -> None:
        """Recording starts: what is alive now (other than weights) is the step's starting point."""
        self.recording.live_at_start = [(index, category) for index, category in self._alive.values()
                                        if category != "weights"]
        self.on = True
