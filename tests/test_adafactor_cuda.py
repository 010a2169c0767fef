"""planner.adafactor_cuda's replay of torch's Adafactor loop against the loop itself.

torch's `_single_tensor_adafactor` is the same Python on CUDA as on the CPU, so the order and
size of the tensors it makes are the CPU's: each allocation and free of a real step on CPU
tensors, logged as it happens, must be `torch_loop_events` less the CUDA reductions' workspaces
(which only CUDA's kernel takes, planner.cuda_reduction). The shapes mix matrices, vectors and a
3-D tensor in orders that put each kind of tensor after each other kind, with distinct sizes so
a swapped or missing request shows."""

import random
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from planner.adafactor_cuda import WORKSPACE_KINDS, event_kind, hf_loop_events, step_peak_bytes, torch_loop_events
from planner.cuda_allocator import FREE
from planner.cuda_reduction import largest_column_reduction_requests
from planner.scenario import Optimizer


class _AllocationLog(TorchDispatchMode):
    """Every storage an op makes, as ("+", bytes), and its release, as ("-", bytes)."""

    def __init__(self, existing: set[int]):
        super().__init__()
        self.log: list[tuple[str, int]] = []
        self._live = set(existing)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                pointer = storage.data_ptr()
                if storage.nbytes() and pointer not in self._live:  # in-place ops return a known storage
                    self._live.add(pointer)
                    self.log.append(("+", storage.nbytes()))
                    weakref.finalize(storage, self._released, pointer, storage.nbytes())
        return out

    def _released(self, pointer: int, nbytes: int) -> None:
        self._live.discard(pointer)
        self.log.append(("-", nbytes))


def _steady_step_log(shapes, dtype) -> list[tuple[str, int]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]
    optimizer = torch.optim.Adafactor(params, lr=1e-2)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()  # the first step makes the state
    existing = {t.untyped_storage().data_ptr() for t in params + [p.grad for p in params]}
    existing |= {t.untyped_storage().data_ptr() for state in optimizer.state.values()
                 for t in state.values() if isinstance(t, torch.Tensor)}
    log = _AllocationLog(existing)
    with log:
        optimizer.step()
    return log.log


def _planned(shapes, param_bytes) -> list[tuple[str, int]]:
    sizes, planned = {}, []
    for key, nbytes in torch_loop_events(shapes, param_bytes):
        if event_kind(key) in WORKSPACE_KINDS:
            continue
        if nbytes == FREE:
            planned.append(("-", sizes.pop(key)))
        else:
            sizes[key] = nbytes
            planned.append(("+", nbytes))
    assert not sizes, "every request is freed by the end of the step"
    return planned


SHAPES = [(50, 16), (16,), (40, 16), (24,), (3, 8, 10), (12,), (7, 9)]


@pytest.mark.parametrize("dtype,param_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_torch_adafactors_loop_makes_and_frees_what_the_replay_says(dtype, param_bytes):
    assert _steady_step_log(SHAPES, dtype) == _planned(SHAPES, param_bytes)


def test_the_order_of_the_parameters_decides_what_the_loop_holds_at_once():
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    shapes = list(SHAPES) + [(64, 48), (5,), (2, 6, 11)]
    random.Random(seed).shuffle(shapes)
    assert _steady_step_log(shapes, torch.float32) == _planned(shapes, 4), f"seed {seed}"


def test_the_live_tensors_exclude_the_workspace_the_allocator_counts():
    # DistilBERT's word embeddings: 28,996 x 768 fp32 take a workspace on any GPU planner.gpus holds.
    shapes = [(28996, 768), (768,), (768, 768)]
    tensors = step_peak_bytes(shapes, 4, Optimizer.ADAFACTOR, workspaces=False)
    allocated = step_peak_bytes(shapes, 4, Optimizer.ADAFACTOR, workspaces=True)
    assert allocated > tensors
    # The embedding's column norm: its row_mean, its output and the workspace with its semaphores.
    from planner.optimizer_state import allocation
    from planner.scenario import Device

    on_cuda = allocation(Device.CUDA)
    workspace, semaphores = largest_column_reduction_requests((28996, 768))
    assert allocated == on_cuda(28996 * 4) + on_cuda(768 * 4) + on_cuda(workspace) + on_cuda(semaphores)
    # Without it, the high point is the vector's `variance.clone()`: the embedding's update is still
    # bound to `update`, with its row_mean and column mean, beside the vector's grad_squared.
    vector = on_cuda(768 * 4)
    assert tensors == on_cuda(28996 * 768 * 4) + on_cuda(28996 * 4) + vector + 2 * vector


def test_a_verdict_that_is_not_replayed_still_counts_the_steps_workspace(monkeypatch):
    """Estimate.step_workspace_bytes: out of the live tensors' phases, into the allocated peak of a
    verdict the allocator is not replayed for (planner.device_fit)."""
    from planner import device_fit
    from planner.estimate import Phase, estimate
    from planner.gpus import gpu_spec
    from planner.loading import load_model_shape
    from planner.scenario import Task, scenario_from_values

    shape = load_model_shape("distilbert-base-cased", Task.SEQUENCE_CLASSIFICATION)
    scenario = scenario_from_values(task="sequence-classification", batch_size=1, seq_len=16, optimizer="adafactor",
                                    precision="fp32", device="cuda")
    result = estimate(shape, scenario)
    step = next(p for p in result.phases if p.phase is Phase.OPTIMIZER_STEP)
    workspace, _ = largest_column_reduction_requests((28996, 768))
    # The word embeddings' column norm (the first tensor: no previous update is bound) with its
    # workspace is the step's high point in the allocator; without it, the embeddings' update.
    assert step.temporaries + result.step_workspace_bytes > workspace > step.temporaries > 0
    h200 = gpu_spec("h200")
    monkeypatch.setattr(device_fit, "replayed_step", lambda *args, **kwargs: "not replayed in this test")
    verdict = device_fit.plan_verdict(shape, result, h200.capacity_bytes, h200)
    assert verdict.reserved_peak_bytes is None and verdict.peak_bytes == result.peak_bytes  # the live tensors
    allocated_step = step.total + result.step_workspace_bytes
    assert allocated_step > result.peak_bytes
    assert verdict.allocated_peak_bytes == allocated_step + verdict.allocator_blocks_bytes
    assert ("Optimizer step's kernel workspaces", allocated_step - result.peak_bytes) in [row[:2] for row in verdict.rows()]
    assert verdict.to_json()["step_workspace_bytes"] == allocated_step - result.peak_bytes


def test_the_replay_leaves_out_only_small_transients_and_keeps_the_large_pools_sequence():
    """planner.reserved._without_small_transients on both loops over DistilBERT's tensors: what it
    drops is small (the small pool's), made and freed with no large request between; every large
    request and free stays, in order; and both loops replayed through the allocator reach the same
    reserved peak with or without them, the allocated peak lower by no more than what it dropped
    could hold at once."""
    from planner.cuda_allocator import K_SMALL_SIZE, CachingAllocator
    from planner.loading import load_model_shape
    from planner.reserved import _without_small_transients
    from planner.scenario import Task

    shapes = [p.shape for p in load_model_shape("distilbert-base-cased", Task.SEQUENCE_CLASSIFICATION).params]
    for events in (torch_loop_events(shapes, 4), hf_loop_events(shapes, 2)):
        kept = _without_small_transients(tuple(events))
        sizes = {key: nbytes for key, nbytes in events if nbytes != FREE}
        dropped = [event for event in events if event not in kept]
        assert dropped and all(sizes[key] <= K_SMALL_SIZE for key, _ in dropped)
        large = [event for event in events if sizes[event[0]] > K_SMALL_SIZE]
        assert [event for event in kept if sizes[event[0]] > K_SMALL_SIZE] == large
        peaks = []
        for replayed in (events, kept):
            allocator = CachingAllocator()
            allocator.replay(replayed)
            peaks.append((allocator.peak_reserved_bytes, allocator.peak_allocated_bytes))
        assert peaks[0][0] == peaks[1][0]
        assert 0 <= peaks[0][1] - peaks[1][1] <= sum(-(-sizes[key] // 512) * 512 for key, n in dropped if n != FREE)
