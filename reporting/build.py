"""The report's content (build_report) and its four renderings (render_report).

All user-supplied text (model and file names, run reasons, notes) is escaped for the
channel it lands in (views.escaping): html.escape in HTML, Plotly's pseudo-HTML in the
charts (by the figure builders), every markup character in Markdown, and formula prefixes
(= + - @ tab CR) in CSV cells.
Raw bytes are kept in every format; formatted sizes (binary units) sit beside them.
With more than one GPU every format adds a "Multiple GPUs" section (reporting.multi_gpu).
"""

from __future__ import annotations

import html
import io
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from planner.device_fit import reserved_check
from planner.errors import PlannerInputError
from planner.estimate import Estimate, estimate
from planner.finetune import FINETUNE_KEYS
from planner.fit import FitLimits, fit_limits
from planner.gpus import GPUS, GpuSpec, capability_values, capacity_bytes_from_gib
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate, parallel_estimate
from planner.scenario import as_int, scenario_from_values
from planner.strategy import MAX_DEVICES, ParallelPlan, Strategy, parse_strategy
from planner.units import format_bytes
from planner.verdict import (
    DeviceVerdict,
    room_for_plans,
    searchable_budget_bytes,
    tensor_budget_bytes,
)
from reporting.multi_gpu import (
    DEFAULT_RUN_STEPS,
    MultiGpuSection,
    csv_sections,
    intro_lines,
    memory_figure,
    multi_gpu_section,
    section_json,
)
from views.breakdown import breakdown_table, verdict_for
from views.comparison import (
    METHOD_LABELS,
    MethodRow,
    TechniqueRow,
    accumulation_note,
    adapter_summary,
    batch_sizes_for_chart,
    compare_techniques,
    comparison_table,
    finetune_text,
    memory_vs_batch,
    method_table,
    saving_pct,
)
from views.escaping import csv_cell
from views.figures import (
    estimate_vs_measured_scatter,
    memory_vs_batch_figure,
    phase_breakdown_figure,
    technique_bars_figure,
)
from views.markdown_table import float_cell, markdown_cell, markdown_table
from views.verify_results import history_table, scatter_points

FORMATS = ("html", "md", "csv", "json")
SCENARIO_KEYS = ("task", "num_labels", "batch_size", "seq_len", "target_len", "optimizer", "precision",
                 "gradient_checkpointing",
                 "grad_accum", "attn", "device", "engine", "cuda_alloc_conf", "compute_capability",
                 *FINETUNE_KEYS)


@dataclass(frozen=True)
class Report:
    generated_at: str  # ISO 8601, UTC
    shape: ModelShape
    values: dict  # the plan's scenario values (user-facing names)
    estimate: Estimate
    capacity_bytes: int
    gpu_label: str
    gpu_count: int
    limits: FitLimits
    techniques: list[TechniqueRow]
    runs: pd.DataFrame  # verify_results.history_table of this model's runs
    batch_series: dict
    fits: pd.DataFrame  # the fit finder's best options for this plan's effective batch
    fits_nearest: pd.DataFrame  # when none fits: the nearest plans and how far over each is
    fits_left_out: tuple[str, ...]  # fine-tuning methods the finder did not search, and why
    multi_gpu: MultiGpuSection | None = None  # None with one GPU
    per_device: ParallelEstimate | None = None  # one GPU's share under the plan's strategy; None with one GPU
    gpu: GpuSpec | None = None  # the preset's GPU (its CUDA overheads); None for a size only
    parallel: ParallelPlan = ParallelPlan()
    methods: list[MethodRow] | None = None  # full, LoRA and QLoRA side by side, when computed

    @property
    def verdict(self) -> DeviceVerdict:
        return verdict_for(self.shape, self.per_gpu, self.capacity_bytes, self.gpu, self.parallel)

    @property
    def per_gpu(self) -> Estimate | ParallelEstimate:
        """What one GPU holds: the plan on one device, or its share under the strategy."""
        return self.estimate if self.per_device is None else self.per_device

    @property
    def title(self) -> str:
        return f"Training memory plan: {self.shape.name}"


def build_report(shape: ModelShape, values: Mapping[str, object], capacity_bytes: int, gpu_label: str,
                 gpu_count: int = 1, records: Iterable = (), config: dict | None = None,
                 run_steps: int = DEFAULT_RUN_STEPS, local_sgd_steps: int | None = None,
                 strategy: Strategy = Strategy.DDP, gpu: GpuSpec | None = None,
                 search_adapters: bool = True, methods: list[MethodRow] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Report:
    """Everything a report shows, computed once. `records`: RunRecords (newest first) whose
    runs of this model are listed and matched to the techniques. With `gpu_count` > 1 the
    plan is per GPU under `strategy`, and the Multiple GPUs section compares the strategies,
    and local SGD over `run_steps` optimizer steps (its K values with `local_sgd_steps` added).
    `search_adapters`: What fits searches LoRA and QLoRA plans too (their first search probes
    the model's step). `values` may name a fine-tuning method (FINETUNE_KEYS): the plan is
    planned with it, the technique rows and the chart fine-tune in full as on the Techniques
    page. `methods`: views.comparison.compare_methods' rows, shown when given. `progress(done,
    total)`: told as What fits' search goes through its combinations (planner.fit.find_fits;
    on CUDA a 7B model's first search replays the caching allocator for a minute or more)."""
    # The plan takes the kernels of the GPU it is judged on (planner.gpus.scenario_on).
    values = {k: v for k, v in values.items() if k in SCENARIO_KEYS and k != "compute_capability"} \
        | capability_values(str(values.get("device") or "cuda"), gpu)
    full = {k: v for k, v in values.items() if k not in FINETUNE_KEYS}
    scenario = scenario_from_values(**values)
    result = estimate(shape, scenario)
    records = [r for r in records if r.model_name == shape.name]
    parallel = ParallelPlan(gpu_count, strategy if gpu_count > 1 else Strategy.SINGLE)
    per_device = parallel_estimate(shape, scenario, parallel, result) if parallel.distributed else None
    # The searches stop where the verdict does: on CUDA, the room the overheads leave.
    budget = tensor_budget_bytes(capacity_bytes, scenario.device, gpu, parallel)
    check = reserved_check(capacity_bytes, scenario.device, gpu)
    limits = fit_limits(shape, scenario, budget, plan=parallel, check=check)
    try:
        searchable_budget_bytes(capacity_bytes, scenario.device, gpu, parallel)
        fits, nearest, left_out = _fit_tables(shape, scenario, capacity_bytes, gpu_count, parallel.strategy,
                                              room_for_plans(capacity_bytes, scenario.device, gpu), search_adapters,
                                              check, progress)
    except PlannerInputError as error:  # the overheads alone fill the GPU: nothing to search
        fits, nearest, left_out = pd.DataFrame(), pd.DataFrame(), (str(error),)
    return Report(
        generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        shape=shape, values=dict(values), estimate=result, capacity_bytes=capacity_bytes, gpu_label=gpu_label,
        gpu_count=gpu_count, limits=limits,
        techniques=compare_techniques(shape, full, records, config),
        runs=history_table(records),
        batch_series=memory_vs_batch(shape, full, batch_sizes_for_chart(limits.batch_size)),
        fits=fits, fits_nearest=nearest, fits_left_out=left_out,
        multi_gpu=multi_gpu_section(shape, scenario, result, gpu_count, capacity_bytes, records, config,
                                    run_steps, local_sgd_steps),
        per_device=per_device, gpu=gpu, parallel=parallel, methods=methods,
    )


FIT_ROWS_SHOWN = 10


def _fit_tables(shape: ModelShape, scenario, capacity_bytes: int, gpu_count: int, strategy: Strategy,
                room_for, search_adapters: bool = True, check=None, progress: Callable[[int, int], None] | None = None
                ) -> tuple[pd.DataFrame, pd.DataFrame, tuple[str, ...]]:
    """The fit finder's best options (planner.fit) for the plan's effective batch and sequence,
    ranked by the fewest and safest changes to the plan; the nearest plans when none fits;
    the methods it left out and why."""
    from planner.fit import FitTarget, best_options_with_max_seq_len, find_fits
    from planner.gpus import nearest_gpu
    from views.fit_table import fit_rows, nearest_rows

    target = FitTarget(scenario.seq_len, effective_batch=scenario.batch_size * scenario.grad_accum_steps * gpu_count)
    result = find_fits(shape, scenario, capacity_bytes, target, nearest_gpu(capacity_bytes), gpu_count,
                       with_max_seq_len=False, strategy=strategy, room_for=room_for, lora=search_adapters,
                       check=check, progress=progress)
    best = best_options_with_max_seq_len(shape, result, FIT_ROWS_SHOWN, check)
    unsearched = () if search_adapters else ("LoRA and QLoRA plans not searched (What fits' checkbox)",)
    return pd.DataFrame(fit_rows(best)), pd.DataFrame(nearest_rows(result)), (*unsearched, *result.left_out)


# --- renderings ---------------------------------------------------------------------------

def _plan_json(report: Report) -> dict:
    verdict = report.verdict
    per_device = report.per_device.to_json() if report.per_device is not None else {}
    return {
        "estimate": {**report.estimate.to_json(), **per_device},
        "gpu": report.gpu_label, "gpu_count": report.gpu_count,
        "capacity_bytes": report.capacity_bytes, "total_capacity_bytes": report.capacity_bytes * report.gpu_count,
        **verdict.to_json(),
        "largest_batch_size": report.limits.batch_size, "largest_seq_len": report.limits.seq_len,
    }


def to_json(report: Report) -> str:
    baseline = next((r.peak_bytes for r in report.techniques if r.technique.key == "baseline"), None)
    data = {
        "title": report.title, "generated_at": report.generated_at,
        "model": {"name": report.shape.name, "architecture": report.shape.architecture,
                  "num_parameters": report.shape.num_parameters},
        "scenario": report.values,
        "plan": _plan_json(report),
        "techniques": [{
            "key": r.technique.key, "label": r.technique.label, "scenario": r.values,
            "estimated_peak_bytes": r.peak_bytes, "error": r.error,
            "saving_vs_baseline_pct": saving_pct(baseline, r.peak_bytes),
            "measured_peak_bytes": r.measured_peak_bytes, "measured_mode": r.measured_mode,
            "measured_run_id": r.measured_run_id, "cost": r.technique.cost,
        } for r in report.techniques],
        "what_fits": json.loads(report.fits.to_json(orient="records")),
        "what_fits_nearest": json.loads(report.fits_nearest.to_json(orient="records")),
        "what_fits_left_out": list(report.fits_left_out),
        "runs": json.loads(report.runs.to_json(orient="records")),
    }
    if report.methods is not None:
        data["methods"] = [{
            "method": r.method.value, "label": METHOD_LABELS[r.method], "scenario": r.values, "error": r.error,
            "estimate": None if r.estimate is None else r.estimate.to_json(),
            "measured_peak_bytes": r.measured_peak_bytes, "measured_mode": r.measured_mode,
            "measured_run_id": r.measured_run_id,
        } for r in report.methods]
    if report.multi_gpu is not None:
        data["multi_gpu"] = section_json(report.multi_gpu)
    return json.dumps(data, indent=2)


def _plan_table(report: Report) -> pd.DataFrame:
    table = breakdown_table(report.per_gpu)
    return table.rename(columns={"size": "size (binary units)"})


def _technique_table(report: Report) -> pd.DataFrame:
    return comparison_table(report.techniques, report.capacity_bytes)


METHODS_HEADING = "Full fine-tuning, LoRA and QLoRA"
METHODS_INTRO = ("The plan's scenario three ways, with its LoRA settings: the estimate's totals by category; "
                 "a method the planner refuses shows why in place of numbers.")


def _method_table(report: Report) -> pd.DataFrame:
    return method_table(report.methods, report.capacity_bytes)


def _accumulation_note(report: Report) -> str | None:
    return accumulation_note(report.estimate.scenario.batch_size)


def _summary_lines(report: Report) -> list[str]:
    verdict = report.verdict
    s = report.estimate.scenario
    limits = report.limits
    lines = [
        f"Model: {report.shape.name} ({report.shape.architecture}, {report.shape.num_parameters:,} parameters)",
        (f"Scenario: {s.task.value}, batch {s.batch_size} × {s.seq_len:,} tokens, {s.optimizer.value}, "
         f"{s.precision.value}, checkpointing {'on' if report.values.get('gradient_checkpointing') else 'off'}, "
         f"accumulation {s.grad_accum_steps}, attention {s.attention.value}, device {s.device.value}"),
        f"Fine-tuning: {finetune_text(s.finetune)}",
        *_adapter_lines(report.estimate),
        f"GPU: {report.gpu_label} × {report.gpu_count} ({format_bytes(report.capacity_bytes)} each; "
        + (f"{report.per_device.plan.strategy.value}, " if report.per_device is not None else "")
        + "the plan is per GPU"
        + (f"; PYTORCH_CUDA_ALLOC_CONF={s.cuda_alloc_conf}" if s.cuda_alloc_conf else "") + ")",
        verdict.headline,
        *_overhead_lines(verdict),
        (f"Peak phase: {report.estimate.peak_phase.value}: {report.estimate.peak_reason}."
         if report.per_device is None else f"Peak phase per GPU: {report.per_device.peak.phase.value}."),
        f"Largest batch size that fits: {limits.batch_size if limits.batch_size is not None else 'none'}; "
        f"largest sequence length: {limits.seq_len if limits.seq_len is not None else 'none'}"
        + (" (the model's positions)" if limits.seq_len_capped_by_positions else ""),
    ]
    return lines + [f"Note: {note}" for note in report.estimate.notes]


def _adapter_lines(result: Estimate) -> list[str]:
    """With LoRA or QLoRA: how much trains and what the frozen base weighs."""
    summary = adapter_summary(result)
    if summary is None:
        return []
    return [f"Trainable parameters: {summary.trainable_parameters:,} ({summary.trainable_percent:.3f}% of the "
            f"model's {summary.base_parameters:,}); frozen weights: {format_bytes(summary.frozen_weight_bytes)} "
            f"({summary.frozen_weight_bytes:,} bytes)"]


def _overhead_lines(verdict: DeviceVerdict) -> list[str]:
    """On CUDA: allocated against reserved, and each overhead with its source."""
    if verdict.overheads is None:
        return []
    reserved = (format_bytes(verdict.reserved_peak_bytes)
                + (" (the allocator replayed with expandable segments)" if verdict.expandable_segments else "")
                if verdict.reserved_peak_bytes is not None else f"not replayed ({verdict.caveat})")
    lines = [f"Allocated peak: {format_bytes(verdict.allocated_peak_bytes)} (live tensors "
             f"{format_bytes(verdict.peak_bytes)} + torch's allocator blocks {format_bytes(verdict.allocator_blocks_bytes)}); "
             f"reserved peak: {reserved}; usable capacity: {format_bytes(verdict.usable_capacity_bytes)}"]
    lines += [f"CUDA overhead: {item.name}, {format_bytes(item.bytes)} ({item.kind.value}: {item.source})"
              for item in (*verdict.overheads.allocator_items, *verdict.overheads.items)]
    return lines


def to_markdown(report: Report) -> str:
    parts = [f"# {markdown_cell(report.title)}", "", f"Generated {report.generated_at}.", ""]
    parts += [f"- {markdown_cell(line)}" for line in _summary_lines(report)]
    parts += ["", "## Live at the peak", "", markdown_table(_plan_table(report)),
              "", "## Techniques", "", markdown_table(_technique_table(report)),
              *(["", markdown_cell(note)] if (note := _accumulation_note(report)) else []),
              *(["", f"## {METHODS_HEADING}", "", METHODS_INTRO, "", markdown_table(_method_table(report))]
                if report.methods is not None else []),
              "", f"## {WHAT_FITS_HEADING}", "", *_md_what_fits(report), ""]
    if report.multi_gpu is not None:
        parts += _md_multi_gpu(report)
    parts += ["## Verification runs", ""]
    parts.append(markdown_table(report.runs) if not report.runs.empty else "No verification runs recorded for this model.")
    return "\n".join(parts) + "\n"


WHAT_FITS_HEADING = "What fits (same effective batch; fewest and safest changes to this plan first)"
NOTHING_FITS = "No technique combination fits this GPU."
NEAREST_INTRO = "The nearest plans, and how far over the capacity per GPU each is:"


def _md_what_fits(report: Report) -> list[str]:
    if not report.fits.empty:
        parts = [markdown_table(report.fits)]
    elif not report.fits_nearest.empty:
        parts = [markdown_cell(f"{NOTHING_FITS} {NEAREST_INTRO}"), "", markdown_table(report.fits_nearest)]
    else:
        parts = [NOTHING_FITS]
    return parts + [item for line in report.fits_left_out for item in ("", markdown_cell(line))]


MULTI_GPU_HEADINGS = ("Memory per GPU, by strategy", "Traffic per optimizer step, by strategy",
                      "DDP against local SGD", "Distributed runs of this model")
NO_DISTRIBUTED_RUNS = "No distributed runs of this model in the run history."


def _multi_gpu_heading(report: Report) -> str:
    return f"Multiple GPUs ({report.multi_gpu.num_devices} × {report.gpu_label})"


def _md_multi_gpu(report: Report) -> list[str]:
    section = report.multi_gpu
    intro = intro_lines(section, report.estimate.scenario)
    tables = (section.memory, section.traffic, section.local_sgd_rows)
    parts = [f"## {markdown_cell(_multi_gpu_heading(report))}", "", *[markdown_cell(line) for line in intro[:1]], ""]
    notes = (intro[1:2], intro[2:3], intro[3:4])
    for heading, table, note in zip(MULTI_GPU_HEADINGS, tables, notes):
        parts += [f"### {heading}", "", *[markdown_cell(line) for line in note], "", markdown_table(table), ""]
    parts += [f"### {MULTI_GPU_HEADINGS[3]}", "",
              markdown_table(section.measured) if not section.measured.empty else NO_DISTRIBUTED_RUNS, ""]
    return parts


def to_csv(report: Report) -> str:
    """One table, a `section` column telling the plan's rows, the techniques' and the runs' apart."""
    sections = [_plan_table(report).assign(section="plan"), _technique_table(report).assign(section="techniques")]
    if report.methods is not None:
        sections.append(_method_table(report).assign(section="methods"))
    if not report.fits.empty:
        sections.append(report.fits.assign(section="what fits"))
    if not report.fits_nearest.empty:
        sections.append(report.fits_nearest.assign(section="what fits: nearest"))
    if report.multi_gpu is not None:
        sections += csv_sections(report.multi_gpu)
    if not report.runs.empty:
        sections.append(report.runs.assign(section="runs"))
    # Nullable integers, so bytes stay integers where other sections leave the column empty.
    sections = [t.astype({c: "Int64" for c in t.columns if pd.api.types.is_integer_dtype(t[c])}) for t in sections]
    table = pd.concat(sections, ignore_index=True)
    table = table[["section", *[c for c in table.columns if c != "section"]]]
    table = table.map(csv_cell)  # a model name "=HYPERLINK(...)" must stay text in a spreadsheet
    buffer = io.StringIO()
    table.to_csv(buffer, index=False)
    return buffer.getvalue()


def figures(report: Report) -> list:
    rows = report.techniques
    found = [
        phase_breakdown_figure(report.per_gpu, report.capacity_bytes),
        memory_vs_batch_figure(report.batch_series, report.capacity_bytes,
                               title=f"Peak against batch size at {report.estimate.scenario.seq_len:,} tokens"),
        technique_bars_figure([r.technique.label for r in rows], [r.peak_bytes for r in rows],
                              [r.measured_peak_bytes for r in rows], report.capacity_bytes),
    ]
    estimated, measured, labels = scatter_points(report.runs)
    if estimated:
        found.append(estimate_vs_measured_scatter(estimated, measured, labels))
    return found


def to_html(report: Report) -> str:
    e = html.escape
    charts = []
    for i, figure in enumerate(figures(report)):
        # plotly.js once, inline, in the first chart: the file opens with no network.
        charts.append(figure.to_html(full_html=False, include_plotlyjs=(i == 0), config={"responsive": True}))
    runs = (_html_table(report.runs)
            if not report.runs.empty else "<p>No verification runs recorded for this model.</p>")
    body = "\n".join([
        f"<h1>{e(report.title)}</h1>",
        f"<p class='muted'>Generated {e(report.generated_at)}. Sizes in binary units (GiB = 2<sup>30</sup> bytes).</p>",
        "<ul>" + "".join(f"<li>{e(line)}</li>" for line in _summary_lines(report)) + "</ul>",
        "<h2>Live at the peak</h2>",
        _plan_table(report).to_html(index=False, escape=True, border=0, classes="table"),
        charts[0], charts[1],
        "<h2>Techniques</h2>",
        _html_table(_technique_table(report)),
        *([f"<p class='muted'>{e(note)}</p>"] if (note := _accumulation_note(report)) else []),
        charts[2],
        *([f"<h2>{e(METHODS_HEADING)}</h2>", f"<p class='muted'>{e(METHODS_INTRO)}</p>",
           _html_table(_method_table(report))] if report.methods is not None else []),
        f"<h2>{e(WHAT_FITS_HEADING)}</h2>",
        (_html_table(report.fits) if not report.fits.empty
         else f"<p>{e(NOTHING_FITS)} {e(NEAREST_INTRO)}</p>" + _html_table(report.fits_nearest)
         if not report.fits_nearest.empty else f"<p>{e(NOTHING_FITS)}</p>"),
        *[f"<p class='muted'>{e(line)}</p>" for line in report.fits_left_out],
        *(_html_multi_gpu(report) if report.multi_gpu is not None else []),
        "<h2>Verification runs</h2>", runs, *charts[3:],
    ])
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#1f2937}"
             ".table{border-collapse:collapse;font-size:13px;margin:1em 0}"
             ".table td,.table th{border-bottom:1px solid #e5e7eb;padding:4px 8px;text-align:left}"
             ".muted{color:#6b7280}")
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{e(report.title)}</title>"
            f"<style>{style}</style></head><body>\n{body}\n</body></html>\n")


def _html_table(table: pd.DataFrame) -> str:
    # na_rep misses pandas' NA in nullable integer columns: blank those by hand.
    table = table.assign(**{c: table[c].astype(object).where(table[c].notna(), "")
                            for c in table.columns if isinstance(table[c].dtype, pd.Int64Dtype)})
    return table.to_html(index=False, escape=True, na_rep="", border=0, classes="table", float_format=float_cell)


def _html_multi_gpu(report: Report) -> list[str]:
    e = html.escape
    section = report.multi_gpu
    intro = intro_lines(section, report.estimate.scenario)
    # plotly.js is already inline in the first chart of the page.
    chart = memory_figure(section).to_html(full_html=False, include_plotlyjs=False, config={"responsive": True})
    measured = (_html_table(section.measured) if not section.measured.empty
                else f"<p>{e(NO_DISTRIBUTED_RUNS)}</p>")
    return [
        f"<h2>{e(_multi_gpu_heading(report))}</h2>", f"<p>{e(intro[0])}</p>",
        f"<h3>{e(MULTI_GPU_HEADINGS[0])}</h3>", f"<p class='muted'>{e(intro[1])}</p>", _html_table(section.memory),
        chart,
        f"<h3>{e(MULTI_GPU_HEADINGS[1])}</h3>", f"<p class='muted'>{e(intro[2])}</p>", _html_table(section.traffic),
        f"<h3>{e(MULTI_GPU_HEADINGS[2])}</h3>", f"<p class='muted'>{e(intro[3])}</p>",
        _html_table(section.local_sgd_rows),
        f"<h3>{e(MULTI_GPU_HEADINGS[3])}</h3>", measured,
    ]


def export_file_name(model_name: str, fmt: str) -> str:
    """A download/export file name for a model's report: one path component, never a
    directory, a hidden file or a path out of the folder it is saved in (user-supplied
    names such as "../../x" or "/etc/passwd" become "x-memory-plan.html", "etc-passwd-...")."""
    if fmt not in FORMATS:
        raise PlannerInputError(f"unknown report format {fmt!r}: use one of {', '.join(FORMATS)}")
    name = str(model_name)
    name = name[:-5] if name.lower().endswith(".json") else name
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-_")[:80] or "model"
    return f"{stem}-memory-plan.{fmt}"


RENDERERS = {"html": to_html, "md": to_markdown, "csv": to_csv, "json": to_json}
MIME_TYPES = {"html": "text/html", "md": "text/markdown", "csv": "text/csv", "json": "application/json"}


def render_report(report: Report, fmt: str) -> str:
    if fmt not in RENDERERS:
        raise PlannerInputError(f"unknown report format {fmt!r}: use one of {', '.join(FORMATS)}")
    return RENDERERS[fmt](report)


# --- the command line ---------------------------------------------------------------------

def report_for_values(values: Mapping[str, object], base_dir: Path | None = None, records: Iterable = ()) -> Report:
    """A report from the CLI's scenario values (estimate_from_values' keys, plus optional
    `gpu`: a preset name from views.inputs.GPU_PRESETS, a planner.gpus key or a size in GiB, default the
    first preset; `gpu_count`, default 1; `hub`: allow fetching the config; `run_steps` and
    `local_sgd_steps` for the Multiple GPUs section's local SGD comparison; `search_adapters`,
    default true: What fits also searches LoRA and QLoRA plans, which probe on first use)."""
    from planner.loading import load_model_shape
    from views.inputs import DEFAULTS, GPU_PRESET_KEYS, GPU_PRESETS

    if not isinstance(values.get("config"), str):
        raise PlannerInputError("report needs --config: a catalog name or a config.json path")
    scenario_values = {k: values[k] for k in SCENARIO_KEYS if values.get(k) is not None}
    scenario = scenario_from_values(**scenario_values)
    gpu = values.get("gpu") or DEFAULTS["gpu_preset"]
    spec = None
    if gpu in GPU_PRESETS and GPU_PRESETS[gpu] is not None:
        capacity, label, spec = GPU_PRESETS[gpu], str(gpu), GPUS[GPU_PRESET_KEYS[gpu]]
    elif gpu in GPUS:  # the planner's own keys, as `planner estimate --gpu` takes them
        spec = GPUS[gpu]
        capacity, label = spec.capacity_bytes, spec.label
    else:
        try:
            float(gpu)
        except (TypeError, ValueError):
            presets = ", ".join(repr(p) for p, size in GPU_PRESETS.items() if size is not None)
            raise PlannerInputError(f"unknown GPU {gpu!r}: give a size in GiB, one of {presets}, or one of "
                                    f"`planner estimate --gpu`'s {', '.join(GPUS)}") from None
        capacity = capacity_bytes_from_gib(gpu, "GPU size (--gpu)")
        label = f"{float(gpu):g} GiB"
    count = as_int(values.get("gpu_count") or 1, "number of GPUs (--gpu-count)")
    if not 1 <= count <= MAX_DEVICES:
        raise PlannerInputError(f"number of GPUs (--gpu-count) must be an integer from 1 to {MAX_DEVICES:,}, "
                                f"got {count:,}")
    run_steps = values.get("run_steps")
    run_steps = DEFAULT_RUN_STEPS if run_steps is None else as_int(run_steps, "run steps")
    local_sgd = values.get("local_sgd_steps")
    local_sgd = None if local_sgd is None else as_int(local_sgd, "local SGD steps")
    if run_steps < 1:
        raise PlannerInputError(f"run steps (--run-steps) must be a positive integer, got {run_steps!r}")
    if local_sgd is not None and local_sgd < 1:
        raise PlannerInputError(f"local SGD steps (--local-sgd-steps) must be a positive integer, got {local_sgd!r}")
    shape = load_model_shape(values["config"], scenario.task, scenario.num_labels, base_dir=base_dir,
                             allow_hub=bool(values.get("hub")))
    strategy = parse_strategy(values.get("strategy") or Strategy.DDP.value)
    return build_report(shape, scenario_values, capacity, label, count, records, gpu=spec, run_steps=run_steps,
                        local_sgd_steps=local_sgd, strategy=strategy,
                        search_adapters=bool(values.get("search_adapters", True)))


def write_report(values: Mapping[str, object], out_path: str | Path) -> Path:
    """Write the report for `values` (see report_for_values) to `out_path`; its suffix
    (.html, .md, .csv, .json) picks the format. Lists this model's runs from the default
    run history when one can be read. Returns the path written."""
    out = Path(out_path)
    fmt = out.suffix.lower().lstrip(".")
    fmt = "md" if fmt == "markdown" else fmt
    if fmt not in FORMATS:
        raise PlannerInputError(f"--out {str(out)!r}: the file name must end in .html, .md, .csv or .json")
    from views.history_access import recent_runs

    records, _ = recent_runs(limit=1000)
    report = report_for_values(values, base_dir=Path.cwd(), records=records)
    text = render_report(report, fmt)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as error:
        raise PlannerInputError(f"cannot write {str(out)!r}: {error.strerror}") from None
    return out
