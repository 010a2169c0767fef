"""The estimate: memory by category at each phase of one steady-state optimizer step,
and the peak as the maximum over phases (../shared/DESIGN.md, "What measured means").

Phases of one optimizer step with K micro-batches (zero_grad(set_to_none=True), so the
first micro-batch starts with no gradients; later ones carry them, which is why
accumulation keeps gradients alive):
  forward end   weights + state + [gradients if K > 1] + saved activations + loss transients
  backward      the larger of: its start (everything saved + the loss gradients) and its
                end (all gradients + embeddings' activations + one block's gradients);
                with checkpointing, one block is recomputed at a time
  optimizer     weights + gradients + state + the step's temporaries
"""

from __future__ import annotations

import dataclasses

import enum
import math
from dataclasses import dataclass

from planner.activations import ActivationProfile, activation_profile
from planner.adafactor_cuda import optimizer_order, step_peak_bytes
from planner.errors import PlannerInputError
from planner.finetune import Method
from planner.model_shape import ArchFamily, ModelShape, ParamTensor, compute_parameter_stats
from planner.optimizer_state import (
    allocation,
    model_paged_state_bytes,
    optimizer_state_bytes,
    paged_state_bytes,
    parameter_bytes_per_element,
    parameter_tensor_bytes,
    tensor_state_bytes,
)
from planner.optimizer_step import optimizer_step_transient_bytes
from planner.scenario import (
    Attention,
    Checkpointing,
    Device,
    Engine,
    Optimizer,
    Precision,
    Scenario,
    Task,
    capability_text,
)
from planner.units import format_bytes

MAX_PEAK_BYTES = 1 << 62  # 4 EiB: a quarter of what a signed 64-bit column holds, so sums stay in range


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer-step"


class Confidence(enum.Enum):
    """How the estimate was obtained."""

    PROBED = "probed"  # the model's own step on fake tensors (planner.probe), exact in b, s and depth
    PROBED_REAL = "probed-on-real-tensors"  # the same on small real tensors: its code reads tensor values
    MODELLED = "modelled"  # the family's hand-written activation recipe (the probe could not run the model)
    GENERIC = "generic"  # unknown family: a generic pre-LN decoder recipe stands in


@dataclass(frozen=True)
class PhaseMemory:
    """Live bytes by category at the high point of one phase."""

    phase: Phase
    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state + self.activations + self.temporaries


@dataclass(frozen=True)
class Estimate:
    model_name: str
    architecture: str
    num_parameters: int
    scenario: Scenario
    weights_bytes: int  # parameters plus registered buffers
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int  # saved for backward by one micro-batch's forward, plus its output logits
    phases: tuple[PhaseMemory, ...]
    profile: ActivationProfile
    confidence: Confidence
    notes: tuple[str, ...]
    trainable_parameters: int | None = None  # None: every parameter (full fine-tuning)
    frozen_weight_bytes: int = 0  # the frozen base of LoRA / QLoRA
    # The part of optimizer_state_bytes a paged optimizer keeps in CUDA unified memory, outside
    # torch's caching allocator: not in the phases (planner.optimizer_state.paged_state_bytes).
    paged_state_bytes: int = 0
    # On CUDA, what the optimizer step's kernel workspaces (Adafactor's column reductions,
    # planner.adafactor_cuda) add to its high point in the caching allocator: not a tensor, so
    # not in the phases (MemTracker does not see them); the replay makes them (planner.reserved).
    step_workspace_bytes: int = 0

    @property
    def peak(self) -> PhaseMemory:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    @property
    def peak_phase(self) -> Phase:
        return self.peak.phase

    @property
    def peak_reason(self) -> str:
        return _PEAK_REASONS[self.peak_phase]

    def to_json(self) -> dict:
        s = self.scenario
        peak = self.peak
        return {
            "model": self.model_name,
            "architecture": self.architecture,
            "num_parameters": self.num_parameters,
            "scenario": {
                "task": s.task.value, "num_labels": s.num_labels, "batch_size": s.batch_size,
                "seq_len": s.seq_len, "optimizer": s.optimizer.value, "precision": s.precision.value,
                "gradient_checkpointing": s.checkpointing is Checkpointing.EVERY_LAYER,
                "grad_accum": s.grad_accum_steps, "attn": s.attention.value, "device": s.device.value,
                "engine": s.engine.value, **_finetune_json(s),
                **({"cuda_alloc_conf": s.cuda_alloc_conf} if s.cuda_alloc_conf else {}),
                **({"compute_capability": capability_text(s.compute_capability)} if s.compute_capability else {}),
            },
            "trainable_parameters": self.num_parameters if self.trainable_parameters is None
            else self.trainable_parameters,
            "frozen_weight_bytes": self.frozen_weight_bytes,
            "weights_bytes": self.weights_bytes,
            "gradients_bytes": self.gradients_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "paged_optimizer_state_bytes": self.paged_state_bytes,
            "activations_bytes": self.activations_bytes,
            "temporaries_bytes": peak.temporaries,
            "peak_bytes": peak.total,
            "peak_phase": peak.phase.value,
            "peak_reason": self.peak_reason,
            "peak_breakdown_bytes": {
                "weights": peak.weights, "gradients": peak.gradients, "optimizer_state": peak.optimizer_state,
                "activations": peak.activations, "temporaries": peak.temporaries,
            },
            "phases": {p.phase.value: p.total for p in self.phases},
            "confidence": self.confidence.value,
            "notes": list(self.notes),
        }


def _finetune_json(scenario: Scenario) -> dict:
    method = scenario.finetune
    if not method.uses_adapters:
        return {"finetune": method.method.value}
    values = {"finetune": method.method.value, "lora_r": method.lora_r, "lora_alpha": method.alpha,
              "lora_dropout": method.lora_dropout, "lora_targets": method.targets_text}
    if method.method is Method.QLORA:
        values.update(quant_type=method.quant_type, double_quant=method.double_quant)
    return values


_PEAK_REASONS = {
    Phase.FORWARD: "saved activations are largest at the end of the forward pass",
    Phase.BACKWARD: "gradients of the loss and of the last layers join the saved activations early in backward",
    Phase.OPTIMIZER_STEP: "weights, gradients, optimizer state and the step's temporaries are all alive",
}


# accelerate turns its native AMP on for fp16 only off the CPU (Accelerator.__init__).
CPU_FP16_NOTE = ("fp16-mixed on a CPU runs as fp32: accelerate (and the Trainer through it) autocasts fp16 "
                 "only on a GPU, so this plan is an fp32 step; bf16-mixed autocasts on a CPU")


def _autocast_weight_copy_bytes(shape: ModelShape, scenario: Scenario) -> tuple[int, int]:
    """16-bit copies autocast makes of matmul weights: (inside the blocks, in the head).

    Autocast caches one copy per weight until its context exits, and `linear` saves it
    for backward. Embedding tables are looked up, not multiplied, so never copied, except
    a tied LM head that multiplies by the embedding.
    """
    if not scenario.autocasts:
        return 0, 0
    stats = shape.stats
    head = stats.matmul_elements - stats.block_matmul_elements - shape.embedding_elements
    if shape.tied_embeddings and scenario.task.has_lm_head:
        head += shape.vocab_size * shape.hidden_size
    return 2 * stats.block_matmul_elements, 2 * max(head, 0)


def _head_gradient_elements(shape: ModelShape, scenario: Scenario) -> int:
    """Gradients that backward creates before reaching the blocks: the head's (final norm,
    classifier or LM head, and the tied embedding the LM head shares)."""
    stats = shape.stats
    head = stats.num_elements - stats.block_elements - shape.embedding_elements
    if shape.tied_embeddings and scenario.task.has_lm_head:
        head += shape.vocab_size * shape.hidden_size
    return max(head, 0)


def _probed_phases(shape: ModelShape, scenario: Scenario, weights: int, state: int, step: int | None = None):
    """Phases from the model's probed step, or why there is none (planner.probe). `step`: the
    optimizer step's temporaries when they are not probed."""
    from planner.probe.cache import probe_table, probed_step_temporaries

    table = probe_table(shape, scenario)
    if isinstance(table, str):
        return table
    walk = table.walk(scenario.batch_size, scenario.seq_len, scenario.grad_accum_steps)
    if step is None:
        step = probed_step_temporaries(shape, scenario)
    if isinstance(step, str):
        return f"optimizer step: {step}"
    phases = (
        PhaseMemory(Phase.FORWARD, weights, walk.forward.gradients, state, walk.forward.activations,
                    walk.forward.temporaries),
        PhaseMemory(Phase.BACKWARD, weights, walk.backward.gradients, state, walk.backward.activations,
                    walk.backward.temporaries),
        # What the last backward left (gradients, the outputs the loop keeps) meets the step's temporaries.
        PhaseMemory(Phase.OPTIMIZER_STEP, weights, walk.end.gradients, state,
                    walk.end.activations + walk.end.temporaries, step),
    )
    return phases, walk.forward_end_activations, table.on_real_tensors


# Config keys of transformers' Mamba-hybrid configs (Jamba, Falcon-H1, Bamba, Zamba,
# Nemotron-H, GraniteMoeHybrid): their state-space layers' sizes.
_STATE_SPACE_KEYS = ("mamba_", "ssm_")


def _has_state_space_layers(shape: ModelShape) -> bool:
    if shape.source_config is None:
        return False
    import json

    return any(key.startswith(_STATE_SPACE_KEYS) for key in json.loads(shape.source_config))


def _trained_shape(shape: ModelShape, scenario: Scenario) -> ModelShape:
    """`shape` without the parameters its probed step leaves without a gradient (`shape`
    itself when there are none)."""
    from planner.probe.cache import probe_table

    table = probe_table(shape, scenario)
    unused = set(table.no_gradient) if not isinstance(table, str) else set()
    if not unused:
        return shape
    return dataclasses.replace(shape, params=tuple(p for p in shape.params if p.name not in unused),
                               embedding_param_names=shape.embedding_param_names - unused)


def _first_untrained(shape: ModelShape, trained: ModelShape) -> str:
    kept = {p.name for p in trained.params}
    return next(p.name for p in shape.params if p.name not in kept)


def _cuda_probe_note(method: str, scenario: Scenario) -> str:
    from planner.probe.cache import kernels_label

    return (f"{method} on CUDA: activations probed with {kernels_label(scenario)} on fake tensors "
            "(planner/probe/fake_cuda.py: SDPA's backend, 1-byte dropout masks, CUDA autocast's op lists, gradient "
            "sums in place; checked against an H200's records, README \"Measured on a GPU\"; the attention "
            "backward's own scratch is not counted), each saved tensor at its exact size (the caching allocator's "
            "512-byte blocks are not added to them).")


# Tasks no family recipe is claimed for: planned through the probe or refused, in these words.
PROBE_ONLY_TASKS = {Task.TOKEN_CLASSIFICATION: "token classification",
                    Task.SEQ2SEQ_LM: "sequence-to-sequence training"}


def check_scenario_fits_model(shape: ModelShape, scenario: Scenario) -> None:
    if shape.max_positions is not None and scenario.seq_len > shape.max_positions:
        raise PlannerInputError(
            f"sequence length {scenario.seq_len:,} exceeds {shape.name}'s {shape.max_positions:,} positions "
            "(max_position_embeddings): use a shorter sequence"
        )
    # (A shape of task seq2seq-lm exists only for an encoder-decoder: transformers builds no other.)
    if (scenario.task is Task.SEQ2SEQ_LM and shape.max_positions is not None
            and scenario.target_len > shape.max_positions):
        raise PlannerInputError(
            f"target length {scenario.target_len:,} exceeds {shape.name}'s {shape.max_positions:,} positions "
            "(max_position_embeddings): use a shorter target"
        )
    if scenario.attention is Attention.SDPA and not shape.supports_sdpa:
        # transformers' own refusal (PreTrainedModel._check_and_adjust_sdpa), with what to do.
        raise PlannerInputError(
            f"{shape.architecture} does not support an attention implementation through "
            "torch.nn.functional.scaled_dot_product_attention yet: use --attn eager"
        )
    if scenario.checkpointing is Checkpointing.EVERY_LAYER and not shape.supports_checkpointing:
        # transformers' own refusal (PreTrainedModel.gradient_checkpointing_enable), with what to do.
        raise PlannerInputError(f"{shape.architecture} does not support activation checkpointing: "
                                "plan without --gradient-checkpointing")
    if scenario.task is not shape.task or (
        scenario.task.uses_labels and scenario.num_labels != shape.num_labels
    ):
        raise ValueError("scenario task/num_labels differ from the ModelShape's: load the shape for this task")


# torch.optim's optimizers that CUDA runs with all tensors at once by default (foreach) or
# fused (torch/optim/optimizer.py `_default_to_fused_or_foreach`); Adafactor keeps its
# per-tensor loop unless asked (torch/optim/_adafactor.py), and bitsandbytes its own kernels.
_CUDA_MULTI_TENSOR = (Optimizer.ADAMW, Optimizer.ADAM, Optimizer.SGD, Optimizer.ADAMW_FUSED)
# Optimizers whose step is the same per-tensor Python loop on CUDA as on the CPU (torch's
# Adafactor unless foreach is asked for; transformers' Adafactor): probed on the CPU.
PER_TENSOR_ON_CUDA = (Optimizer.ADAFACTOR, Optimizer.HF_ADAFACTOR)


def _per_tensor_cuda_step(shape: ModelShape, trained: ModelShape, scenario: Scenario) -> tuple[int, int] | None:
    """A per-tensor step on CUDA: (its live temporaries, what its kernels' workspaces add in the
    caching allocator). The live ones are the CPU probe's, or the loop's own requests in
    512-byte blocks where they hold more (planner.adafactor_cuda); None when the step cannot
    be probed (planner.estimate._probed_phases says why)."""
    from planner.probe.cache import probed_step_temporaries

    probed = probed_step_temporaries(shape, scenario)
    if isinstance(probed, str):
        return None
    shapes = optimizer_order(trained.params, scenario.optimizer, scenario.engine)
    element = parameter_bytes_per_element(scenario.precision)
    live = max(probed, step_peak_bytes(shapes, element, scenario.optimizer, workspaces=False))
    allocated = max(probed, step_peak_bytes(shapes, element, scenario.optimizer, workspaces=True))
    return live, allocated - live


def _adapter_step_bytes(trainable: tuple[tuple[str, tuple[int, ...], int], ...], scenario: Scenario) -> int | None:
    """The optimizer step's temporaries over LoRA's trainable tensors on CUDA when they are not
    probed, from torch's code as for the full model (planner.optimizer_step): the step probe
    runs the reduced model, which holds every parameter shape, so it is exact for a per-tensor
    loop (None: probe it), but a foreach step holds a temporary for every trainable tensor at
    once, and would see only the probed blocks' adapters. `trainable`: (name, shape, bytes per
    element) as PEFT leaves them; their dtype decides as the parameters' precision does for a
    full model (PEFT keeps adapters in fp32 under a bf16 base: autocast_adapter_dtype)."""
    if scenario.optimizer not in _CUDA_MULTI_TENSOR:
        return None
    sizes = {size for _, _, size in trainable}
    if len(sizes) > 1:
        raise PlannerInputError("LoRA's trainable tensors have several dtypes: the CUDA step is not modelled for that")
    dtype = Precision.BF16 if sizes == {2} else Precision.FP32
    params = tuple(ParamTensor(name, dims) for name, dims, _ in trainable)
    return optimizer_step_transient_bytes(compute_parameter_stats(params), scenario.optimizer, dtype, Device.CUDA)


@dataclass(frozen=True)
class AdapterTensors:
    """The tensors a LoRA or QLoRA model holds on its device, as PEFT, transformers and
    bitsandbytes make them (planner.adapters): the bytes of each stored tensor, and the
    trainable ones (name, shape, bytes per element), whose gradients and state are the
    only ones."""

    stored_bytes: tuple[int, ...]  # every parameter's storage and QLoRA's quantisation state, buffers last
    trainable: tuple[tuple[str, tuple[int, ...], int], ...]
    parameter_bytes: int  # every parameter's elements at their size (PEFT's count; QLoRA's packed bytes)
    count: object  # the planner.adapters.AdapterCount they come from


def adapter_tensors(shape: ModelShape, scenario: Scenario) -> AdapterTensors:
    """LoRA's and QLoRA's stored tensors for `scenario` (its method must use adapters)."""
    from planner.adapters import adapter_count, quantized_base

    if shape.source_config is None:
        raise PlannerInputError("LoRA is planned from the model's config: load the model from a config")
    qlora = scenario.finetune.method is Method.QLORA
    # QLoRA: prepare_model_for_kbit_training casts every float parameter to fp32, adapters included.
    dtype = "bfloat16" if scenario.precision is Precision.BF16 and not qlora else "float32"
    count = adapter_count(shape.source_config, scenario.task, scenario.num_labels, scenario.finetune, dtype)
    parameters = count.all_bytes
    stored = list(count.parameter_bytes)
    if qlora:
        base = quantized_base(shape.source_config, scenario.task, scenario.num_labels, scenario.finetune.double_quant,
                              scenario.finetune.quant_type)
        # The 4-bit layers' biases are stored in the compute dtype from the first forward on.
        compute_bytes = 4 if scenario.precision is Precision.FP32 else 2
        parameters = (base.quantized_bytes + 4 * (base.unquantized_elements - base.quantized_bias_elements)
                      + compute_bytes * base.quantized_bias_elements + count.trainable_bytes)
        stored = (list(base.stored_tensors)
                  + [n * (compute_bytes if is_bias else 4) for n, is_bias in base.unquantized_tensors]
                  + [math.prod(dims) * size for _, dims, size in count.trainable])
    stored += [shape.float_buffer_elements * 4, shape.other_buffer_bytes]
    return AdapterTensors(tuple(stored), count.trainable, parameters, count)


# _adapter_states by what they depend on (not the batch, sequence or loop): a fit search
# estimates one plan at dozens of batch sizes and sequence lengths, and these sums over every
# stored and trainable tensor (thousands for a 7B model) are the same at each.
_ADAPTER_STATES: dict[tuple, tuple] = {}
_ADAPTER_STATES_KEPT = 256


def _adapter_states(shape: ModelShape, scenario: Scenario):
    """(weights, gradients, optimizer state, trainable parameters, frozen weight bytes, the
    AdapterCount they come from) of LoRA:
    the frozen base and the adapters as PEFT builds them, gradients and state for the
    trainable tensors only (planner.adapters)."""
    key = (shape.source_config, shape.float_buffer_elements, shape.other_buffer_bytes, scenario.task,
           scenario.num_labels, scenario.finetune, scenario.precision, scenario.device, scenario.optimizer,
           scenario.engine)
    found = _ADAPTER_STATES.get(key)
    if found is None:
        if len(_ADAPTER_STATES) >= _ADAPTER_STATES_KEPT:
            _ADAPTER_STATES.clear()
        found = _ADAPTER_STATES[key] = _built_adapter_states(shape, scenario)
    return found


def _built_adapter_states(shape: ModelShape, scenario: Scenario):
    tensors = adapter_tensors(shape, scenario)
    count = tensors.count
    on_device = allocation(scenario.device)  # each tensor in 512-byte blocks on CUDA
    weights = sum(on_device(n) for n in tensors.stored_bytes)
    gradients = sum(on_device(math.prod(dims) * size) for _, dims, size in count.trainable)
    state = tensor_state_bytes(count.trainable, scenario.optimizer, scenario.device, scenario.engine)
    return (weights, gradients, state, count.trainable_parameters, tensors.parameter_bytes - count.trainable_bytes,
            count)


def _paged_out(phases: tuple[PhaseMemory, ...], paged: int, notes: list[str]) -> tuple[PhaseMemory, ...]:
    """`phases` without the optimizer state a paged optimizer keeps in CUDA unified memory
    (`paged` bytes), with a note saying where it is."""
    if not paged:
        return phases
    notes.append(f"{format_bytes(paged)} of the optimizer state (paged 8-bit AdamW's state1 and state2 of tensors "
                 "of 100,000 elements or more) lives in CUDA unified memory, outside torch's caching allocator: it "
                 "is not in the peak or the allocator's figures; the driver keeps it on the GPU while there is "
                 "room and pages it to CPU RAM when there is not (slower steps, no out-of-memory error)")
    return tuple(dataclasses.replace(p, optimizer_state=p.optimizer_state - paged) for p in phases)


def _adapter_estimate(shape: ModelShape, scenario: Scenario) -> Estimate:
    """LoRA: exact states, and every activation and gradient moment from the probe of the
    PEFT-wrapped model (frozen linears saving their inputs, adapters' dropout and A-path)."""
    weights, gradients, state, trainable, frozen, count = _adapter_states(shape, scenario)
    step = None
    notes: tuple[str, ...] = ()
    if scenario.device is Device.CUDA:
        step = _adapter_step_bytes(count.trainable, scenario)
        notes = (_cuda_probe_note("LoRA", scenario),)
        if scenario.finetune.method is Method.QLORA:
            notes += ("QLoRA on CUDA: the 4-bit base is quantised by transformers' own quantiser on fake tensors, "
                      "and each 4-bit matmul dequantises its weight as bitsandbytes' CUDA kernel does for more "
                      "than 1536 tokens per micro-batch (planner/probe/fake_quantized.py; at fewer, its fused "
                      "kernel may hold up to one dequantised weight less).",)
    probed = _probed_phases(shape, scenario, weights, state, step)
    if isinstance(probed, str):
        label = "QLoRA" if scenario.finetune.method is Method.QLORA else "LoRA"
        raise PlannerInputError(f"{label} cannot be planned for {shape.name}: the probe could not run it ({probed})")
    phases, activations_bytes, on_real_tensors = probed
    paged = paged_state_bytes(count.trainable, scenario.optimizer, scenario.device, scenario.engine)
    paged_notes: list[str] = []
    phases = _paged_out(phases, paged, paged_notes)
    return Estimate(
        model_name=shape.name, architecture=shape.architecture, num_parameters=shape.stats.num_elements,
        scenario=scenario, weights_bytes=weights, gradients_bytes=gradients, optimizer_state_bytes=state,
        activations_bytes=activations_bytes, phases=phases, profile=activation_profile(shape, scenario),
        confidence=Confidence.PROBED_REAL if on_real_tensors else Confidence.PROBED, notes=notes + tuple(paged_notes),
        trainable_parameters=trainable, frozen_weight_bytes=frozen, paged_state_bytes=paged)


def estimate(shape: ModelShape, scenario: Scenario) -> Estimate:
    """Memory of one steady-state optimizer step of `scenario` on `shape`, by phase."""
    check_scenario_fits_model(shape, scenario)
    if scenario.finetune.uses_adapters:
        return _adapter_estimate(shape, scenario)
    stats = shape.stats
    element = parameter_bytes_per_element(scenario.precision)
    # Runs build pure-bf16 models with from_config(dtype=bfloat16): buffers made with an
    # explicit dtype (rotary inv_freq is `.float()`) stay fp32, so buffers keep their size.
    on_device = allocation(scenario.device)
    weights = (parameter_tensor_bytes(shape, scenario.precision, scenario.device)
               + on_device(shape.float_buffer_elements * 4) + on_device(shape.other_buffer_bytes))
    gradients = parameter_tensor_bytes(shape, scenario.precision, scenario.device)
    state = optimizer_state_bytes(shape, scenario.optimizer, scenario.precision, scenario.device, scenario.engine)
    state_shape = shape  # the tensors the optimizer keeps state for
    profile = activation_profile(shape, scenario)
    block_copies, head_copies = _autocast_weight_copy_bytes(shape, scenario)
    layers = shape.num_layers
    accumulating = scenario.grad_accum_steps > 1
    # zero_grad(set_to_none=True): the first micro-batch starts without gradients; with
    # accumulation every later one carries all of them.
    early_gradients = gradients if accumulating else 0
    head_gradients = gradients if accumulating else _head_gradient_elements(shape, scenario) * element
    block_gradients = stats.block_elements // layers * element

    # The lessons' loop (`outputs = model(...)`) keeps the previous micro-batch's outputs
    # until the new forward returns, and the current ones through backward and the step;
    # Trainer.compute_loss returns only the loss, so its outputs die before backward.
    logits = profile.output_logits_bytes
    lesson_loop = scenario.engine is Engine.ACCELERATE
    logits_at_forward_end = 2 * logits if lesson_loop else logits
    kept_logits = logits if lesson_loop else 0
    block = profile.per_layer_bytes
    if scenario.checkpointing is Checkpointing.EVERY_LAYER:
        # Each block keeps only its input; backward recomputes one block at a time (with
        # fresh weight copies under autocast). The head is not checkpointed.
        saved = (profile.embedding_bytes + layers * profile.checkpoint_input_bytes + profile.checkpoint_mask_bytes
                 + profile.head_bytes + head_copies)
        forward_extra = block_copies  # autocast's cache lives until the forward returns
        # Its peak is inside the MLP's backward: the block's tail already freed.
        recompute = block - profile.block_tail_bytes + block_copies // layers
        # Gradients grow and kept inputs shrink block by block: the extremes are the
        # first block recomputed (the last one) and the last (the first one).
        kept = profile.embedding_bytes + profile.checkpoint_mask_bytes
        late_gradients = head_gradients + (0 if accumulating else (layers - 1) * block_gradients)
        backward_candidates = (
            (head_gradients, kept + layers * profile.checkpoint_input_bytes + recompute),
            (late_gradients, kept + profile.checkpoint_input_bytes + recompute),
        )
        # The first and the last recomputed block as they are entered: nothing freed yet.
        entered = block + block_copies // layers + kept_logits
        block_entries = [
            PhaseMemory(Phase.BACKWARD, weights, head_gradients, state,
                        kept + layers * profile.checkpoint_input_bytes + entered, profile.block_entry_transient_bytes),
            PhaseMemory(Phase.BACKWARD, weights, late_gradients, state,
                        kept + profile.checkpoint_input_bytes + entered, profile.block_entry_transient_bytes),
        ]
        if profile.attention_backward_transient_bytes:
            # The same block further on, at its attention kernel's backward (math path).
            attention_moment = kept + profile.checkpoint_input_bytes + profile.attention_side_bytes
            backward_attention = PhaseMemory(Phase.BACKWARD, weights, late_gradients, state,
                                             attention_moment + kept_logits,
                                             profile.attention_backward_transient_bytes)
    else:
        saved = profile.embedding_bytes + layers * block + profile.head_bytes + block_copies + head_copies
        forward_extra = 0
        backward_candidates = (
            (gradients, profile.embedding_bytes),  # the end: every gradient, little activation
        )
    backward_moments = [
        # Loss gradients w.r.t. the logits, with everything saved still alive.
        PhaseMemory(Phase.BACKWARD, weights, early_gradients, state, saved + kept_logits,
                    profile.loss_backward_transient_bytes),
    ]
    if scenario.checkpointing is Checkpointing.NONE:
        # Entering the last block: the head's activations freed, its gradients made.
        backward_moments.append(PhaseMemory(Phase.BACKWARD, weights, head_gradients, state,
                                            saved - profile.head_bytes - head_copies - profile.block_tail_bytes
                                            + kept_logits, profile.block_backward_start_transient_bytes))
    backward_moments += [PhaseMemory(Phase.BACKWARD, weights, grads, state, activations + kept_logits,
                                     profile.layer_backward_transient_bytes)
                         for grads, activations in backward_candidates]
    if scenario.checkpointing is Checkpointing.EVERY_LAYER:
        backward_moments += block_entries
        if profile.attention_backward_transient_bytes:
            backward_moments.append(backward_attention)
    if shape.tied_embeddings and scenario.task.has_lm_head:
        # Last of all, the input embedding's gradient meets the LM head's on the tied
        # weight: the lookup's dense gradient and the sum coexist with the head's one
        # (two extra vocabulary-sized tensors; measured on Llama-3.2-1B and GPT-2 shapes).
        tied = shape.vocab_size * shape.hidden_size * element
        backward_moments.append(PhaseMemory(Phase.BACKWARD, weights, gradients, state,
                                            profile.embedding_bytes + kept_logits, 2 * tied))
    phases = (
        PhaseMemory(Phase.FORWARD, weights, early_gradients, state, saved + logits_at_forward_end,
                    forward_extra + profile.loss_forward_transient_bytes),
        max(backward_moments, key=lambda p: p.total),
        PhaseMemory(Phase.OPTIMIZER_STEP, weights, gradients, state, kept_logits,
                    optimizer_step_transient_bytes(stats, scenario.optimizer, scenario.precision, scenario.device)),
    )
    notes = []
    if scenario.precision is Precision.FP16_MIXED and not scenario.autocasts:
        notes.append(CPU_FP16_NOTE)
    confidence = Confidence.MODELLED
    activations_bytes = saved + logits
    # On CUDA a multi-tensor step's temporaries are read from torch's code (planner.optimizer_step):
    # a foreach step holds one for every tensor at once, which the reduced model cannot show, and
    # bitsandbytes' CUDA kernels update in place. A per-tensor loop runs the same code on either
    # device, so its probed step is exact on CUDA too (torch's Adafactor read as two
    # largest-tensor temporaries was 0.46 GB high on Llama-2-7B: its loop holds one at a time), in
    # 512-byte blocks; the workspaces CUDA's column reductions take are the allocator's
    # (planner.adafactor_cuda), kept beside the phases in step_workspace_bytes.
    trained = _trained_shape(shape, scenario)
    # A foreach step works on the tensors that have a gradient.
    cuda_step = (optimizer_step_transient_bytes(trained.stats, scenario.optimizer, scenario.precision,
                                                scenario.device)
                 if scenario.device is Device.CUDA and scenario.optimizer not in PER_TENSOR_ON_CUDA else None)
    step_workspace = 0
    if scenario.device is Device.CUDA and scenario.optimizer in PER_TENSOR_ON_CUDA:
        per_tensor = _per_tensor_cuda_step(shape, trained, scenario)
        if per_tensor is not None:
            cuda_step, step_workspace = per_tensor
    probed = _probed_phases(shape, scenario, weights, state, cuda_step)
    if isinstance(probed, str) and _has_state_space_layers(shape):
        # No recipe comes near a selective scan's memory (a generic one read Jamba 45% and
        # Falcon-H1 99% low): refused, as a pure Mamba is.
        raise PlannerInputError(f"{shape.architecture} has state-space (Mamba) layers, which the planner models "
                                f"only through the probe, and the probe could not run it ({probed})")
    if isinstance(probed, str) and scenario.task in PROBE_ONLY_TASKS:
        # The family recipes were written for the other heads and for one stack: none is claimed
        # for a per-token classifier or an encoder-decoder's target sequence.
        raise PlannerInputError(f"{PROBE_ONLY_TASKS[scenario.task]} is planned only through the probe, which could "
                                f"not run {shape.architecture} ({probed})")
    if isinstance(probed, str):
        kernels = " (its CUDA terms read from the kernels' code)" if scenario.device is Device.CUDA else ""
        notes.append(f"the probe could not run this model ({probed}): the family recipe stands in{kernels}")
    else:
        phases, activations_bytes, on_real_tensors = probed
        confidence = Confidence.PROBED_REAL if on_real_tensors else Confidence.PROBED
        if scenario.device is Device.CUDA:
            notes.append(_cuda_probe_note("Full fine-tuning", scenario))
        if trained is not shape:
            # torch's and bitsandbytes' optimizers skip a parameter whose gradient is None.
            state_shape = trained
            state = optimizer_state_bytes(trained, scenario.optimizer, scenario.precision, scenario.device,
                                          scenario.engine)
            gradients = parameter_tensor_bytes(trained, scenario.precision, scenario.device)
            phases = tuple(dataclasses.replace(p, optimizer_state=state) for p in phases)
            untrained = shape.stats.num_elements - trained.stats.num_elements
            notes.append(f"{untrained:,} parameters ({len(shape.params) - len(trained.params)} tensors, such as "
                         f"{_first_untrained(shape, trained)}) get no gradient in this task's step: they hold no "
                         "gradient and no optimizer state")
    if confidence not in (Confidence.PROBED, Confidence.PROBED_REAL) and shape.family is ArchFamily.UNKNOWN:
        confidence = Confidence.GENERIC
        notes.append(f"no activation recipe for model_type {shape.model_type!r}: a generic pre-LayerNorm "
                     "decoder recipe stands in, so activations may be off by tens of percent; measure it with "
                     "`python -m runners verify --mode simulate`")
    paged = model_paged_state_bytes(state_shape, scenario.optimizer, scenario.precision, scenario.device,
                                    scenario.engine)
    phases = _paged_out(phases, paged, notes)
    result = Estimate(
        model_name=shape.name,
        architecture=shape.architecture,
        num_parameters=stats.num_elements,
        scenario=scenario,
        weights_bytes=weights,
        gradients_bytes=gradients,
        optimizer_state_bytes=state,
        activations_bytes=activations_bytes,
        phases=phases,
        profile=profile,
        confidence=confidence,
        notes=tuple(notes),
        paged_state_bytes=paged,
        step_workspace_bytes=step_workspace if confidence in (Confidence.PROBED, Confidence.PROBED_REAL) else 0,
    )
    if result.peak.total > MAX_PEAK_BYTES:  # every table and chart holds bytes as 64-bit integers
        raise PlannerInputError(f"this plan needs {result.peak.total:,} bytes at its peak, beyond any machine "
                                f"(at most {MAX_PEAK_BYTES:,} here): lower the batch size or sequence length")
    return result
