"""The fused attention backwards' scratch (planner.attention_scratch): its sizes against the
H200's records and flash_api.cpp, the backend a plan's GPU and build take, the probe's marks
and where the replay makes the scratch."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from planner import attention_scratch as scratch
from planner.attention_scratch import AttentionBackward, CudaBuild
from planner.cuda_allocator import FREE
from planner.errors import PlannerInputError
from planner.kernel_target import KernelTarget
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.probe.table import poly_value
from planner.reserved import training_events
from planner.scenario import scenario_from_values

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "benchmarks" / "results" / "gpu_runs"
LLAMA = json.loads((Path(__file__).parent / "configs" / "tiny-llama.json").read_text())


def _call(batch, heads_q, heads_kv, seq, head_dim, backend=scratch.FLASH, eligible=True) -> AttentionBackward:
    return AttentionBackward(backend, eligible, batch, heads_q, heads_kv, seq, seq, head_dim, head_dim, 2)


def _requests_of(trace_name: str) -> list[int]:
    found = sorted(TRACES.glob(f"*/traces/{trace_name}.json.gz"))
    events = json.loads(gzip.open(found[-1], "rt").read())["events"]
    return [size for action, _, size, _ in events if action == "alloc"]


# (record, its model's attention at 4 x 512 tokens: heads, key/value heads, head size, layers):
# the cuDNN workspace is one request per layer per backward (three steps recorded), each the
# size the frontend's graph gives.
RECORDED = [("gpt2-lora-bf16", 12, 12, 64, 12, 6_390_016),
            ("smollm2-adamw-bf16-exp", 15, 5, 64, 32, 15_851_776),
            ("llama-3.2-1b-adamw8bit-bf16-ckpt-exp", 32, 8, 64, 16, 33_816_832)]


@pytest.mark.parametrize("record, heads_q, heads_kv, head_dim, layers, recorded", RECORDED)
def test_the_cudnn_workspace_is_the_size_the_h200_recorded(record, heads_q, heads_kv, head_dim, layers, recorded):
    size = scratch.cudnn_workspace_bytes(_call(4, heads_q, heads_kv, 512, head_dim), scratch.CUDNN_REFERENCE)
    assert size == recorded
    assert _requests_of(record).count(size) == 3 * layers  # three steps, one per layer


# (record, batch, heads, sequence, layers; the product of delta and the workspace the H200 recorded,
# fp32, 64-wide heads): one of each per layer per backward, three steps recorded.
EFFICIENT_RECORDED = [("distilbert-adam8bit-exp", 8, 12, 128, 6, 3_145_728, 3_148_800),
                      ("bert-base-adamw", 16, 12, 256, 12, 12_582_912, 12_595_200)]


@pytest.mark.parametrize("record, batch, heads, seq, layers, product, workspace", EFFICIENT_RECORDED)
def test_the_memory_efficient_fp32_scratch_is_the_size_the_h200_recorded(record, batch, heads, seq, layers,
                                                                         product, workspace):
    call = AttentionBackward(scratch.EFFICIENT, False, batch, heads, heads, seq, seq, 64, 64, 4)
    sizes = scratch.efficient_scratch_bytes(call)
    assert sizes == [product, batch * seq * heads * 4, batch * heads * seq * 4, workspace]
    assert _requests_of(record).count(workspace) == 3 * layers


@pytest.mark.parametrize("element_bytes, head_dim", [(2, 64), (4, 128), (4, 32)])
def test_memory_efficient_scratch_is_not_made_where_it_is_not_modelled(element_bytes, head_dim):
    # 16-bit types (the kernel computes delta; its accumulators depend on the kernel and the GPU)
    # and other head sizes (another kernel's tiles): none made rather than a guess.
    call = AttentionBackward(scratch.EFFICIENT, False, 8, 12, 12, 128, 128, head_dim, head_dim, element_bytes)
    assert scratch.efficient_scratch_bytes(call) == []


def test_cudnn_before_9_16_adds_its_padding_workaround_where_keys_are_not_a_multiple_of_128():
    call = _call(4, 12, 12, 500, 64)
    new, old = CudaBuild(91900, 13000), CudaBuild(91500, 12080)
    assert scratch.cudnn_workspace_bytes(call, old) - scratch.cudnn_workspace_bytes(call, new) == 4 * 8
    aligned = _call(4, 12, 12, 512, 64)
    assert scratch.cudnn_workspace_bytes(aligned, old) == scratch.cudnn_workspace_bytes(aligned, new)


@pytest.mark.parametrize("seq, head_dim, rows, rounded_dim", [(512, 64, 512, 64), (100, 64, 128, 64),
                                                              (129, 80, 256, 96), (64, 160, 128, 192),
                                                              (64, 100, 128, 128)])
def test_flash_scratch_follows_mha_bwd(seq, head_dim, rows, rounded_dim):
    """softmax_d (b, h, ceil128(s)) and dq_accum (b, ceil128(s), h, d_r) in fp32, d padded to 8 and
    rounded to 32 (64 above 128); without grouped-query attention nothing else."""
    b, h = 3, 6
    assert scratch.flash_scratch_bytes(_call(b, h, h, seq, head_dim)) == [b * h * rows * 4, b * rows * h * rounded_dim * 4]


def test_flash_scratch_expands_grouped_key_and_value_gradients_to_every_head():
    call = _call(2, 8, 2, 300, 64)
    assert scratch.flash_scratch_bytes(call)[2:] == [2 * 300 * 8 * 64 * 2] * 2


def test_flash_frees_its_locals_in_reverse_then_softmax_d():
    events = scratch.scratch_events("out", _call(2, 8, 2, 300, 64), scratch.FLASH, scratch.DEFAULT_BUILD)
    keys = [key[2] for key, _ in events]
    assert keys == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [n == FREE for _, n in events] == [False] * 4 + [True] * 4


@pytest.mark.parametrize("capability, build, expected", [
    ((9, 0), CudaBuild(91900, 13000), scratch.CUDNN),  # the H200 check's build: cuDNN preferred
    ((9, 0), CudaBuild(91002, 12080), scratch.FLASH),  # torch's CUDA 12.8 wheels: 9.10.2, not preferred
    ((9, 0), CudaBuild(91501, 12080), scratch.CUDNN),  # after 9.15.0
    ((10, 0), CudaBuild(91900, 12080), scratch.CUDNN),
    ((10, 1), CudaBuild(91900, 12080), scratch.FLASH),  # a CUDA 12 build: minors 0 and 3 only
    ((10, 1), CudaBuild(91900, 13000), scratch.CUDNN),
    ((8, 0), CudaBuild(91900, 13000), scratch.FLASH),  # never preferred on Ampere
    ((8, 9), CudaBuild(91900, 13000), scratch.FLASH),
])
def test_the_backend_follows_check_prefer_cudnn_attention(capability, build, expected):
    assert scratch.replay_backend(_call(4, 8, 8, 512, 64), capability, build) == expected


def test_a_call_cudnn_refuses_keeps_the_probes_backend_and_an_unknown_gpu_the_larger_scratch():
    refused = _call(4, 8, 8, 512, 64, eligible=False)
    assert scratch.replay_backend(refused, (9, 0), CudaBuild(91900, 13000)) == scratch.FLASH
    grouped = _call(4, 8, 2, 512, 64)  # cuDNN's full-head dK and dV in one request: larger than flash's
    assert scratch.cudnn_workspace_bytes(grouped, scratch.DEFAULT_BUILD) > sum(scratch.flash_scratch_bytes(grouped))
    assert scratch.replay_backend(grouped, None) == scratch.CUDNN
    plain = _call(4, 8, 8, 512, 64)  # the same bytes but cuDNN's own 256
    assert scratch.replay_backend(plain, None) == scratch.CUDNN
    padded = _call(4, 8, 8, 300, 64)  # flash's rows rounded to 384
    assert scratch.replay_backend(padded, None) == scratch.FLASH


@pytest.mark.parametrize("bad", ["9.19", 91900.0, True, 12, -1])
def test_a_bad_cudnn_version_is_one_line(bad):
    with pytest.raises(PlannerInputError, match="cudnn_version must be an integer"):
        scratch.cuda_build_from(bad)


def _probe(config: dict, **values):
    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=64, device="cuda", **values)
    shape = model_shape_for_config(dict(config), scenario.task, scenario.num_labels, "tiny-llama")
    return shape, scenario, cache._compute(shape, scenario, cache.technique_key(shape, scenario))


@pytest.fixture(scope="module")
def llama_bf16():
    return _probe(LLAMA, precision="bf16-mixed")


def test_the_probe_marks_each_attention_backward_with_its_dimensions(llama_bf16):
    shape, scenario, table = llama_bf16
    marks = table.trace.attention_backwards
    allocated = {index for events in table.trace.events.values() for index, sign, _ in events if sign > 0}
    recorded = [mark for mark in marks if mark[0] in allocated]
    assert recorded and len(recorded) % len(set(table.stands_for)) == 0  # each probed block, each micro-batch
    head_dim = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    for index, backend, eligible, dims, element in recorded:
        values = [poly_value(d, 3, 100) for d in dims]
        assert values == [3, LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"], 100, 100, head_dim, head_dim]
        assert (backend, eligible, element) == (scratch.FLASH, True, 2)  # sm80 takes flash; cuDNN could


def test_attention_dropout_cudnn_cannot_take_is_marked_so():
    """cuDNN's dropout resolution is 1/16 (sdp_utils.cpp check_cudnn_dropout): 0.1 is refused."""
    _, _, table = _probe({**LLAMA, "attention_dropout": 0.1}, precision="bf16-mixed")
    assert table.trace.attention_backwards
    assert not any(eligible for _, _, eligible, _, _ in table.trace.attention_backwards)


@pytest.mark.parametrize("hidden_size, modelled", [(256, True), (128, False)])
def test_an_fp32_step_marks_memory_efficient_backwards_and_replays_their_scratch_where_modelled(hidden_size,
                                                                                               modelled):
    # Without grouped-query attention (which torch 2.13's memory-efficient kernel refuses in fp32);
    # four heads of 64 (modelled) or of 32 (not).
    config = {**LLAMA, "hidden_size": hidden_size, "num_key_value_heads": LLAMA["num_attention_heads"]}
    shape, scenario, table = _probe(config, precision="fp32", attn="sdpa")
    backends = {backend for _, backend, _, _, _ in table.trace.attention_backwards}
    assert backends == {scratch.EFFICIENT}
    assert not any(eligible for _, _, eligible, _, _ in table.trace.attention_backwards)  # cuDNN: 16-bit only
    prefix, step = training_events(shape, scenario, table, step_temporaries_bytes=0)
    events = prefix + step
    made = [position for position, (key, _) in enumerate(events)
            if isinstance(key, tuple) and key[0] == "attention-scratch"]
    if not modelled:
        assert made == []
        return
    b, s, h = scenario.batch_size, scenario.seq_len, LLAMA["num_attention_heads"]
    product, total, delta = b * s * h * 64 * 4, b * s * h * 4, b * h * s * 4
    workspace = b * h * (-(-s // 64)) * (64 * 64 + 4) * 4
    assert len(made) % 8 == 0 and made
    for start in made[::8]:
        # Right after the backward's last output: delta's product, sum and delta, the two
        # temporaries freed, then the workspace, and at return the workspace and delta.
        owner = events[start][0][1]
        assert events[start - 1] == (owner, events[start - 1][1]) and events[start - 1][1] != FREE
        run = [(key[2], nbytes) for key, nbytes in events[start:start + 8]]
        assert run == [(0, product), (1, total), (2, delta), (1, FREE), (0, FREE), (3, workspace), (3, FREE),
                       (2, FREE)]


@pytest.mark.parametrize("target, sizes", [
    (KernelTarget((9, 0), CudaBuild(91900, 13000)), "cudnn"),
    (KernelTarget((9, 0)), "flash"),
    (KernelTarget((8, 0), CudaBuild(91900, 13000)), "flash"),
])
def test_the_replay_makes_the_scratch_right_after_each_backwards_last_output(llama_bf16, target, sizes):
    shape, scenario, table = llama_bf16
    prefix, step = training_events(shape, scenario, table, step_temporaries_bytes=0, kernels=target)
    marks = {index: (backend, eligible, dims, element)
             for index, backend, eligible, dims, element in table.trace.attention_backwards}
    events = prefix + step
    seen = 0
    for position, (key, nbytes) in enumerate(events):
        if nbytes == FREE or not (isinstance(key, tuple) and len(key) == 2 and key[0] in marks):
            continue
        backend, eligible, dims, element = marks[key[0]]
        call = AttentionBackward(backend, eligible, *(poly_value(d, scenario.batch_size, scenario.seq_len)
                                                      for d in dims), element)
        expected = (scratch.scratch_sizes(call, scratch.CUDNN, target.build) if sizes == "cudnn"
                    else scratch.flash_scratch_bytes(call))
        made = events[position + 1:position + 1 + 2 * len(expected)]
        assert [n for _, n in made[:len(expected)]] == expected
        assert all(n == FREE for _, n in made[len(expected):])
        assert all(k[0] == "attention-scratch" and k[1] == key for k, _ in made)
        seen += 1
    assert seen >= scenario.grad_accum_steps * len(table.stands_for)
