"""CUDA's embedding backward beside its output (planner.embedding_scratch, planner.cub_temporaries),
against the caching allocator's own record of real runs on an H200 (torch 2.11.0+cu130,
benchmarks/results/gpu_runs/2026-12-04-e/traces), every request, small ones included, and in the
probe's marks and the allocator's replay (planner.probe.recorder, planner.reserved).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from planner import cub_temporaries as cub
from planner.cuda_allocator import FREE
from planner.embedding_scratch import EmbeddingBackward, scratch_events, uses_fused_pass
from planner.gpus import GPUS
from planner.kernel_target import KernelTarget
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.probe.table import poly_value
from planner.reserved import training_events
from planner.scenario import scenario_from_values

TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_runs"
H200 = GPUS["h200"]
RECORD_CUDA = 13000  # torch 2.11.0+cu130: CUDA 13.0, whose CCCL is 3.0


def _recorded(scenario_id: str) -> list[tuple[str, int]]:
    """('a' or 'f', bytes) of every allocation and completed free of a record, in order."""
    path = sorted(TRACES.glob(f"*/traces/{scenario_id}.json.gz"))[-1]
    events = json.loads(gzip.open(path, "rt").read())["events"]
    return [(action[0], size) for action, _, size, _ in events if action in ("alloc", "free_completed")]


def _planned(call: EmbeddingBackward, output_bytes: int) -> list[tuple[str, int]]:
    before, after = scratch_events("output", call, H200.compute_capability, H200.multiprocessors,
                                   RECORD_CUDA)
    sizes, out = {}, []
    for key, nbytes in before + [("output", output_bytes)] + after:
        if nbytes == FREE:
            out.append(("f", sizes.pop(key)))
        else:
            sizes[key] = nbytes
            out.append(("a", nbytes))
    assert list(sizes) == ["output"]  # all scratch freed, the output kept
    return out


def _occurrences(recorded: list, planned: list) -> int:
    return sum(recorded[i:i + len(planned)] == planned for i in range(len(recorded) - len(planned) + 1))


# (record, call as the run made it, its output's bytes, the path torch took)
RECORDED_CALLS = [
    # BERT-base masked LM at 16 x 256, fp32: the word embeddings, two passes.
    ("bert-base-adamw", EmbeddingBackward(16 * 256, 30522, 768, 4, 8, True, True, False), 30522 * 768 * 4, "two"),
    # Its token types: the ids are an expanded buffer (copied contiguous first), 2 rows: fused.
    ("bert-base-adamw", EmbeddingBackward(16 * 256, 2, 768, 4, 8, False, True, False), 2 * 768 * 4, "fused"),
    # Qwen3-0.6B at 8 x 1,024 under bf16 autocast: the fp32 embedding's gradient, two passes.
    ("qwen3-0.6b-adamw-bf16-ckpt-exp", EmbeddingBackward(8 * 1024, 151936, 1024, 4, 8, True, True, False),
     151936 * 1024 * 4, "two"),
]


@pytest.mark.parametrize("scenario_id, call, output_bytes, path", RECORDED_CALLS)
def test_every_request_of_the_embedding_backward_is_the_h200s(scenario_id, call, output_bytes, path):
    """The planner's sequence (the copies, the sort with CUB's temporaries, the output, the
    segments, the partial sums or the fused pass, the frees in C++'s order) appears in the
    record as it is, once per step the run took (3), every size to the byte."""
    assert uses_fused_pass(call, H200.multiprocessors) == (path == "fused")
    planned = _planned(call, output_bytes)
    assert len(planned) >= 29  # 14 requests and their frees, and the output
    assert _occurrences(_recorded(scenario_id), planned) == 3


def test_cub_temporaries_are_the_h200s():
    """Radix sort 83,455 B (4,096 items) and 150,015 B (8,192), unique by key and exclusive sum
    1,279 B each, as the records hold them; one 256-digit lookback more per onesweep tile."""
    sm90 = (9, 0)
    assert [cub.radix_sort_pairs_bytes(n, 8, sm90) for n in (4096, 8192)] == [83455, 150015]
    assert [cub.unique_by_key_bytes(n, sm90, RECORD_CUDA) for n in (4096, 8192)] == [1279, 1279]
    assert [cub.exclusive_sum_bytes(m, RECORD_CUDA) for m in (2, 4096, 8192)] == [1279] * 3
    tile = 384 * 12
    assert cub.radix_sort_pairs_bytes(2 * tile + 1, 8, sm90) - cub.radix_sort_pairs_bytes(2 * tile, 8, sm90) \
        == 2 * 256 + 256 * 4  # one item more: each alternate buffer grows a 256 B block, one more tile
    assert cub.exclusive_sum_bytes(2, 12080) == 1023  # CUDA 12.8's CUB 2.x: no nested alignment


def test_up_to_3072_indices_only_copies_are_made():
    small = EmbeddingBackward(3072, 50000, 512, 2, 8, True, True, False)
    assert scratch_events("o", small, (9, 0), 132, RECORD_CUDA) == ([], [])
    strided = dataclasses.replace(small, indices_contiguous=False, grad_contiguous=False)
    before, after = scratch_events("o", strided, (9, 0), 132, RECORD_CUDA)
    assert [n for _, n in before] == [3072 * 8, 3072 * 512 * 2] and all(n == FREE for _, n in after)
    assert [k for k, _ in after] == [k for k, _ in reversed(before)]
    assert scratch_events("o", dataclasses.replace(small, num_indices=3073), (9, 0), 132, RECORD_CUDA)[1]


def test_the_fused_pass_follows_the_sm_count_and_takes_an_fp32_copy_for_16_bit_gradients():
    """Few rows and many indices: fused below 4 scatter blocks per SM, two passes above; a GPU
    whose SM count is unknown takes the two passes, the larger scratch."""
    call = EmbeddingBackward(65536, 100, 1024, 2, 8, True, True, False)  # 100 rows: 100 scatter blocks
    assert uses_fused_pass(call, 26) and not uses_fused_pass(call, 25) and not uses_fused_pass(call, None)
    _, fused = scratch_events("o", call, (9, 0), 132, RECORD_CUDA)
    _, two = scratch_events("o", call, (9, 0), None, RECORD_CUDA)
    partials = 65536 // 10 + 100
    assert (("embedding-scratch", "o", "grad_weight_acc"), 100 * 1024 * 4) in fused
    assert (("embedding-scratch", "o", "grad_weight_per_segment"), partials * 1024 * 4) in two
    assert max(n for _, n in fused) < max(n for _, n in two)
    fp32 = dataclasses.replace(call, grad_bytes=4)
    assert not any(key[2] == "grad_weight_acc" for key, _ in scratch_events("o", fp32, (9, 0), 132, RECORD_CUDA)[1])


@pytest.fixture(scope="module")
def gpt2_probe():
    config = json.loads((Path(__file__).parent / "configs" / "tiny-gpt2.json").read_text())
    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=64, device="cuda")
    shape = model_shape_for_config(dict(config), scenario.task, scenario.num_labels, "tiny-gpt2")
    return config, shape, scenario, cache._compute(shape, scenario, cache.technique_key(shape, scenario))


def test_a_cuda_probe_marks_each_embedding_backward_with_its_sizes(gpt2_probe):
    """GPT-2's token embedding takes b·s indices into vocab_size rows, its position embedding
    s indices (the gradient summed over the batch first) into n_positions rows, both n_embd wide."""
    config, _, _, table = gpt2_probe
    found = {tuple(poly_value(d, 5, 70) for d in dims) + tuple(kinds) for _, dims, *kinds in
             table.trace.embedding_backwards}
    assert found == {(5 * 70, config["vocab_size"], config["n_embd"], 4, 8, True, True, False),
                     (70, config["n_positions"], config["n_embd"], 4, 8, True, True, False)}


def test_the_replay_makes_the_sort_before_the_output_and_the_segments_after(gpt2_probe):
    _, shape, probed_scenario, table = gpt2_probe
    scenario = dataclasses.replace(probed_scenario, batch_size=64)  # 4,096 tokens: the sorting path
    target = KernelTarget((9, 0), multiprocessors=132)
    _, step = training_events(shape, scenario, table, step_temporaries_bytes=0, kernels=target)
    marks = {index: EmbeddingBackward(*(poly_value(d, 64, 64) for d in dims), *kinds)
             for index, dims, *kinds in table.trace.embedding_backwards}
    sorted_calls = feature_calls = 0
    for position, (key, nbytes) in enumerate(step):
        if nbytes == FREE or not isinstance(key[0], int) or key[0] not in marks:
            continue
        before, after = target.embedding_events(key, marks[key[0]])
        assert step[position - len(before):position] == before
        assert step[position + 1:position + 1 + len(after)] == after
        # the token embedding's 4,096 indices are sorted; the positions' 64 take the feature kernel
        sorted_calls += marks[key[0]].num_indices == 64 * 64 and len(before) == 6 and len(after) == 22
        feature_calls += marks[key[0]].num_indices == 64 and before == after == []
    assert sorted_calls and sorted_calls == feature_calls


def test_a_gpu_spec_refuses_an_sm_count_that_is_not_a_positive_integer():
    for bad in (0, -4, 1.5, True):
        with pytest.raises(ValueError, match="multiprocessors must be a positive integer"):
            dataclasses.replace(H200, multiprocessors=bad)
