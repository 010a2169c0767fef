"""The Plan page: the sidebar's scenario estimated on its model, the peak's breakdown by
category, whether it fits the chosen GPU and by how much, where and why the peak is, the
largest batch size and sequence length that fit, and peak against batch size per technique.

Layout only: numbers come from planner.estimate and the shared tables and figures in views.
"""

import streamlit as st

from app_pages.page_context import (
    cached_for_model,
    cached_for_scenario,
    cached_for_scenario_apart_from,
    probe_status,
    start_page,
)
from planner.device_fit import reserved_check
from planner.fit import FitLimits, longest_sequence, max_batch_size
from planner.units import format_bytes
from planner.verdict import tensor_budget_bytes
from views.breakdown import breakdown_table, verdict_for, verdict_table, with_byte_separators
from views.comparison import (
    CHART_BATCH_SIZES,
    adapter_summary,
    batch_sizes_for_chart,
    chart_base,
    memory_vs_batch,
    memory_vs_batch_known,
    series_within,
    unprobed_text,
)
from views.escaping import markdown_text
from views.inputs import preset_gpu, total_capacity_bytes
from views.markdown_table import markdown_table
from views.svg_charts import memory_vs_batch_svg, phase_breakdown_svg

BYTE_COLUMNS = ("bytes", "size")


class _Incomplete(Exception):
    """memory_vs_batch_known's answer where some lines still need a probe: not cached."""

    def __init__(self, known):
        super().__init__()
        self.known = known


def _batch_series(context, sizes: list[int]):
    """(technique label -> points, the techniques left out because their step is not probed yet).
    The lines follow from the model, the scenario's sequence and task and the sizes, not from the
    sidebar's batch, optimizer or precision: those only move the star (cached per model once every
    line is known). A model whose tables are not all known (an upload) draws what is known and
    probes nothing: the rest of the page is its answer, and probing every technique took 45 s on
    2 cores."""
    shape, base = context.shape, context.base_values

    def every_line_known():
        # Every size a chart may show: a change that moves the largest batch (checkpointing,
        # precision, optimizer) then draws the lines from the cache instead of estimating them again.
        series, unprobed = memory_vs_batch_known(shape, base, CHART_BATCH_SIZES)
        if unprobed:
            raise _Incomplete((series, unprobed))  # nothing is kept for a raised result
        return series

    try:
        series, unprobed = cached_for_model(context, "plan batch series", every_line_known, chart_base(base)), ()
    except _Incomplete as incomplete:  # the next run draws what a probe since has added
        series, unprobed = incomplete.known
    return series_within(series, unprobed, sizes)


def render() -> None:
    context = start_page("Plan")
    if context is None:
        return
    result, capacity, shape = context.result, context.capacity_bytes, context.shape
    per_gpu, parallel = context.per_gpu, context.parallel  # one device's plan, or one GPU's share of it

    gpu = preset_gpu(context.values)
    verdict = cached_for_scenario(context, "plan verdict", lambda: verdict_for(shape, per_gpu, capacity, gpu, parallel))
    if verdict.fits:
        st.success(verdict.headline, icon=":material/check_circle:")
    else:
        st.warning(verdict.headline, icon=":material/block:")
    on_cuda = verdict.overheads is not None
    columns = st.columns(4 if on_cuda else 3)
    peak_column, capacity_column, margin_column = columns[0], columns[1], columns[-1]
    peak_column.metric("Peak per GPU" if parallel.distributed else "Peak", format_bytes(verdict.peak_bytes),
                       help="Live tensors at the step's peak.")
    capacity_column.metric("Capacity", format_bytes(verdict.capacity_bytes), help="The total the driver reports.")
    if on_cuda:
        columns[2].metric("Usable capacity", format_bytes(verdict.usable_capacity_bytes),
                          help=f"Less {format_bytes(verdict.overhead_bytes)} of CUDA overheads outside the caching "
                               f"allocator; the margin also counts torch's {format_bytes(verdict.allocator_blocks_bytes)} "
                               "of cuBLAS workspaces.")
    margin_column.metric("Margin", f"{verdict.margin_gib:+,.2f} GiB")
    method = adapter_summary(result)
    if method is not None:
        trainable_column, frozen_column = st.columns(2)
        trainable_column.metric("Trainable parameters", f"{method.trainable_parameters:,}",
                                help=f"{method.trainable_percent:.3f}% of the model's {method.base_parameters:,} "
                                     "parameters, as PEFT counts them (get_nb_trainable_parameters).")
        frozen_column.metric("Frozen weights", format_bytes(method.frozen_weight_bytes),
                             help=f"{method.frozen_weight_bytes:,} bytes of the frozen base" +
                                  (" (4-bit, with its quantisation constants)" if method.quantized else "") + ".")
        st.caption(f"Fine-tuning: {method.settings}.")
    if context.per_device is None:
        st.markdown(f"The peak is in the **{result.peak_phase.value}** phase: {result.peak_reason}.")
    else:
        placement = context.per_device.placement
        st.markdown(
            f"On each of **{parallel.num_devices}** GPUs with **{parallel.strategy.value}** (rank 0, the largest "
            f"when rows do not split evenly), the peak is in the **{context.per_device.peak.phase.value}** phase. "
            f"Weights {placement['weights']}, gradients {placement['gradients']}, optimizer state "
            f"{placement['optimizer_state']}; {format_bytes(total_capacity_bytes(context.values))} in all. "
            "Every GPU trains its own micro-batch; the Multiple GPUs page compares the strategies and their traffic.")

    budget = tensor_budget_bytes(capacity, context.scenario.device, gpu, parallel)
    check = reserved_check(capacity, context.scenario.device, gpu)
    # The searches start from the sidebar's plan where it fits: a new model's batch 1, a probe
    # class of its own, is then planned only when the sidebar's batch does not fit.
    scenario_fits = verdict.fits and verdict.peak_bytes <= budget
    # Each search is cached apart from the value it searches: a batch change searches the
    # sequence only, and the other way round (each search replays the allocator a few times).
    known_batch, known_seq = (context.scenario.batch_size, context.scenario.seq_len) if scenario_fits else (1, 1)
    largest_batch = cached_for_scenario_apart_from(
        context, "batch_size", "plan largest batch",
        lambda: max_batch_size(shape, context.scenario, budget, plan=parallel, check=check, known_fit=known_batch))
    limits = FitLimits(largest_batch, *cached_for_scenario_apart_from(
        context, "seq_len", "plan largest sequence",
        lambda: longest_sequence(shape, context.scenario, budget, plan=parallel, check=check, known_fit=known_seq)))
    batch_column, seq_column = st.columns(2)
    batch_text = "none" if limits.batch_size is None else f"{limits.batch_size:,}"
    seq_text = "none" if limits.seq_len is None else f"{limits.seq_len:,}"
    per = " per GPU" if parallel.distributed else ""
    batch_column.metric("Largest batch size that fits", batch_text,
                        help=f"Sequences per micro-batch{per} at {context.scenario.seq_len:,} tokens, "
                             "this scenario otherwise.")
    seq_column.metric("Largest sequence length that fits", seq_text,
                      help=f"Tokens at batch size {context.scenario.batch_size:,}{per}, this scenario otherwise.")
    if limits.seq_len_capped_by_positions:
        st.caption(f"The sequence length is capped by the model's {shape.max_positions:,} positions, not by memory.")

    st.subheader("Live at the peak" + (" on each GPU" if parallel.distributed else ""))
    # Markdown tables, not st.dataframe or st.table: a few rows need no grid, and an Arrow table
    # fetches 1.2 MiB more JavaScript per session before the page is complete; the grid's canvas
    # kept every sidebar change's page moving for 200 ms more (benchmarks/browser_speed.py).
    st.markdown(cached_for_scenario(context, "plan breakdown table", lambda: markdown_table(
        with_byte_separators(breakdown_table(per_gpu)), right=BYTE_COLUMNS)))
    if verdict.overheads is not None:
        with st.expander("Allocated, reserved and CUDA overheads", expanded=False):
            st.markdown(cached_for_scenario(context, "plan verdict table", lambda: markdown_table(
                with_byte_separators(verdict_table(verdict)), right=BYTE_COLUMNS)))
            if verdict.caveat:
                st.caption(f"Reserved memory: {verdict.caveat}. Each overhead says whether it was measured "
                           "or documented (docs/cuda_overheads.md).")
    st.caption(
        f"Activations saved by one micro-batch's forward: {format_bytes(result.activations_bytes)}. "
        + ("The largest batch and sequence leave room for the CUDA overheads and torch's allocator blocks."
           if verdict.overheads is not None else "On CPU there are no CUDA overheads.")
    )
    # Charts of live tensors draw what they may take: the capacity less the CUDA overheads.
    # SVG drawn here, not Plotly: no chart library for a new session to fetch (views.svg_charts).
    st.markdown(cached_for_scenario(context, "plan phases", lambda: phase_breakdown_svg(per_gpu, max(budget, 0))),
                unsafe_allow_html=True)
    for note in result.notes:
        st.info(note, icon=":material/info:")

    st.subheader("Peak against batch size, by technique")
    # The sidebar's own scenario on the same axes: its effective batch on one GPU, one full replica.
    current = (context.scenario.batch_size * context.scenario.grad_accum_steps, result.peak_bytes)

    sizes = batch_sizes_for_chart(limits.batch_size)
    series, unprobed = _batch_series(context, sizes)

    def batch_chart():
        return memory_vs_batch_svg(series, max(budget, 0), title=f"{shape.name}: peak against batch size "
                                                                f"at {context.scenario.seq_len:,} tokens",
                                   current=current)

    st.markdown(cached_for_scenario(context, "plan batch chart", batch_chart,
                                    tuple((label, tuple(points)) for label, points in series.items())),
                unsafe_allow_html=True)
    if unprobed:
        st.info(f"Not drawn yet: {markdown_text(unprobed_text(unprobed))}. They need {markdown_text(shape.name)}'s "
                "training step probed once per technique on fake tensors (seconds each on 2 cores); the probes "
                "are kept for next time.", icon=":material/hourglass_empty:")
        if st.button("Probe and draw the rest", key="probe_chart_techniques"):
            with probe_status(shape.name):  # probes and stores them: the rerun draws every line
                memory_vs_batch(shape, context.base_values, sizes, [technique for technique, _ in unprobed])
            st.rerun()
    one_device = (" on one GPU holding a full replica (the sidebar's strategy is not applied here)"
                  if parallel.distributed else "")
    st.caption(f"Each technique starts from AdamW fp32 with full fine-tuning, without checkpointing or "
               f"accumulation{one_device}; "
               "accumulation lines split the batch into up to 4 micro-batches. The star is your plan as the sidebar "
               "sets it. Details on the Techniques page.")


render()
