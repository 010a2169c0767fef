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
Known limitation: per-module peaks (MemTracker's `memory_tracking`) are not kept; the
overall peak is.
The probe's recorder, its step probe and the verification runs all measure with it.
"""

from __future__ import annotations

from copy import deepcopy

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType


class TrainableMemTracker(MemTracker):
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
