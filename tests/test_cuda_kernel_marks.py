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
