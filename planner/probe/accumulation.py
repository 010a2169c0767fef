"""The autograd engine's gradient sums, in place where a real run does them in place.

When a tensor feeds several operations (a residual stream, q, k and v from one normed input,
an embedding tied to the LM head), backward sums the gradients it receives in the engine's
input buffer (torch/csrc/autograd/input_buffer.cpp, `accumulate`). On real tensors the sum
is in place, `old_var.add_(var)`, when `can_accumulate_inplace(old_var)`: a plain dense
tensor whose last reference the buffer holds (tensor and storage use counts of one), grad
mode off. Under any dispatch mode, and on any tensor subclass, `isTensorSubclassLike` is
true (ATen/TensorSubclassLikeUtils.h: `dispatch_mode_enabled()`), and the sum is out of
place, `old_var + var`: one more gradient-sized tensor until the old one is dropped. A
probe runs under MemTracker on fake tensors, so it always took the out-of-place path; on an
H200, Llama-3.2-1B's two tied-embedding gradients (1.05 GB each in fp32) were summed in place
and the probe's step had one such tensor too many at the end of backward (+7.09%).

`InputBufferSums` lets a probe take the real path. Every node of the graph gets a post-hook
(the engine calls it after the node's apply and before it hands the outputs to their
consumers' input buffers: engine.cpp `call_function`, then `evaluate_function`'s
`input_buffer.add`), so an `aten.add.Tensor` dispatched while that node is still the
engine's current one (`torch._C._current_autograd_node()`) is an input-buffer sum, not the
node's own arithmetic. It is turned into `add_` when the real condition holds for the fake
tensor: the fake step holds the same references a real one does (the buffer's, and any view
base or other consumer still pending), so its use counts, less what dispatching itself adds
(measured once per run, `calibrate`, on a sum the engine makes in place), tell it.
`watching_backward` hooks the graph of every `torch.autograd.backward` call, a reentrant
checkpoint's inner backward included.

Only CUDA probes and simulated CUDA steps take this path (planner.probe.run,
runners.probes.MemTrackerProbe): CPU runs are measured with MemTracker, under which a real
CPU step also sums out of place, and the CPU tables keep that path.
tests/test_probe_accumulation.py checks the decisions against the real engine's, sum by sum,
on real CPU tensors with no mode active.
"""

from __future__ import annotations

import contextlib

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import TorchDispatchMode

ADD = torch.ops.aten.add.Tensor
ADD_IN_PLACE = torch.ops.aten.add_.Tensor


def graph_nodes(root) -> list:
    """Every node reachable from `root` (a loss's grad_fn), each once."""
    seen: dict[int, object] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen.values())


def _use_counts(tensor: torch.Tensor) -> tuple[int, int]:
    """(tensor, storage) use counts as seen from a dispatch: both include dispatching's own."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class InputBufferSums:
    """Marks the engine's input-buffer sums during a backward and says which a real run makes
    in place (module doc). `calibrate` once, under the modes the sums will be seen from but
    outside any recorder, then `watch` each loss before its backward and `release` after."""

    def __init__(self) -> None:
        self._finished = None  # the node whose apply has returned, its outputs being handed on
        self._handles: list[list] = []  # per watched graph (a reentrant checkpoint nests one)
        self._last_reference: tuple[int, int] | None = None  # use counts of a buffer's only tensor
        self.sums_in_place = 0
        self.sums_out_of_place = 0

    def calibrate(self) -> None:
        """The use counts a dispatched sum sees on a tensor only the input buffer holds, under
        the modes active now (fake tensors or real): a graph of two consumers of one leaf,
        whose first gradient is a fresh product nothing else keeps, is summed once, and a real
        run sums it in place (tests/test_probe_accumulation.py)."""
        leaf = torch.zeros((2,), dtype=torch.float32).requires_grad_()
        with torch.enable_grad():
            total = (leaf * 2).sum() + (leaf * 3).sum()
        seen: list[tuple[int, int]] = []
        sums = self

        class _Measure(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if sums.is_buffer_sum(func):
                    seen.append(_use_counts(args[0]))
                return func(*args, **(kwargs or {}))

        self.watch(total, calibrating=True)
        try:
            with _Measure():
                total.backward()
        finally:
            self.release()
        if len(seen) != 1:
            raise RuntimeError(f"calibration saw {len(seen)} input-buffer sums, not 1")
        self._last_reference = seen[0]

    def watch(self, loss: torch.Tensor, calibrating: bool = False) -> None:
        """Hook every node of `loss`'s graph; call before its backward, `release` after."""
        if self._last_reference is None and not calibrating:
            raise RuntimeError("InputBufferSums.calibrate() first")
        handles = []
        self._handles.append(handles)
        roots = [t.grad_fn for t in (loss if isinstance(loss, (list, tuple)) else [loss])
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        for root in roots:
            for node in graph_nodes(root):
                if type(node).__name__ == "AccumulateGrad" or id(node) in seen:
                    continue  # a leaf's node has no outputs: nothing follows its apply
                seen.add(id(node))
                handles.append(node.register_hook(self._post_hook(node)))

    def _post_hook(self, node):
        def finished(grad_inputs, grad_outputs) -> None:
            self._finished = node
        return finished

    def release(self) -> None:
        """Let go of the hooks of the graph watched last."""
        for handle in self._handles.pop() if self._handles else ():
            handle.remove()
        if not self._handles:
            self._finished = None

    def is_buffer_sum(self, func) -> bool:
        """`func`, dispatched now, is the engine summing a node's output into a buffer."""
        return (func is ADD and self._finished is not None
                and torch._C._current_autograd_node() is self._finished)

    def in_place(self, old: torch.Tensor, new: torch.Tensor) -> bool:
        """`can_accumulate_inplace(old)` as a real run decides it (input_buffer.cpp)."""
        in_place = (not torch.is_grad_enabled() and old.layout is torch.strided and not old.is_nested
                    and old.shape == new.shape and old.dtype == new.dtype
                    and is_non_overlapping_and_dense_or_false(old) and _use_counts(old) == self._last_reference)
        if in_place:
            self.sums_in_place += 1
        else:
            self.sums_out_of_place += 1
        return in_place


@contextlib.contextmanager
def watching_backward(sums: InputBufferSums):
    """Inside, every `torch.autograd.backward` (what `loss.backward()`, accelerate's and the
    Trainer's backward, and a reentrant checkpoint's inner backward call) watches its graph
    with `sums` for as long as it runs."""
    original = torch.autograd.backward

    def backward(tensors, *args, **kwargs):
        sums.watch(tensors)
        try:
            return original(tensors, *args, **kwargs)
        finally:
            sums.release()

    torch.autograd.backward = backward
    try:
        yield sums
    finally:
        torch.autograd.backward = original
