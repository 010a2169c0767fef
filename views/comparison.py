"""The lessons' memory-saving techniques, applied to one model and batch, with no Streamlit
here: what each changes in the scenario, what it costs, its estimated peak, its saving
against the AdamW fp32 baseline, and a measured peak where the run history holds a run of
exactly that scenario.

The techniques and their costs follow ../shared/seeds/ (lesson 1 Adafactor, lesson 2
8-bit Adam with mixed precision, lesson 3 gradient checkpointing and accumulation).
Scenario values are the user-facing names of planner.scenario.scenario_from_values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pandas as pd

from planner.errors import PlannerInputError
from planner.estimate import Estimate, estimate
from planner.finetune import FINETUNE_KEYS, FineTune, Method
from planner.model_shape import ModelShape
from planner.probe.cache import NotProbedYet, stored_only
from planner.scenario import scenario_from_values
from planner.units import format_bytes

# Accumulation keeps the effective batch: micro-batch = batch / k with the largest of
# these k that divides the batch (k = 1 leaves the scenario as it is).
ACCUMULATION_STEPS = (4, 2)
# Values a technique may set; the rest (task, labels, batch, sequence, attention,
# device, engine) come from the sidebar.
TECHNIQUE_KEYS = ("optimizer", "precision", "gradient_checkpointing", "grad_accum")
BASELINE_VALUES = {"optimizer": "adamw", "precision": "fp32", "gradient_checkpointing": False, "grad_accum": 1}
# A run matches a scenario when these agree (device aside: verify measures on the kind it runs on).
MATCH_KEYS = ("task", "num_labels", "batch_size", "seq_len", "target_len", "optimizer", "precision",
              "gradient_checkpointing", "grad_accum", "attn", "engine")

RECOMPUTE_COST = "≈ one extra forward per step (≈ +33% compute: forward ≈ 1/3 of forward+backward)"
ACCUMULATION_COST = "k× more, k× smaller micro-batches per optimizer step (same effective batch, less parallelism)"
OPTIMIZER_APPROX_COST = "an approximation of Adam's statistics"


@dataclass(frozen=True)
class Technique:
    key: str
    label: str
    changes: Mapping[str, object] = field(default_factory=dict)
    accumulate: bool = False  # split the batch into ACCUMULATION_STEPS micro-batches
    cost: str = ""
    lesson: str = ""


TECHNIQUES: tuple[Technique, ...] = (
    Technique("baseline", "AdamW fp32 (baseline)", {}, cost="none: the reference", lesson="all"),
    Technique("adafactor", "Adafactor", {"optimizer": "adafactor"},
              cost=f"{OPTIMIZER_APPROX_COST}: factored second moment, no momentum", lesson="1"),
    Technique("adam8bit", "8-bit Adam", {"optimizer": "adam8bit"},
              cost=f"{OPTIMIZER_APPROX_COST}: block-wise 8-bit quantised states", lesson="2"),
    Technique("bf16", "bf16 mixed precision", {"precision": "bf16-mixed"},
              cost="16-bit rounding in matmuls; autocast copies of the weights", lesson="2"),
    Technique("checkpointing", "Gradient checkpointing", {"gradient_checkpointing": True},
              cost=RECOMPUTE_COST, lesson="3"),
    Technique("accumulation", "Gradient accumulation (same effective batch)", {}, accumulate=True,
              cost=ACCUMULATION_COST, lesson="3"),
    Technique("adam8bit+bf16", "8-bit Adam + bf16 mixed", {"optimizer": "adam8bit", "precision": "bf16-mixed"},
              cost=f"{OPTIMIZER_APPROX_COST}; 16-bit rounding", lesson="2"),
    Technique("checkpointing+accumulation", "Checkpointing + accumulation", {"gradient_checkpointing": True},
              accumulate=True, cost=f"{RECOMPUTE_COST}; {ACCUMULATION_COST}", lesson="3"),
    Technique("all", "8-bit Adam + bf16 + checkpointing + accumulation",
              {"optimizer": "adam8bit", "precision": "bf16-mixed", "gradient_checkpointing": True},
              accumulate=True, cost="all of the above", lesson="2, 3"),
    Technique("adafactor+bf16+checkpointing", "Adafactor + bf16 + checkpointing",
              {"optimizer": "adafactor", "precision": "bf16-mixed", "gradient_checkpointing": True},
              cost=f"{OPTIMIZER_APPROX_COST}; 16-bit rounding; {RECOMPUTE_COST}", lesson="1, 2, 3"),
)
TECHNIQUES_BY_KEY = {t.key: t for t in TECHNIQUES}


def accumulation_steps_for(batch_size: int) -> int:
    return next((k for k in ACCUMULATION_STEPS if batch_size % k == 0 and batch_size > 1), 1)


def accumulation_note(batch_size: int) -> str | None:
    """Why the accumulation rows equal the rows without it, when the batch cannot be split."""
    if accumulation_steps_for(batch_size) > 1:
        return None
    divisors = " or ".join(str(k) for k in sorted(ACCUMULATION_STEPS))
    return (f"A batch of {batch_size} cannot be split into smaller micro-batches, so the accumulation rows run "
            f"{batch_size} × 1 and equal the same rows without accumulation: choose a batch divisible by "
            f"{divisors} to see what accumulation saves.")


def technique_values(base: Mapping[str, object], technique: Technique) -> dict:
    """Scenario values of `technique` on `base` (the sidebar's values; its optimizer,
    precision, checkpointing and accumulation are replaced by the baseline's)."""
    values = {**base, **BASELINE_VALUES, **technique.changes}
    if technique.accumulate:
        k = accumulation_steps_for(int(values["batch_size"]))
        values["grad_accum"] = k
        values["batch_size"] = int(values["batch_size"]) // k
    return values


def technique_estimate(shape: ModelShape, base: Mapping[str, object], technique: Technique) -> Estimate:
    return estimate(shape, scenario_from_values(**technique_values(base, technique)))


def finetune_of(values: Mapping[str, object]) -> FineTune | None:
    """The fine-tuning method scenario values name (FINETUNE_KEYS; absent: full fine-tuning, as
    the run history keeps full runs), with only the settings that method reads and alpha
    resolved, so equal methods compare equal; None when they do not parse."""
    given = {k: values[k] for k in FINETUNE_KEYS if values.get(k) is not None}
    try:
        method = scenario_from_values(task="causal-lm", batch_size=1, seq_len=1, **given).finetune
    except PlannerInputError:
        return None
    if method.method is Method.FULL:
        return FineTune()
    default = FineTune()
    quantised = method.method is Method.QLORA
    return FineTune(method.method, method.lora_r, method.alpha, method.lora_dropout, method.lora_targets,
                    method.quant_type if quantised else default.quant_type,
                    method.double_quant if quantised else default.double_quant)


def matching_run(records: Iterable, model_name: str, config: dict | None, values: Mapping[str, object]):
    """The newest finished-ok run (RunRecord, newest first in `records`) of this model and
    exactly these scenario values, fine-tuning method included; None without one. `config`
    None: match on the name alone."""
    wanted = {k: values.get(k) for k in MATCH_KEYS}
    wanted["engine"] = wanted["engine"] or "accelerate"
    wanted_method = finetune_of(values)
    for record in records:
        if record.status.value != "ok" or record.model_name != model_name or not record.measurement:
            continue
        if config is not None and record.scenario.get("model_config") != config:
            continue
        scenario = record.scenario
        got = {k: scenario.get(k) for k in MATCH_KEYS}
        got["engine"] = got["engine"] or "accelerate"
        if _same(got, wanted) and finetune_of(scenario) == wanted_method:
            return record
    return None


def _same(a: Mapping, b: Mapping) -> bool:
    for key in MATCH_KEYS:
        x, y = a.get(key), b.get(key)
        if isinstance(x, bool) or isinstance(y, bool):
            if bool(x) != bool(y):
                return False
        elif str(x) != str(y):
            return False
    return True


class _EstimatedPeak:
    """A compared row's estimated peak: None where the estimate refused the plan."""

    estimate: Estimate | None

    @property
    def peak_bytes(self) -> int | None:
        return None if self.estimate is None else self.estimate.peak_bytes


@dataclass(frozen=True)
class TechniqueRow(_EstimatedPeak):
    technique: Technique
    values: dict  # scenario values
    estimate: Estimate | None
    error: str | None  # why it could not be estimated
    measured_peak_bytes: int | None
    measured_mode: str | None
    measured_run_id: str | None


def compare_techniques(shape: ModelShape, base: Mapping[str, object], records: Iterable = (),
                       config: dict | None = None, techniques: Iterable[Technique] = TECHNIQUES) -> list[TechniqueRow]:
    records = list(records)
    rows = []
    for technique in techniques:
        values = technique_values(base, technique)
        rows.append(TechniqueRow(technique, values, *_estimated_and_measured(shape, values, records, config)))
    return rows


def _estimated_and_measured(shape: ModelShape, values: dict, records: list, config: dict | None) -> tuple:
    """(estimate or None, its one-line refusal or None, measured peak, mode, run id) of one
    compared plan: a row's fields after its subject and values."""
    try:
        result, error = estimate(shape, scenario_from_values(**values)), None
    except PlannerInputError as problem:
        result, error = None, str(problem)
    run = matching_run(records, shape.name, config, values)
    if run is None:
        return result, error, None, None, None
    return result, error, run.measurement.get("peak_bytes"), run.mode.value, run.id


def saving_pct(baseline_bytes: int | None, peak: int | None) -> float | None:
    """Saving against the baseline, percent of the baseline's peak (positive: less memory)."""
    if baseline_bytes is None or peak is None or baseline_bytes == 0:
        return None
    return (baseline_bytes - peak) / baseline_bytes * 100.0


def comparison_table(rows: list[TechniqueRow], capacity_bytes: int | None = None) -> pd.DataFrame:
    """One row per technique: raw bytes and formatted sizes side by side."""
    baseline = next((r.peak_bytes for r in rows if r.technique.key == "baseline"), None)
    table = pd.DataFrame({
        "technique": [r.technique.label for r in rows],
        "micro-batch × accumulation": [f"{r.values['batch_size']} × {r.values['grad_accum']}" for r in rows],
        "estimated peak (bytes)": pd.array([r.peak_bytes for r in rows], dtype="Int64"),
        "estimated peak": [format_bytes(r.peak_bytes) if r.error is None else r.error for r in rows],
        "saving vs baseline (%)": [saving_pct(baseline, r.peak_bytes) for r in rows],
        "measured peak (bytes)": pd.array([r.measured_peak_bytes for r in rows], dtype="Int64"),
        "measured peak": [format_bytes(r.measured_peak_bytes) if r.measured_peak_bytes is not None else "no run"
                          for r in rows],
        "measured by": [r.measured_mode or "" for r in rows],
        "cost": [r.technique.cost for r in rows],
        "lesson": [r.technique.lesson for r in rows],
    })
    if capacity_bytes is not None:
        table.insert(4, "fits", [None if r.peak_bytes is None else r.peak_bytes <= capacity_bytes for r in rows])
    return table


# --- full fine-tuning, LoRA and QLoRA side by side ------------------------------------------

METHOD_LABELS = {Method.FULL: "Full fine-tuning", Method.LORA: "LoRA", Method.QLORA: "QLoRA"}
LORA_SETTING_KEYS = tuple(k for k in FINETUNE_KEYS if k != "finetune")


def finetune_text(method: FineTune) -> str:
    """The method and the settings it reads, as one line: `LoRA r 16, alpha 32, ...`."""
    if not method.uses_adapters:
        return "full fine-tuning (every parameter trains)"
    text = (f"{METHOD_LABELS[method.method]} r {method.lora_r}, alpha {method.alpha:g}, dropout "
            f"{method.lora_dropout:g}, targets {method.targets_text}")
    if method.method is Method.QLORA:
        text += f", 4-bit {method.quant_type}, double quantisation {'on' if method.double_quant else 'off'}"
    return text


@dataclass(frozen=True)
class AdapterSummary:
    """What LoRA changes in a plan: how much trains, and what the frozen base weighs."""

    trainable_parameters: int
    base_parameters: int  # the model's own, without adapters
    frozen_weight_bytes: int
    quantized: bool
    settings: str

    @property
    def trainable_percent(self) -> float:
        return 100.0 * self.trainable_parameters / self.base_parameters if self.base_parameters else 0.0


def adapter_summary(result: Estimate) -> AdapterSummary | None:
    """The LoRA / QLoRA figures of an estimate; None for full fine-tuning."""
    method = result.scenario.finetune
    if not method.uses_adapters or result.trainable_parameters is None:
        return None
    return AdapterSummary(result.trainable_parameters, result.num_parameters, result.frozen_weight_bytes,
                          method.method is Method.QLORA, finetune_text(method))


@dataclass(frozen=True)
class MethodRow(_EstimatedPeak):
    method: Method
    values: dict  # scenario values, FINETUNE_KEYS included
    estimate: Estimate | None
    error: str | None  # the estimate's refusal, one line
    measured_peak_bytes: int | None
    measured_mode: str | None
    measured_run_id: str | None


def method_values(base: Mapping[str, object], settings: Mapping[str, object], method: Method) -> dict:
    """The sidebar's scenario (`base`) fine-tuned by `method`, with the sidebar's LoRA settings
    (`settings`: LORA_SETTING_KEYS) for LoRA and QLoRA."""
    values = {k: v for k, v in base.items() if k not in FINETUNE_KEYS} | {"finetune": method.value}
    if method is not Method.FULL:
        values |= {k: settings[k] for k in LORA_SETTING_KEYS if k in settings}
    return values


def compare_methods(shape: ModelShape, base: Mapping[str, object], settings: Mapping[str, object],
                    records: Iterable = (), config: dict | None = None) -> list[MethodRow]:
    """Full fine-tuning, LoRA and QLoRA on the same model and scenario, each with its
    estimate or its one-line refusal, and the measured peak of a finished run of exactly
    that plan in `records`. LoRA and QLoRA estimates probe the model's step the first time
    (seconds to a minute each, planner.probe.cache): callers ask for them deliberately."""
    records = list(records)
    rows = []
    for method in Method:
        values = method_values(base, settings, method)
        rows.append(MethodRow(method, values, *_estimated_and_measured(shape, values, records, config)))
    return rows


def method_table(rows: list[MethodRow], capacity_bytes: int | None = None) -> pd.DataFrame:
    """One row per method: the estimate's totals by category (raw bytes; the peak formatted
    beside it), trainable parameters and frozen weights, the measured peak; a refused method
    shows its refusal in place of numbers."""
    def of(row: MethodRow, field_name: str) -> int | None:
        return None if row.estimate is None else getattr(row.estimate, field_name)

    def trainable(row: MethodRow) -> int | None:
        if row.estimate is None:
            return None
        return row.estimate.num_parameters if row.estimate.trainable_parameters is None \
            else row.estimate.trainable_parameters

    table = pd.DataFrame({
        "method": [METHOD_LABELS[r.method] for r in rows],
        "settings": [_settings_text(r.values) for r in rows],
        "weights (bytes)": pd.array([of(r, "weights_bytes") for r in rows], dtype="Int64"),
        "gradients (bytes)": pd.array([of(r, "gradients_bytes") for r in rows], dtype="Int64"),
        "optimizer state (bytes)": pd.array([of(r, "optimizer_state_bytes") for r in rows], dtype="Int64"),
        "activations (bytes)": pd.array([of(r, "activations_bytes") for r in rows], dtype="Int64"),
        "peak (bytes)": pd.array([r.peak_bytes for r in rows], dtype="Int64"),
        "peak": [format_bytes(r.peak_bytes) if r.error is None else r.error for r in rows],
        "trainable parameters": pd.array([trainable(r) for r in rows], dtype="Int64"),
        "frozen weights (bytes)": pd.array([of(r, "frozen_weight_bytes") for r in rows], dtype="Int64"),
        "measured peak (bytes)": pd.array([r.measured_peak_bytes for r in rows], dtype="Int64"),
        "measured peak": [format_bytes(r.measured_peak_bytes) if r.measured_peak_bytes is not None else "no run"
                          for r in rows],
        "measured by": [r.measured_mode or "" for r in rows],
    })
    if capacity_bytes is not None:
        table.insert(8, "fits", [None if r.peak_bytes is None else r.peak_bytes <= capacity_bytes for r in rows])
    return table


def _settings_text(values: Mapping[str, object]) -> str:
    method = finetune_of(values)
    return "" if method is None else finetune_text(method)


# Batch sizes for the memory-vs-batch chart: powers of two from 1.
CHART_BATCH_LIMIT = 4096  # the largest batch "peak against batch size" draws


def batch_sizes_for_chart(largest: int | None, at_least: int = 64, at_most: int = CHART_BATCH_LIMIT) -> list[int]:
    """Powers of two up to twice the largest batch that fits (at least `at_least`, at most `at_most`)."""
    top = max(at_least, 2 * largest if largest else at_least)
    top = min(top, at_most)
    sizes, b = [], 1
    while b <= top:
        sizes.append(b)
        b *= 2
    return sizes


CHART_BATCH_SIZES = tuple(batch_sizes_for_chart(None, at_least=CHART_BATCH_LIMIT))  # every size a chart may show


def series_within(series: Mapping[str, list[tuple[int, int | None]]],
                  unprobed: Iterable[tuple[Technique, tuple[int, ...]]], sizes: Iterable[int],
                  ) -> tuple[dict[str, list[tuple[int, int | None]]], tuple[tuple[Technique, tuple[int, ...]], ...]]:
    """memory_vs_batch_known's answer for more sizes, cut to `sizes`: each line's points there,
    each left-out technique with its missing sizes there (a line or a technique with none there
    is dropped)."""
    wanted = set(sizes)
    within = {label: [point for point in points if point[0] in wanted] for label, points in series.items()}
    left_out = tuple((technique, kept) for technique, missing in unprobed
                     if (kept := tuple(b for b in missing if b in wanted)))
    return {label: points for label, points in within.items() if points}, left_out


CHART_TECHNIQUES = tuple(t for t in TECHNIQUES if t.key != "accumulation")


def chart_base(base: Mapping[str, object]) -> tuple:
    """What memory_vs_batch's series follow from in `base`, as a hashable key: every technique
    replaces the optimizer, precision, checkpointing and accumulation with the baseline's and
    every point its batch size, so a change of those alone draws the same lines."""
    return tuple(sorted((k, v) for k, v in {**base, **BASELINE_VALUES}.items() if k != "batch_size"))


def memory_vs_batch(shape: ModelShape, base: Mapping[str, object], batch_sizes: Iterable[int],
                    techniques: Iterable[Technique] = CHART_TECHNIQUES) -> dict[str, list[tuple[int, int | None]]]:
    """technique label -> [(effective batch, peak bytes or None where it cannot be estimated)]."""
    sizes = tuple(batch_sizes)
    return {technique.label: _technique_points(shape, base, sizes, technique) for technique in techniques}


def memory_vs_batch_known(shape: ModelShape, base: Mapping[str, object], batch_sizes: Iterable[int],
                          techniques: Iterable[Technique] = CHART_TECHNIQUES,
                          ) -> tuple[dict[str, list[tuple[int, int | None]]], tuple[tuple[Technique, tuple[int, ...]], ...]]:
    """(memory_vs_batch's series with only the points whose probe tables are already known,
    each technique with the batch sizes left out because drawing them would probe the model
    first). Nothing is probed: a new model's chart shows at once what is known, and batch 1 is
    a probe class of its own (planner.probe.cache), so a line may start at batch 2."""
    sizes = tuple(batch_sizes)
    series, unprobed = {}, []
    with stored_only():
        for technique in techniques:
            points, missing = [], []
            for b in sizes:
                try:
                    points.extend(_technique_points(shape, base, (b,), technique))
                except NotProbedYet:
                    missing.append(b)
            if points:
                series[technique.label] = points
            if missing:
                unprobed.append((technique, tuple(missing)))
    return series, tuple(unprobed)


def unprobed_text(unprobed: Iterable[tuple[Technique, tuple[int, ...]]]) -> str:
    """What memory_vs_batch_known left out, in words: whole techniques, then lines drawn from batch 2."""
    whole = [technique.label for technique, missing in unprobed if missing != (1,)]
    batch_one = [technique.label for technique, missing in unprobed if missing == (1,)]
    parts = ([", ".join(whole)] if whole else []) + ([f"batch 1 of {', '.join(batch_one)}"] if batch_one else [])
    return "; ".join(parts)


def _technique_points(shape: ModelShape, base: Mapping[str, object], sizes: tuple[int, ...],
                      technique: Technique) -> list[tuple[int, int | None]]:
    points = []
    for b in sizes:
        try:
            points.append((b, technique_estimate(shape, {**base, "batch_size": b}, technique).peak_bytes))
        except PlannerInputError:
            points.append((b, None))
    return points
