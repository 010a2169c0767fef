"""The probe's allocation trace (planner.probe.trace) and the steady-state run built on it for
the caching allocator (planner.reserved).

What must hold:
- Exact accounting of the expanded step (allocated = the sum of live bytes) reaches the
  walk's high points to the byte (forward, backward, end), at any batch, sequence and
  accumulation, on probed tiny models deeper than the probe (repeated blocks), with
  checkpointing, bf16-mixed (autocast's weight copies: frees of weight > 1), both loops.
- Every free frees the instance the real step frees (a hand-built probe whose tensors say
  which real layer made them and which frees them).
- The run's exact peak is the estimate's peak; through the allocator model, allocated is
  that peak rounded as the allocator rounds (512 B blocks, and a large block's unsplit tail).
- Allocation order changes reserved memory by what the allocator's rules say.
The probe runs once per module (about 15-20 s here); PLANNER_TRACE_MATRIX=1 adds the other
families, the Trainer's loop and a Gemma-2 with alternating layer types (a few minutes).
"""

import dataclasses
import json
import os

import pytest
from probe_comparison import deep, own_probe_cache  # noqa: F401 (the fixture)

from planner.cuda_allocator import FREE, K_SMALL_SIZE, replay
from planner.estimate import Confidence, estimate
from planner.loading import load_model_shape, model_shape_for_config
from planner.optimizer_state import model_paged_state_bytes, optimizer_state_bytes
from planner.probe import cache
from planner.probe.recorder import Event, Recording
from planner.probe.run import PROBE_SIZES, Layout
from planner.probe.solve import solve
from planner.probe.table import ProbeTable
from planner.probe.trace import TraceError, check_against_walk, expand, step_events
from planner.reserved import model_prefix, reserved_peak, state_events, training_events
from planner.scenario import (
    Device,
    Engine,
    Optimizer,
    Precision,
    Task,
    scenario_from_values,
)

MIB = 2**20
TINY_GEMMA2 = {"model_type": "gemma2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "max_position_embeddings": 256, "sliding_window": 32, "pad_token_id": 0, "bos_token_id": 1,
               "eos_token_id": 2}  # layer_types alternate sliding and full attention: a period of 2

CASES = {
    "llama-x6-bf16-mixed-lessons": (lambda: deep("tiny-llama", 6), dict(precision="bf16-mixed")),
}
MATRIX = {
    "gpt2-x6-bf16-mixed-ckpt-trainer": (lambda: deep("tiny-gpt2", 6),
                                        dict(precision="bf16-mixed", gradient_checkpointing=True, engine="trainer")),
    "opt-x7-bf16-mixed": (lambda: deep("tiny-opt", 7), dict(precision="bf16-mixed")),
    "distilbert-x6-ckpt": (lambda: deep("tiny-distilbert", 6), dict(task="masked-lm", gradient_checkpointing=True)),
    "phi-x6-bf16-mixed-ckpt": (lambda: deep("tiny-phi", 6), dict(precision="bf16-mixed", gradient_checkpointing=True)),
    "neox-x6-ckpt-trainer": (lambda: deep("tiny-neox", 6), dict(gradient_checkpointing=True, engine="trainer")),
    "llama-x7-fp32-ckpt": (lambda: deep("tiny-llama", 7), dict(gradient_checkpointing=True)),
    "llama-x7-bf16-mixed-trainer": (lambda: deep("tiny-llama", 7), dict(precision="bf16-mixed", engine="trainer")),
    "gpt2-x6-fp32": (lambda: deep("tiny-gpt2", 6), {}),
    "gemma2-x8-bf16-mixed": (lambda: dict(TINY_GEMMA2), dict(precision="bf16-mixed", attn="eager")),
    "gemma2-x8-ckpt-trainer": (lambda: dict(TINY_GEMMA2), dict(gradient_checkpointing=True, attn="eager",
                                                               engine="trainer")),
}
if os.environ.get("PLANNER_TRACE_MATRIX"):
    CASES.update(MATRIX)

_PROBED: dict[str, tuple] = {}


def probed(case: str):
    """(shape, scenario, table, step temporaries) of a case, probed once per module; the
    estimate finds them in the probe cache's memory."""
    if case not in _PROBED:
        config, overrides = CASES[case]
        values = dict(task="causal-lm", batch_size=3, seq_len=40, device="cpu")
        values.update(overrides)
        scenario = scenario_from_values(**values)
        shape = model_shape_for_config(config(), scenario.task, scenario.num_labels, "tiny")
        table = cache._compute(shape, scenario, cache.technique_key(shape, scenario))
        from planner.probe.step import step_temporaries

        _PROBED[case] = (shape, scenario, table, step_temporaries(shape, scenario))
    shape, scenario, table, step = _PROBED[case]
    cache._MEMORY[(cache.config_digest(shape), cache.technique_key(shape, scenario))] = table
    cache._MEMORY[(cache.config_digest(shape), cache.step_key(shape, scenario))] = step
    return shape, scenario, table, step


def exact_peak(prefix, step, rounding: int = 1) -> int:
    """The highest sum of live bytes over prefix + two steps, each rounded up to `rounding`."""
    live, total, peak = {}, 0, 0
    for events in (prefix, step, step):
        for key, nbytes in events:
            if nbytes == FREE:
                total -= live.pop(key)
            else:
                live[key] = -(-nbytes // rounding) * rounding if nbytes else 0
                total += live[key]
                peak = max(peak, total)
    return peak


def most_live_large(prefix, step) -> int:
    live, count, most = set(), 0, 0
    for events in (prefix, step, step):
        for key, nbytes in events:
            if nbytes == FREE:
                if key in live:
                    live.remove(key)
                    count -= 1
            elif nbytes > K_SMALL_SIZE:
                live.add(key)
                count += 1
                most = max(most, count)
    return most


@pytest.mark.parametrize("case", list(CASES))
def test_the_expanded_step_reaches_the_walks_high_points(case):
    _, _, table, _ = probed(case)
    assert table.trace is not None
    for accumulation in (1, 2, 3):
        for batch, seq in ((2, 16), (3, 40), (8, 333)):
            check_against_walk(table, batch, seq, accumulation)  # raises TraceError otherwise


@pytest.mark.parametrize("case", list(CASES))
def test_the_run_peaks_at_the_estimate_and_the_allocator_rounds_it(case):
    shape, scenario, table, _ = probed(case)
    for accumulation in (1, 3):
        scenario_k = dataclasses.replace(scenario, grad_accum_steps=accumulation)
        estimated = estimate(shape, scenario_k)
        assert estimated.confidence is Confidence.PROBED
        prefix, step = training_events(shape, scenario_k, table)
        assert exact_peak(prefix, step) == estimated.peak_bytes
        result = reserved_peak(shape, scenario_k, table)
        # The allocator counts a block's whole size as allocated: the request rounded up to
        # 512 B, and for a large-pool block left unsplit (remainder <= 1 MiB: should_split)
        # that remainder too; small-pool blocks always split to the rounded request (their
        # 2 MiB segments leave remainders in multiples of 512 B). So allocated is at least
        # the rounded peak and at most 1 MiB per live large block above it.
        rounded = exact_peak(prefix, step, 512)
        assert rounded <= result.peak_allocated_bytes <= rounded + MIB * most_live_large(prefix, step)
        assert 0 <= rounded - estimated.peak_bytes < 512 * len(prefix + step)
        assert result.peak_reserved_bytes >= result.peak_allocated_bytes
        assert not result.out_of_memory


def test_the_prefix_holds_every_parameter_and_the_optimizers_state():
    shape, scenario, table, _ = probed("llama-x6-bf16-mixed-lessons")
    prefix = model_prefix(shape, scenario)
    params = [n for key, n in prefix if key[0] == "param"]
    assert len(params) == len(shape.params) and sum(params) == 4 * shape.num_parameters
    assert not [key for key, _ in prefix if key[0] == "state"]  # made in the first step, not with the model
    for optimizer in Optimizer:
        for device in Device:
            for precision in (Precision.FP32, Precision.BF16):
                for engine in Engine:
                    s = dataclasses.replace(scenario, optimizer=optimizer, device=device, precision=precision,
                                            engine=engine)
                    state = [n for key, n in state_events(shape, s) if key[0] == "state"]
                    rounded = sum(-(-n // 512) * 512 for n in state) if device is Device.CUDA else sum(state)
                    # A paged optimizer's big buffers live in unified memory: not allocator events.
                    paged = model_paged_state_bytes(shape, optimizer, precision, device, engine)
                    assert paged == 0 or (optimizer is Optimizer.PAGED_ADAMW8BIT and device is Device.CUDA)
                    assert rounded + paged == optimizer_state_bytes(shape, optimizer, precision, device,
                                                                    engine), optimizer


def test_the_first_step_makes_the_state_after_backward_and_before_the_update():
    """Optimizers create state lazily, in the first optimizer.step() (torch's _init_group): the
    replay's first step allocates every state tensor after its last backward event, when the
    activations are freed, and before the update's temporaries; it starts without a previous
    step's outputs, which the lessons' loop has not made yet."""
    shape, scenario, table, _ = probed("llama-x6-bf16-mixed-lessons")
    prefix, step = training_events(shape, scenario, table)
    keys = [key for key, _ in prefix]
    first_state = next(i for i, key in enumerate(keys) if key[0] == "state")
    update = keys.index(("optimizer-step",))
    assert {key for key in keys[first_state:update]} == {key for key, _ in state_events(shape, scenario)}
    assert not [key for key in keys[:first_state] if key[0] == "state"] and first_state < update
    expansion = expand(table, scenario.batch_size, scenario.seq_len, scenario.grad_accum_steps)
    last_backward = expansion.events[expansion.spans[-1].stop - 1]
    assert max(i for i, key in enumerate(keys[:update]) if key == last_backward[0]) < first_state
    assert not [key for key, n in prefix if key[0] == "carry" and n == FREE]
    assert not [key for key, _ in step if key[0] == "state"]  # later steps reuse it


def test_outputs_carried_over_are_the_next_steps_starting_tensors():
    shape, scenario, table, step_bytes = probed("llama-x6-bf16-mixed-lessons")
    one = dataclasses.replace(scenario, grad_accum_steps=1)
    prefix, step = training_events(shape, one, table)
    carried = [key for key, _ in prefix if key[0] == "carry"]
    assert carried and len(table.trace.initial) == len(carried)
    # One micro-batch: the new outputs exist before the old ones die, so `step` is two steps
    # with the carried keys' parities swapped; with three micro-batches one step hands over.
    assert {key for key, n in step if key[0] == "carry" and n != FREE} == {("carry", 1, j) for j in
                                                                           range(len(carried))} | set(carried)
    three = dataclasses.replace(scenario, grad_accum_steps=3)
    prefix3, step3 = training_events(shape, three, table)
    assert {key for key, n in step3 if key[0] == "carry" and n != FREE} == set(carried)
    # Nothing else survives a step: what it allocates it frees, or hands to the next.
    for events in (step, step3):
        allocated = {key for key, n in events if n != FREE}
        freed = {key for key, n in events if n == FREE}
        assert allocated == freed


def test_an_inconsistent_trace_fails_the_check():
    _, _, table, _ = probed("llama-x6-bf16-mixed-lessons")
    trace = table.trace
    name = max((n for n in trace.events if n.startswith("0:fw:")), key=lambda n: len(trace.events[n]))
    index = next(k for k, (_, sign, _) in enumerate(trace.events[name]) if sign > 0)
    dropped = dict(trace.events)
    dropped[name] = trace.events[name][:index] + trace.events[name][index + 1:]  # an allocation lost
    broken = dataclasses.replace(table, trace=dataclasses.replace(trace, events=dropped))
    with pytest.raises(TraceError):
        check_against_walk(broken, 3, 40, 1)


def test_tables_without_a_trace_load_and_write_as_before():
    shape = load_model_shape("gpt2", Task.CAUSAL_LM)
    stored = json.loads((cache.SHIPPED_DIR / f"{cache.config_digest(shape)}.json").read_text())
    older = [data for data in stored.values() if "segments" in data and "trace" not in data]  # the CPU tables
    assert older
    for data in older:
        table = ProbeTable.from_json(data)
        assert table.trace is None and table.to_json() == data
    _, _, fresh, _ = probed("llama-x6-bf16-mixed-lessons")
    data = json.loads(json.dumps(fresh.to_json()))
    assert ProbeTable.from_json(data) == fresh
    data.pop("trace")
    assert ProbeTable.from_json(data) == dataclasses.replace(fresh, trace=None)
    with pytest.raises(TraceError, match="no allocation trace"):
        step_events(ProbeTable.from_json(data), 2, 16, 1)


# --- hand-built probes -------------------------------------------------------------------

def _recordings(storages: list, events: list, live_at_start=()) -> list[Recording]:
    """Three recordings at the probe sizes; storages: shapes as functions of (b, s), 4-byte elements."""
    out = []
    for b, s in PROBE_SIZES:
        recording = Recording(b, s)
        for shape_of in storages:
            shape = shape_of(b, s)
            count = 1
            for d in shape:
                count *= d
            recording.sizes.append((shape, 4, 4 * count))
        recording.live_at_start = list(live_at_start)
        recording.events = list(events)
        out.append(recording)
    return out


def _layered_probe():
    """Blocks 0, 1, 2, 3 probed for 6 real layers (block 2 stands for layers 2-4). Each
    block's forward saves `act` (freed in its own backward), makes an autocast-like weight
    copy (freed for every layer when the forward returns) and its output (freed by the next
    block's backward); its backward makes a gradient (kept) and an input gradient (freed by
    the block below). A mask made before the blocks is freed by block 2's first backward
    instance; the previous step's logits die when the new forward returns."""
    names, storages = {}, []

    def storage(name, shape_of):
        names[name] = len(storages)
        storages.append(shape_of)

    storage("prev", lambda b, s: (b, s, 10))
    storage("emb", lambda b, s: (b, s, 8))
    storage("mask", lambda b, s: (b, s, s))
    for k in range(4):
        storage(f"act{k}", lambda b, s: (b, s, 4))
        storage(f"copy{k}", lambda b, s: (16, 16))
        storage(f"out{k}", lambda b, s: (b, s, 8))
    storage("logits", lambda b, s: (b, s, 10))
    storage("gl", lambda b, s: (b, s, 10))
    for k in range(4):
        storage(f"gw{k}", lambda b, s: (8, 8))
        storage(f"g{k}", lambda b, s: (b, s, 8))
    events = []

    def at(backward, block, *changes):
        for change in changes:
            sign, name = (+1, change[1:]) if change[0] == "+" else (-1, change[1:])
            category = "gradients" if name.startswith("gw") else "activations"
            events.append(Event(0, backward, block, names[name], sign, category))

    at(False, None, "+emb", "+mask")
    for k in range(4):
        at(False, k, f"+act{k}", f"+copy{k}", f"+out{k}")
    at(False, None, "+logits", "-prev", "-copy0", "-copy1", "-copy2", "-copy3")
    at(True, None, "+gl", "-out3")
    at(True, 3, "+gw3", "-act3", "-out2", "+g3", "-gl")
    for k in (2, 1, 0):
        at(True, k, f"+gw{k}", f"-act{k}", *([f"-out{k - 1}"] if k else ["-emb"]), f"+g{k}", f"-g{k + 1}",
           *(["-mask"] if k == 2 else []))
    at(True, None, "-g0")
    layout = Layout(num_layers=6, probed=(0, 1, 2, 5), stands_for=(0, 1, 2, 2, 2, 3), period=1)
    table = solve(_recordings(storages, events, [(names["prev"], "activations")]), layout, "hand-built")
    return table, names


def test_every_free_frees_the_instance_the_real_step_frees():
    table, names = _layered_probe()
    check_against_walk(table, 3, 40, 1)
    expansion = expand(table, 3, 40, 1)
    role = {index: name.rstrip("0123456789") for name, index in names.items()}
    made_at = {}
    frees = {}
    for (key, nbytes), layer in zip(expansion.events, expansion.layers):
        if nbytes == FREE:
            frees.setdefault(role[key[0]], []).append((made_at[key], layer))
        else:
            made_at[key] = layer
    assert sorted(frees["act"]) == [(j, j) for j in range(6)]  # saved in a block's forward, freed in its backward
    assert sorted(frees["out"][1:]) == [(j, j + 1) for j in range(5)]  # freed by the next layer's backward
    assert frees["out"][0] == (5, None)  # the last block's output, by the head's backward
    assert sorted(frees["g"]) == [(0, 0)] + [(j, j - 1) for j in range(1, 6)]  # input gradients, by the layer below
    assert sorted(frees["copy"]) == [(j, 5) for j in range(6)]  # every layer's copy when the forward returns
    assert frees["mask"] == [(None, 4)] and frees["prev"] == [(None, 5)]
    gradients = [layer for (key, _), layer in zip(expansion.events, expansion.layers)
                 if key in dict(expansion.live_at_end) and role[key[0]] == "gw"]
    assert sorted(gradients) == list(range(6))


def _order_table(first_free: str, sizes_mib: dict) -> ProbeTable:
    names = {name: i for i, name in enumerate(sizes_mib)}
    storages = [(lambda n: (lambda b, s: (n // 4,)))(int(mib * MIB)) for mib in sizes_mib.values()]
    second = "B" if first_free == "A" else "A"
    events = [Event(0, False, 0, names[n], +1, "activations") for n in ("A", "B")]
    events += [Event(0, False, 0, names[first_free], -1, "activations"),
               Event(0, False, 0, names["C"], +1, "activations"),
               Event(0, True, 0, names["C"], -1, "activations"), Event(0, True, 0, names[second], -1, "activations")]
    layout = Layout(num_layers=1, probed=(0,), stands_for=(0,), period=0)
    return solve(_recordings(storages, events), layout, "hand-built")


def test_allocation_order_changes_reserved_memory():
    # Rules (c10/cuda/CUDACachingAllocator.cpp): an 8 MiB request opens a 20 MiB segment
    # (1-10 MiB requests: large_segment_size) and splits it (remainder > 1 MiB); a 12 MiB
    # request opens a segment of its size rounded to 2 MiB; free blocks merge only with
    # free neighbours of their own segment; best fit takes the smallest block that fits.
    sizes = {"A": 8, "B": 8, "C": 12}
    # A and B fill 16 MiB of one segment, B's 4 MiB tail stays free. Freeing A leaves free
    # blocks of 8 and 4 MiB apart: C needs a segment of its own, 12 MiB more.
    apart = replay(step_events(_order_table("A", sizes), 2, 7, 1))
    assert (apart.peak_allocated_bytes, apart.peak_reserved_bytes) == (20 * MIB, 32 * MIB)
    # Freeing B instead merges it with the free tail: one 12 MiB block, which C takes.
    merged = replay(step_events(_order_table("B", sizes), 2, 7, 1))
    assert (merged.peak_allocated_bytes, merged.peak_reserved_bytes) == (20 * MIB, 20 * MIB)
    # A large block is split only when more than 1 MiB would remain: an 11.5 MiB request
    # given the merged 12 MiB block takes all of it, allocated 0.5 MiB above its rounded size.
    unsplit = step_events(_order_table("B", {"A": 8, "B": 8, "C": 11.5}), 2, 7, 1)
    result = replay(unsplit)
    assert result.peak_allocated_bytes == 8 * MIB + 12 * MIB
    assert result.peak_allocated_bytes - exact_peak([], unsplit, 512) == MIB // 2 < MIB
