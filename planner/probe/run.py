"""Running the probe: the model's own training step on fake tensors, at reduced depth and a
few small (batch, sequence) sizes, recorded allocation by allocation.

A probe builds a copy of the model with fewer blocks at the real widths (the first block,
two periods of the middle layers' pattern, the last block: four blocks when all layers are
alike; every block when the real model has no more) and runs, under FakeTensorMode
(nothing is allocated; cost is per op, not per element):
  - for the lessons' loop (Engine.ACCELERATE) the previous step's last micro-batch, whose
    outputs stay bound to `outputs` until the next forward returns, then
  - two recorded micro-batches with accumulation semantics: the first starts without
    gradients (zero_grad(set_to_none=True) ended the previous step), the second with all of
    them (every later micro-batch of an accumulation cycle looks the same).
The Trainer's loop (Engine.TRAINER) computes the loss in `compute_loss`, so the outputs die
before backward, and has no outputs carried over. The optimizer step is not run: its
memory depends on the parameters, not on the batch (planner.optimizer_state and
planner.optimizer_step hold it exactly).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from planner.probe.recorder import Recorder, Recording
from planner.scenario import Engine, Scenario

# (batch, sequence) of the probes. No size is 1 (code may special-case it), and no two
# candidate dimension formulas (b, s, b*s, s*s, b*s*s, affine in each) agree on all three
# probes, so each tensor dimension is identified uniquely (planner.probe.solve).
PROBE_SIZES = ((2, 7), (3, 12), (5, 15))
# Batch 1 is its own technique class (planner.probe.cache): models special-case it (GPT-2's
# attention takes another path, with other tensors and lifetimes), so it is probed at batch 1,
# and its table is a function of s alone.
BATCH_ONE_PROBE_SIZES = ((1, 7), (1, 12), (1, 15))


def probe_sizes(scenario: Scenario) -> tuple[tuple[int, int], ...]:
    return BATCH_ONE_PROBE_SIZES if scenario.batch_size == 1 else PROBE_SIZES
SHORT_WINDOW = 4  # a sliding window below every probe length: masks materialise as in a long run
LONG_WINDOW = 16  # one above every probe length: masks are dropped as in a short run



class ProbeUnsupported(Exception):
    """The probe cannot run this model or technique; the message is one line saying why."""


class BlocksNotFound(ProbeUnsupported):
    """The reduced model's blocks are not one ModuleList of them (shared layers, a second
    stack): the model can still be probed at full depth."""


@dataclass(frozen=True)
class Layout:
    """Which real layer each probed block stands for.

    The probe runs the first block, two periods of the middle layers' pattern (one period
    when every layer is alike: two middle blocks) and the last block. The first period's
    blocks stand for one real layer each; the second period's for all later middle layers
    of their type (planner.probe.solve says why two periods are needed).
    """

    num_layers: int  # the real model's depth
    probed: tuple[int, ...]  # real layer index of each probed block
    stands_for: tuple[int, ...]  # per real layer: the probed block whose memory it repeats
    period: int  # length of the middle layers' repeating pattern (0: every block probed)

    @property
    def reduced(self) -> bool:
        return len(self.probed) < self.num_layers

    def second_period(self) -> set[int]:
        return set(range(self.period + 1, 2 * self.period + 1)) if self.reduced else set()


MAX_PERIOD = 8  # a longer layer pattern is probed at full depth


def _layer_types(config, num_layers: int) -> list | None:
    types = getattr(config, "layer_types", None)
    return list(types) if isinstance(types, (list, tuple)) and len(types) == num_layers else None


def _period(kinds: list) -> int | None:
    middle = kinds[1:-1]
    for period in range(1, MAX_PERIOD + 1):
        if all(middle[i] == middle[i + period] for i in range(len(middle) - period)):
            return period
    return None


# An encoder-decoder's decoder depth, by the names transformers' configs give it (T5:
# num_decoder_layers; BART, mBART, Pegasus, Marian, LED: decoder_layers); else the encoder's.
_DECODER_DEPTH = ("num_decoder_layers", "decoder_layers")


def stack_depths(config, task=None) -> tuple[int, ...]:
    """Depth of each stack of blocks the task's model runs, in the order it runs them. An
    encoder-decoder's sequence classifier runs its encoder, then its decoder; its causal LM
    (BartForCausalLM) the decoder alone."""
    from planner.scenario import Task

    encoder = int(config.num_hidden_layers)
    if not getattr(config, "is_encoder_decoder", False):
        return (encoder,)
    decoder = next((int(v) for name in _DECODER_DEPTH if isinstance(v := getattr(config, name, None), int)), encoder)
    return (decoder,) if task is Task.CAUSAL_LM else (encoder, decoder)


def full_depth(layers: int) -> Layout:
    """Every block probed as itself."""
    return Layout(layers, tuple(range(layers)), tuple(range(layers)), 0)


def layout_for(config, task=None) -> Layout:
    """`task`: the head the model is built with (an encoder-decoder's depends on it)."""
    depths = stack_depths(config, task)
    if len(depths) > 1 or getattr(config, "is_encoder_decoder", False):
        # Two stacks (or a decoder whose depth is not num_hidden_layers) are probed at full
        # depth: the period reduction below is written for one stack. Exact, and slower.
        return full_depth(sum(depths))
    layers = depths[0]
    kinds = _layer_types(config, layers) or ["block"] * layers
    period = _period(kinds)
    if period is None or layers <= 2 * period + 2:
        return Layout(layers, tuple(range(layers)), tuple(range(layers)), 0)
    probed = tuple([0] + list(range(1, 2 * period + 1)) + [layers - 1])
    stands_for = [0] + [i if i <= period else period + 1 + (i - 1) % period for i in range(1, layers - 1)]
    return Layout(layers, probed, tuple(stands_for + [len(probed) - 1]), period)


def reduced_config(config, layout: Layout, window_exceeded: bool):
    """The real config with only the probed blocks; per-layer lists sliced alike."""
    reduced = copy.deepcopy(config)
    layers = layout.num_layers
    if layout.reduced:
        for name, value in list(vars(reduced).items()):
            if isinstance(value, list) and len(value) == layers and name not in ("architectures",):
                setattr(reduced, name, [value[i] for i in layout.probed])
        try:
            reduced.num_hidden_layers = len(layout.probed)
        except (NotImplementedError, AttributeError) as error:  # Funnel: depth is `block_sizes`
            raise BlocksNotFound(f"the config's depth cannot be reduced ({str(error).splitlines()[0][:80]})") from None
    if getattr(reduced, "sliding_window", None) is not None:
        # Only whether the sequence reaches the window changes what is allocated (the
        # mask is kept, at full s x s size): probe that regime at probe lengths.
        reduced.sliding_window = SHORT_WINDOW if window_exceeded else max(LONG_WINDOW, reduced.sliding_window)
    return reduced


def block_prefixes(model, layout: Layout, depths: tuple[int, ...]) -> tuple[str, ...]:
    """Qualified names of the ModuleLists holding the probed blocks, in the order they run:
    one stack, or an encoder-decoder's two (numbered on: the decoder's first block follows
    the encoder's last). None at full depth where no ModuleList holds them one by one."""
    try:
        return _find_block_lists(model, layout, depths)
    except ProbeUnsupported as error:
        if layout.reduced:
            raise BlocksNotFound(str(error)) from None
        # At full depth nothing repeats, so the blocks need no names: the step is one segment
        # (planner.probe.solve). ALBERT runs one shared layer group num_hidden_layers times.
        return ()


def _find_block_lists(model, layout: Layout, depths: tuple[int, ...]) -> tuple[str, ...]:
    import torch

    count, real_layers = len(layout.probed), layout.num_layers
    outermost = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(o + ".") for o in outermost):
            outermost.append(name)
    lengths = {name: len(model.get_submodule(name)) for name in outermost}
    if len(depths) > 1:
        stacks = tuple(name for name in outermost if lengths[name] in depths)
        if tuple(lengths[name] for name in stacks) != tuple(depths):
            raise ProbeUnsupported(f"cannot find the encoder's and decoder's blocks ({len(depths)} stacks of "
                                   f"{', '.join(map(str, depths))} blocks)")
        return stacks
    found = [name for name, length in lengths.items() if length == count]
    if len(found) != 1:
        raise ProbeUnsupported(f"cannot tell the repeated blocks apart ({len(found)} module lists of {count})")
    others = [name for name, length in lengths.items() if name != found[0] and length == real_layers > count]
    if others:
        raise ProbeUnsupported(f"a second stack of blocks ({others[0]}) is not reduced with {found[0]}")
    return (found[0],)


def _trainer_loss(model, batch):
    # Trainer.compute_loss: the outputs are a local of the call and die when it returns.
    return model(**batch).loss


def _record(model, accelerator, fake, stacks: tuple[tuple[str, int], ...], scenario: Scenario, batches: list[dict], gpu=None) -> Recording:
    """One probe: the step of `scenario`'s loop on `batches` (previous step's last, then two).
    On CUDA's kernels (`gpu`) the step takes CUDA's path where a fake kernel would not
    (planner.probe.recorder, planner.probe.accumulation)."""
    from planner.probe.accumulation import InputBufferSums, watching_backward
    from planner.probe.fake_cuda import rounded_sizes_to
    from planner.probe.fake_mode import simulation

    recording = Recording(scenario.batch_size, scenario.seq_len)
    sums = InputBufferSums() if gpu is not None else None
    recorder = Recorder(recording, stacks, sums)
    recorder.track_external(model)
    recorder.note_inputs(t for batch in batches for t in batch.values())
    lessons_loop = scenario.engine is Engine.ACCELERATE

    with simulation(fake, gpu) if fake is not None else contextlib.nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if sums is not None:
            sums.calibrate()  # under the same modes, before the recorder sees anything
        with (recorder, rounded_sizes_to(recorder.note_rounded),
              watching_backward(sums) if sums is not None else contextlib.nullcontext()):
            outputs = None
            if lessons_loop:
                # The previous step's last micro-batch: its outputs outlive its backward.
                outputs = model(**batches[0])
                accelerator.backward(outputs.loss)
                model.zero_grad(set_to_none=True)
            recorder.start()
            for micro_batch, batch in enumerate(batches[1:]):
                recorder.reset_mod_stats()
                recorder.micro_batch, recorder.backward = micro_batch, False
                if lessons_loop:
                    outputs = model(**batch)
                    loss = outputs.loss
                else:
                    loss = _trainer_loss(model, batch)
                recorder.backward = True
                accelerator.backward(loss)
                del loss
            recorder.on = False
            del outputs
            # Full fine-tuning's optimizer takes every parameter and keeps state for those with a
            # gradient; one built frozen (RoFormer's sinusoidal position table) has none. Adapters'
            # optimizers take the trainable tensors only.
            recording.no_gradient = [name for name, parameter in model.named_parameters()
                                     if parameter.grad is None and (parameter.requires_grad
                                                                    or not scenario.finetune.uses_adapters)]
            model.zero_grad(set_to_none=True)
    return recording


def _first_step(model, accelerator, fake, batch: dict, gpu=None) -> None:
    """One unrecorded step, as a real run's first: what a model creates once (LongRoPE's
    frequency buffers, lazily built caches) must not shift the first probe's storages."""
    from planner.probe.fake_mode import simulation

    with simulation(fake, gpu) if fake is not None else contextlib.nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator.backward(model(**batch).loss)
        model.zero_grad(set_to_none=True)


def record_probes(config_dict: dict, config, scenario: Scenario, layout: Layout, window_exceeded: bool,
                  progress: Callable[[str], None] | None = None, real: bool = False,
                  gpu=None) -> list[Recording]:
    """The three probes of one technique class, at its `probe_sizes`, on one reduced model: fake,
    or (`real`, for code that reads tensor values: a `nonzero()` in a loss) real CPU tensors,
    which MemTracker counts alike (tests/test_simulate.py). `gpu` (fake tensors only): take
    that GPU's CUDA kernels (planner.probe.fake_cuda, e.g. "sm90"); None, the CPU's."""
    if gpu is not None and real:
        raise ValueError("CUDA kernels are simulated on fake tensors only")
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.probe.build import build_model, fresh_accelerator, synthetic_batch
    from planner.probe.fake_mode import fake_batch

    fake = None if real else FakeTensorMode()
    with fake or contextlib.nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(config_dict, scenario, config=reduced_config(config, layout, window_exceeded))
    depths = stack_depths(config, scenario.task)
    prefixes = block_prefixes(model, layout, depths)
    stacks = tuple((prefix, sum(depths[:i])) for i, prefix in enumerate(prefixes))  # first block's number
    accelerator = fresh_accelerator(dataclasses.replace(scenario, grad_accum_steps=1), cpu=True,
                                    cuda_kernels=gpu is not None)
    model = accelerator.prepare(model)  # autocast and fp32 outputs, as the loops run the model
    recordings = []
    sizes = probe_sizes(scenario)
    for number, (batch, seq) in enumerate(sizes, start=1):
        if progress is not None:
            progress(f"probe {number} of {len(sizes)}: batch {batch} x {seq} tokens, "
                     f"{len(layout.probed)} of {layout.num_layers} blocks")
        probe_scenario = dataclasses.replace(scenario, batch_size=batch, seq_len=seq, grad_accum_steps=2)
        batches = [synthetic_batch(config_dict, probe_scenario, seed=seed) for seed in range(3)]
        if not all(bool((b["attention_mask"] == 1).all()) for b in batches):
            raise ProbeUnsupported("probe batches must be unpadded")
        if fake is not None:
            batches = [fake_batch(fake, b) for b in batches]
        if number == 1:
            _first_step(model, accelerator, fake, batches[0], gpu)
        recordings.append(_record(model, accelerator, fake, stacks, probe_scenario, batches, gpu))
    for recording in recordings:
        recording.no_gradient = real_names(recording.no_gradient, stacks, layout)
    return recordings


def real_names(names: list[str], stacks: tuple[tuple[str, int], ...], layout: Layout) -> list[str]:
    """The real model's parameters a probed model's names stand for: a probed block's
    parameter is every real layer's that repeats that block (Layout.stands_for)."""
    out = []
    for name in names:
        for prefix, first in stacks:
            head = prefix + "."
            if name.startswith(head) and name[len(head):].split(".", 1)[0].isdigit():
                index, rest = name[len(head):].split(".", 1)
                block = first + int(index)
                out += [f"{head}{layer - first}.{rest}" for layer, probed in enumerate(layout.stands_for)
                        if probed == block]
                break
        else:
            out.append(name)
    return out
