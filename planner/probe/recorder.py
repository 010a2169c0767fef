"""The probe's recorder: torch's MemTracker, with every change of its live bytes written down.

MemTracker (torch.distributed._tools.mem_tracker) already keeps exact live bytes by
category (it is the simulate runner's measurement). `Recorder` keeps its accounting
untouched and adds a trace: each storage MemTracker starts to track gets a creation index
and the shape of the tensor that created it, and each addition, deletion or category
change while recording is on becomes one `Event` labelled with where the step is (micro-
batch, forward or backward, and the block being run, read from MemTracker's ModTracker).

Known limitations: a storage larger than the tensor that created it (an op returning a
view of a fresh buffer) or a resized storage has no shape-derived size; the recording is
marked `unsized` and the solver refuses it rather than guessing.
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass, field

from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _UpdateType

from planner.probe.memtracker import TrainableMemTracker

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


class Recorder(TrainableMemTracker):
    """MemTracker that writes down its updates (see the module docstring)."""

    def __init__(self, recording: Recording, stacks: tuple[tuple[str, int], ...]) -> None:
        """`stacks`: (ModuleList of blocks, number of its first block), in the order they run;
        an encoder-decoder's decoder block 0 is numbered on from its encoder's last."""
        super().__init__()
        self.recording = recording
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
