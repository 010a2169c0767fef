"""What a CUDA probe marks for the allocator's replay, and where the replay puts it
(planner.probe.recorder, planner.reserved).

- The storages a cuBLAS routine made: every matmul's output (tiny GPT-2: Conv1D's addmm, the
  LM head's mm, their backward mms), none on a CPU probe. The replay allocates the main
  thread's workspace right after the first of them in the first forward and the autograd
  thread's right after the first in the first backward, once (torch keeps them).
- Column reductions: a bias's gradient is `sum_to` over the b·s tokens of a (b·s, n) gradient,
  so its rows are b·s and its columns the bias's width, for each of GPT-2's four biases per
  block (c_attn 3h, c_proj h, c_fc 4h, mlp's c_proj h).
- The replay's reduction workspace and semaphores are planner.cuda_reduction's for those rows
  and columns, allocated after the reduction's output and freed at once.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from planner.cuda_allocator import FREE
from planner.cuda_reduction import largest_column_reduction_requests
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.probe.table import poly_value
from planner.probe.trace import expand
from planner.reserved import training_events
from planner.scenario import scenario_from_values

CONFIG = json.loads((Path(__file__).parent / "configs" / "tiny-gpt2.json").read_text())
HIDDEN = CONFIG["n_embd"]
WORKSPACES = (32 * 2**20, 32 * 2**20)
RECORDED_MICRO_BATCHES = 2  # planner.probe.run: the first of an accumulation cycle and a later one


@pytest.fixture(scope="module")
def probed():
    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=64, device="cuda")
    shape = model_shape_for_config(dict(CONFIG), scenario.task, scenario.num_labels, "tiny-gpt2")
    table = cache._compute(shape, scenario, cache.technique_key(shape, scenario))
    cache._MEMORY[(cache.config_digest(shape), cache.technique_key(shape, scenario))] = table
    return shape, scenario, table


def test_a_cuda_probe_marks_cublas_outputs_and_bias_gradient_reductions(probed):
    shape, scenario, table = probed
    trace = table.trace
    assert len(trace.cublas) >= 4 * 2  # each block's four matmuls, forward and backward at least
    blocks = len(set(table.stands_for)) * RECORDED_MICRO_BATCHES
    # Marks cover every storage the tracker saw, the unrecorded previous step's too: count those
    # the recorded step allocates.
    allocated = {index for events in trace.events.values() for index, sign, _ in events if sign > 0}
    widths = Counter(poly_value(cols, 1, 1) for index, rows, cols, _ in trace.column_reductions
                     if rows == ((1, 1, 1),) and index in allocated)  # rows = b·s
    per_block = Counter({3 * HIDDEN: 1, HIDDEN: 2, 4 * HIDDEN: 1})
    assert widths == Counter({width: count * blocks for width, count in per_block.items()})


def test_a_cpu_probe_marks_nothing():
    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=64, device="cpu")
    shape = model_shape_for_config(dict(CONFIG), scenario.task, scenario.num_labels, "tiny-gpt2")
    trace = cache._compute(shape, scenario, cache.technique_key(shape, scenario)).trace
    assert trace.cublas == () and trace.column_reductions == ()


def test_the_replay_puts_each_workspace_after_its_threads_first_cublas_output(probed):
    shape, scenario, table = probed
    prefix, step = training_events(shape, scenario, table, step_temporaries_bytes=0, cublas_workspaces=WORKSPACES)
    assert not any(key[0] == "cublas-workspace" for key, _ in step)  # made once, in the first step
    expansion = expand(table, scenario.batch_size, scenario.seq_len, 1)
    cublas = set(table.trace.cublas)
    first = {}
    for span in expansion.spans:
        first[span.backward] = next(key for key, nbytes in expansion.events[span.start:span.stop]
                                    if nbytes != FREE and key[0] in cublas)
    keys = [key for key, _ in prefix]
    for thread, backward in ((0, False), (1, True)):
        at = keys.index(("cublas-workspace", thread))
        assert keys[at - 1] == first[backward] and prefix[at][1] == WORKSPACES[thread]


def test_each_reduction_takes_its_workspace_for_its_launch(probed):
    shape, probed_scenario, table = probed
    # The table holds any b and s: at 4 x 256 tokens the bias reductions go global (at 4 x 64
    # each warp still takes its own columns).
    scenario = dataclasses.replace(probed_scenario, seq_len=256)
    _, step = training_events(shape, scenario, table, step_temporaries_bytes=0, cublas_workspaces=WORKSPACES)
    reductions = {index: (rows, cols, accumulator) for index, rows, cols, accumulator in table.trace.column_reductions}
    checked = 0
    for position, (key, nbytes) in enumerate(step):
        if nbytes == FREE or not isinstance(key[0], int) or key[0] not in reductions:
            continue
        rows, cols, accumulator = reductions[key[0]]
        b, s = scenario.batch_size, scenario.seq_len
        workspace, semaphores = largest_column_reduction_requests((poly_value(rows, b, s), poly_value(cols, b, s)),
                                                                  accumulator)
        if not workspace:
            continue
        assert step[position + 1:position + 5] == [
            (("reduction-workspace", key), workspace), (("reduction-semaphores", key), semaphores),
            (("reduction-semaphores", key), FREE), (("reduction-workspace", key), FREE)]
        checked += 1
    assert checked and checked % (len(set(table.stands_for)) * 4) == 0  # every bias of every block, per step


def test_a_reduction_of_a_transposed_tensor_over_its_slower_dimensions_is_a_column_reduction():
    """TensorIterator orders a reduction's dimensions by stride: a (b, s, h, d) gradient laid out
    as (b, h, s, d) (it came through a transpose) reduced over b, s and h is b·s·h rows of d
    columns, as a contiguous one is; reducing the fastest dimension, or a layout with gaps, is not."""
    import torch

    from planner.probe.recorder import column_reduction_shape

    total = torch.ops.aten.sum.dim_IntList
    transposed = torch.randn(2, 16, 5, 8).transpose(1, 2)
    assert column_reduction_shape(total, (transposed * transposed, [0, 1, 2], True), {}) == (2 * 5 * 16, 8, 4)
    assert column_reduction_shape(total, (torch.randn(6, 7, 8), [0, 1]), {}) == (42, 8, 4)
    assert column_reduction_shape(total, (torch.randn(6, 8).t(), [0]), {}) is None  # the stride-1 dimension
    assert column_reduction_shape(total, (torch.randn(6, 7, 8)[:, :, :4], [0, 1]), {}) is None  # not dense
    assert column_reduction_shape(total, (torch.randn(6, 7, 8), [0, 2]), {}) is None
    assert column_reduction_shape(total, (torch.randn(6, 7, 8), [2]), {}) is None


def test_per_head_norm_weight_gradients_are_marked():
    """Qwen3's q_norm and k_norm (RMSNorm over the head size, before the transpose to heads
    first): their weights' gradients reduce b·s·h rows of head-size columns (on the H200 the
    k_norm's took a 64 MiB workspace: tests/test_gpu_traces.py)."""
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": True}
    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=64, device="cuda", precision="bf16-mixed")
    shape = model_shape_for_config(dict(config), scenario.task, scenario.num_labels, "tiny-qwen3")
    table = cache._compute(shape, scenario, cache.technique_key(shape, scenario))
    found = Counter((poly_value(rows, 3, 10), poly_value(cols, 3, 10))
                    for _, rows, cols, _ in table.trace.column_reductions)
    assert found[(3 * 10 * 4, 16)] and found[(3 * 10 * 2, 16)]  # q_norm over 4 heads, k_norm over 2
