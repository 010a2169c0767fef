"""The tracker every probe and every CPU measurement runs under must not keep a gradient alive
longer than the same step without it (planner/probe/memtracker.py, module doc).

The reference is the step run bare: a weak reference to a gradient tells whether it is still
alive when a later backward op starts. The shape is BERT's FFN: `BertOutput(hidden_states,
input_tensor)` gets the FFN activation's gradient first and the residual's only after the FFN's
first linear, whose backward must not see the first one alive.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from planner.probe.memtracker import TrainableMemTracker, count_only_multi_grad_hook


class ResidualOutput(nn.Module):
    """Two inputs whose gradients arrive at different times (BertOutput's signature)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(4 * width, width)

    def forward(self, activation, residual):
        return self.dense(activation) + residual


class FeedForwardBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.into = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.output = ResidualOutput(width)

    def forward(self, x):
        residual = self.into(x)
        activation = torch.nn.functional.gelu(self.up(residual))
        return self.output(activation, residual)


def activation_gradient_alive_at_up_backward(tracker) -> bool:
    """Run one step (under `tracker` when given); whether the FFN activation's gradient is still
    alive when the up-projection's backward starts."""
    torch.manual_seed(0)
    block = FeedForwardBlock(16)
    seen: dict[str, object] = {}
    alive_at_up: list[bool] = []

    def keep_a_weak_reference(module, inputs, _output):
        inputs[0].register_hook(lambda grad: seen.__setitem__("grad", weakref.ref(grad)))

    block.output.register_forward_hook(keep_a_weak_reference)
    block.up.register_full_backward_pre_hook(
        lambda module, grad_output: alive_at_up.append(seen["grad"]() is not None))
    x = torch.randn(4, 8, 16)
    if tracker is None:
        block(x).sum().backward()
    else:
        with tracker:
            block(x).sum().backward()
    assert len(alive_at_up) == 1
    return alive_at_up[0]


def test_the_bare_step_frees_the_activation_gradient_before_the_first_linear():
    # The reference itself: if this failed the test below would prove nothing.
    assert activation_gradient_alive_at_up_backward(None) is False


def test_the_tracker_frees_it_where_the_bare_step_does():
    assert activation_gradient_alive_at_up_backward(TrainableMemTracker()) is False


def test_torch_own_multi_grad_hook_keeps_it_alive():
    """What the count-only hook replaces: torch's "all" mode buffers the gradient (if a torch
    release stops doing this, the replacement is no longer needed)."""
    torch.manual_seed(0)
    first = torch.randn(3, requires_grad=True)
    second = torch.randn(3, requires_grad=True)
    kept: list = []
    a = first * 2
    b = second * 3
    torch.autograd.graph.register_multi_grad_hook(
        (a, b), lambda grads: kept.append([g is not None for g in grads]))
    (a.sum() + b.sum()).backward()
    assert kept == [[True, True]]


@pytest.mark.parametrize("reached", ["both", "one"])
def test_count_only_hook_runs_once_per_backward_when_the_last_gradient_arrives(reached):
    """Called once per backward with a None per tensor, after the last gradient this backward
    reaches (an input not reached is not waited for, as in torch's "all" mode)."""
    first = torch.randn(3, requires_grad=True)
    second = torch.randn(3, requires_grad=True)
    a = first * 2
    b = second * 3
    order: list = []
    a.register_hook(lambda grad: order.append("a"))
    b.register_hook(lambda grad: order.append("b"))
    handle = count_only_multi_grad_hook((a, b), lambda grads: order.append(("fn", list(grads))))
    loss = a.sum() + b.sum() if reached == "both" else a.sum()
    loss.backward(retain_graph=True)
    if reached == "both":
        assert sorted(order[:2]) == ["a", "b"] and order[2:] == [("fn", [None, None])]
    else:
        assert order == ["a", ("fn", [None, None])]
    handle.remove()
    order.clear()
    loss.backward()
    assert ("fn", [None, None]) not in order and order
