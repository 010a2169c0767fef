"""torch's MemTracker, able to track a model with frozen parameters.

MemTracker (torch.distributed._tools.mem_tracker, torch 2.13) installs a gradient hook on
every parameter of every module it enters (`_track_module_params_and_buffers`), and
`Tensor.register_hook` raises on a tensor that does not require a gradient, so a LoRA
model (a frozen base) cannot be tracked at all. `TrainableMemTracker` keeps all of its
accounting and installs the same two hooks (gradient, and after accumulation) on the
parameters that require a gradient only: a frozen parameter never has one to count.
It also counts the quantisation state of bitsandbytes' 4-bit weights (QLoRA) as weights:
`Params4bit.quant_state` holds absmax, code and, with double quantisation, the nested
absmax, its code and an offset, tensors that are neither parameters nor buffers, so
MemTracker would never see them although they are live for the whole run (21,056 B on
tests/configs/tiny-llama.json, nf4 with double quantisation).
It also lets go of the gradient hooks MemTracker's module tracker leaves behind. ModTracker's
pre-forward hook registers `register_multi_grad_hook(inputs, ...)` on every module input that
requires a gradient and drops the handle; each such hook's closure holds its tensors' autograd
nodes, and the node holds the hook: a cycle through C++ that Python's collector cannot free.
Usually the nodes it keeps hold nothing after backward, but when a graph reaches a leaf that
is an activation (`enable_input_require_grads`, which PEFT and transformers apply with
checkpointing, makes the embedding output a leaf requiring a gradient) the leaf and its
accumulated `.grad` stay alive: 2 x (b, s, h) of the previous micro-batch counted at the next
one's peak, which a real run (no tracker) frees (found on GPT-2 with LoRA and checkpointing:
the Trainer run measured 122,896 B above a plain Trainer run). The handles are kept and
removed before the next micro-batch (`reset_mod_stats`, after the previous backward has run
its hooks), when the caller says a backward has ended (`release_grad_hooks`: the verification
runs, before the optimizer step) and when tracking ends.
Those hooks are also made not to keep what they are given. In its "all" mode (the pre-forward
hook's), torch's `register_multi_grad_hook` buffers each input's gradient until every input has
one, then hands the list to ModTracker's pop function, which does not read it. A module whose
inputs' gradients arrive at different times keeps the first ones alive: `BertOutput(hidden_states,
input_tensor)` holds the FFN activation's (b, s, 4h) gradient through the FFN's first linear's
backward, until the residual's gradient is complete; a real run (no tracker) has freed it
(BERT-base on an H200 measured 0.82% below the probe: benchmarks/results/gpu_runs/2026-12-04-e,
large request 344 of its record). `count_only_multi_grad_hook` calls the same function at the
same moment with `None` for each gradient, keeping none.
On CUDA's kernels (`cuda_path`, a calibrated planner.probe.accumulation.InputBufferSums: a
CUDA probe, a simulated CUDA step) the tracked step takes CUDA's path where torch's fake and
CPU kernels take another:
- the autograd engine's input-buffer sums are made in place where a real run makes them
  (planner.probe.accumulation; the CPU runs measured with MemTracker keep the out-of-place
  path that the tracker itself imposes, and so do the CPU tables);
- softmax's backward (aten/src/ATen/native/cuda/SoftMax.cu, `softmax_backward_cuda_out`)
  computes `Tensor tmp = grad * output;` after allocating its output and frees it on return:
  one (b, h, s, s) temporary per eager-attention layer in backward (GPT-2 on an H200,
  benchmarks/results/gpu_runs/2026-12-04-d/traces);
- the dropout kernel (aten/src/ATen/native/cuda/Dropout.cu, `dropout`) allocates its bool
  mask before its output, where the meta kernel returns the output first: the mask's storage
  is made first.
Known limitation: per-module peaks (MemTracker's `memory_tracking`) are not kept; the
overall peak is.
The probe's recorder, its step probe and the verification runs all measure with it.
"""

from __future__ import annotations

import threading
from copy import deepcopy

import torch
from torch.autograd.graph import _get_grad_fn_or_grad_acc
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from planner.probe.accumulation import ADD_IN_PLACE, InputBufferSums

_aten = torch.ops.aten
SOFTMAX_BACKWARD = _aten._softmax_backward_data.default
NATIVE_DROPOUT = _aten.native_dropout.default


class TrainableMemTracker(MemTracker):
    def __init__(self, cuda_path: InputBufferSums | None = None) -> None:
        super().__init__()
        self.cuda_path = cuda_path  # CUDA's kernel path (module doc), or None
        self._grad_hook_handles: list = []  # ModTracker's multi-grad hooks (module doc)
        self._register_multi_grad_hook = None  # torch's, while ours stands in for it

    def __enter__(self):
        if self._depth == 0:
            torch_register = mod_tracker.register_multi_grad_hook

            def register_keeping_the_handle(tensors, fn, *, mode="all"):
                if mode == "all":
                    handle = count_only_multi_grad_hook(tensors, fn)
                else:
                    handle = torch_register(tensors, fn, mode=mode)
                self._grad_hook_handles.append(handle)
                return handle

            self._register_multi_grad_hook = torch_register
            mod_tracker.register_multi_grad_hook = register_keeping_the_handle
        return super().__enter__()

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        if self._depth == 0 and self._register_multi_grad_hook is not None:
            mod_tracker.register_multi_grad_hook = self._register_multi_grad_hook
            self._register_multi_grad_hook = None
            self.release_grad_hooks()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        sums = self.cuda_path
        if sums is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if sums.is_buffer_sum(func) and sums.in_place(args[0], args[1]):
            result = super().__torch_dispatch__(ADD_IN_PLACE, types, args, kwargs)
            torch.autograd.graph.increment_version(result)  # as the real add_ does
            return result
        if func is NATIVE_DROPOUT:
            def mask_first(*a, **k):
                output, mask = func(*a, **k)
                return mask, output
            mask, output = super().__torch_dispatch__(mask_first, types, args, kwargs)
            return output, mask
        if func is SOFTMAX_BACKWARD:
            result = super().__torch_dispatch__(func, types, args, kwargs)
            scratch = super().__torch_dispatch__(_aten.mul.Tensor, types, (args[0], args[1]), {})
            del scratch  # CUDA's `tmp = grad * output`, freed when the kernel returns (module doc)
            return result
        return self._dispatch_on_cuda(func, types, args, kwargs)

    def _dispatch_on_cuda(self, func, types, args, kwargs):
        """Any other op on CUDA's path (a subclass marks what it makes)."""
        return super().__torch_dispatch__(func, types, args, kwargs)

    def reset_mod_stats(self) -> None:
        super().reset_mod_stats()
        self.release_grad_hooks()  # the previous micro-batch's backward has run them

    def release_grad_hooks(self) -> None:
        """Remove the module tracker's gradient hooks; call only when no backward is pending
        that needs them (they pop the modules backward has left)."""
        for handle in self._grad_hook_handles:
            handle.remove()
        self._grad_hook_handles.clear()

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        for tensor in quantization_state_tensors(module):
            self._update_and_maybe_create_winfos(tensor, _MemRefType.PARAM)
        if install_grad_hooks:
            for parameter in module.parameters():
                if parameter.requires_grad and self._param_to_grad_hook_handles.get(parameter) is None:
                    self._param_to_grad_hook_handles[parameter] = (
                        parameter.register_hook(self._count_gradient),
                        parameter.register_post_accumulate_grad_hook(lambda p: self._count_gradient(p.grad)),
                    )
        return memory

    def _update_peak_stats(self, peak_state) -> None:
        # The overall peak only, as MemTracker keeps it: its per-module peaks (a walk over every
        # module it has entered, at every op) are read by nothing here and cost most of a
        # LoRA/QLoRA step's tracking time (a PEFT model has several modules per linear).
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = deepcopy(snapshot)

    def _count_gradient(self, grad) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)


class _Handles:
    """Removes a group of tensor hooks together (what torch's multi-grad hook returns)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def count_only_multi_grad_hook(tensors, fn) -> _Handles:
    """torch.autograd.graph.register_multi_grad_hook's "all" mode without its gradient buffer:
    `fn` runs once per backward, when the last of `tensors` that this backward reaches has its
    gradient, and is given `None` for each (module doc). The number of gradients to wait for is
    counted as torch does, on the first gradient of each backward (graph task): the nodes of
    `tensors` the engine will execute."""
    nodes = [_get_grad_fn_or_grad_acc(tensor) for tensor in tensors]
    received: dict[int, int] = {}
    expected: dict[int, int] = {}
    lock = threading.Lock()

    def count(_grad) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in received:
                received[task] = 0
                expected[task] = sum(map(torch._C._will_engine_execute_node, nodes))
            received[task] += 1
            complete = received[task] == expected[task]
            if complete:
                del received[task], expected[task]
        if complete:
            fn([None] * len(nodes))

    return _Handles([tensor.register_hook(count) for tensor in tensors])


def quantization_state_tensors(module) -> list:
    """Every tensor of the quantisation state of `module`'s 4-bit parameters (bitsandbytes
    QuantState: absmax, code; nested: offset, state2.absmax, state2.code)."""
    tensors = []
    for parameter in module.parameters():
        state = getattr(parameter, "quant_state", None)
        if state is None:
            continue
        tensors += [state.absmax, state.code]
        if state.nested:
            tensors += [state.offset, state.state2.absmax, state.state2.code]
    return tensors
