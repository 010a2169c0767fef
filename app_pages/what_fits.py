"""The What fits page: every technique combination that fits the sidebar's GPU and
reaches a target batch, ranked by the fewest and safest changes to the sidebar's plan,
then by estimated step time (planner.fit, planner.step_time), a chart of peak against step
time with the capacity line, and "apply this plan", which writes the chosen combination
into the shared sidebar controls. Changes that risk model quality are left out unless the
checkbox allows them; when nothing fits, the nearest plans and how far over each is.

Layout only: numbers come from planner.fit, the rows from views.fit_table.
"""

import streamlit as st

from app_pages.fit_view import (
    TARGET_LABELS,
    TargetKind,
    gpu_for,
    option_label,
    plan_state,
    target_for,
)
from app_pages.page_context import cached_for_scenario, searched_with_progress, start_page
from planner.device_fit import reserved_check
from planner.errors import PlannerInputError
from planner.fit import FIT_ERROR_MARGIN, find_fits
from planner.step_time import DEFAULT_UTILISATION
from planner.units import format_bytes
from planner.verdict import room_for_plans, searchable_budget_bytes
from views.fit_table import changes_text, fit_rows, nearest_rows, risks_text
from views.inputs import preset_gpu
from views.svg_charts import fit_options_svg

# Fifteen columns share the page's width (about 980 px beside the sidebar in a 1,440 px
# window): widths in pixels and short headers (full names in their help), so none is cut
# off at the right edge; the raw peak bytes are hidden (the report keeps them).
_COMMON_COLUMNS = {
    "rank": st.column_config.NumberColumn("#", width=30, help="rank, best first"),
    "changes": st.column_config.TextColumn("changes", width=140,
                                           help="what this plan changes in yours, costliest first"),
    "risks": st.column_config.TextColumn("risks", width=70, help="changes that risk model quality, in words"),
    "method": st.column_config.TextColumn("method", width=55, help="fine-tuning method"),
    "optimizer": st.column_config.TextColumn("optimizer", width=80),
    "precision": st.column_config.TextColumn("precision", width=75),
    "checkpointing": st.column_config.CheckboxColumn("ckpt", width=40, help="gradient checkpointing"),
    "micro-batch": st.column_config.NumberColumn("micro", width=45, help="sequences per micro-batch"),
    "accumulation": st.column_config.NumberColumn("accum", width=45, help="gradient accumulation steps"),
    "strategy": st.column_config.TextColumn("strategy", width=95),
    "peak": st.column_config.TextColumn("peak", width=75, help="estimated peak per GPU, binary units"),
    "peak (bytes)": None,
}
FIT_COLUMNS = {
    **_COMMON_COLUMNS,
    "largest micro-batch": st.column_config.NumberColumn("max micro", width=60, help="largest micro-batch that fits"),
    "largest sequence": st.column_config.NumberColumn("max seq", width=55,
                                                      help="largest sequence length (tokens) that fits"),
    "step time (s)": st.column_config.NumberColumn("step (s)", format="%.3f", width=55,
                                                   help="estimated time per optimizer step, seconds"),
    "tokens/s": st.column_config.NumberColumn("tokens/s", format="%.0f", width=60),
}
NEAREST_COLUMNS = {
    **_COMMON_COLUMNS,
    "over by": st.column_config.TextColumn("over by", width=75,
                                           help="peak minus the capacity per GPU (on CUDA, less the overheads)"),
    "over by (bytes)": None,
    "over by (%)": st.column_config.NumberColumn("over %", format="%.1f", width=60,
                                                 help="over the capacity, percent of it"),
}


def _apply(state: dict) -> None:
    # A callback runs before the rerun draws the sidebar, so its widgets may take new values.
    for key, value in state.items():
        st.session_state[key] = value
    st.session_state["_applied_plan"] = True


def render() -> None:
    context = start_page("What fits")
    if context is None:
        return
    shape, values, capacity = context.shape, context.values, context.capacity_bytes
    if st.session_state.pop("_applied_plan", False):
        st.success("Plan applied to the sidebar: the other pages now show it.", icon=":material/check_circle:")

    target_column, utilisation_column = st.columns([2, 1])
    kind = target_column.radio("Target", list(TARGET_LABELS), format_func=TARGET_LABELS.get,
                               key="fit_target", index=0)
    utilisation = utilisation_column.slider("Utilisation (MFU)", min_value=0.05, max_value=1.0,
                                            value=DEFAULT_UTILISATION, step=0.05, key="fit_utilisation",
                                            help="Share of the GPU's peak FLOP/s a large micro-batch reaches.")
    allow_risky = st.checkbox("Allow changes that risk model quality", value=False, key="fit_allow_risky",
                              help="Pure bf16 (no fp32 master weights) and SGD for a language model: "
                                   "proposed only when allowed, labelled, and ranked after every safe plan.")
    search_adapters = st.checkbox(
        "Search LoRA and QLoRA plans", value=True, key="fit_search_adapters",
        help="A model's first LoRA plans probe its training step with the adapters once per technique class "
             "(seconds for a small model, a minute or more for a 7B one on two cores); later searches use the cache.")
    gpu = gpu_for(values, capacity)
    try:
        target = target_for(values, kind)
        # Plans must pass the verdict: on CUDA, the room the overheads leave (planner.verdict).
        budget = searchable_budget_bytes(capacity, context.scenario.device, preset_gpu(values), context.parallel)
        room_for = room_for_plans(capacity, context.scenario.device, preset_gpu(values))
        check = reserved_check(capacity, context.scenario.device, preset_gpu(values))
        # On CUDA each answer is tested by the caching allocator's replay: a 7B model's first
        # search takes a minute or more on two cores (benchmarks/fit_speed.py).
        result = searched_with_progress(
            context, "what fits", "Searching every combination",
            lambda progress: find_fits(shape, context.scenario, capacity, target, gpu, values.gpu_count,
                                       utilisation, allow_risky=allow_risky, strategy=context.parallel.strategy,
                                       room_for=room_for, lora=search_adapters, check=check, progress=progress),
            kind, utilisation, allow_risky, search_adapters)
    except PlannerInputError as error:
        st.error(str(error), icon=":material/error:")
        return
    wanted = {TargetKind.EFFECTIVE_BATCH.value: f"effective batch {target.effective_batch}",
              TargetKind.BATCH.value: f"batch {target.batch_size}",
              TargetKind.LARGEST.value: "the largest batch"}[kind]
    room = (f" ({format_bytes(budget)} each for the step's tensors, after the CUDA overheads)"
            if budget != capacity else "")
    st.markdown(f"**{len(result.options)}** of {result.combinations} combinations fit "
                f"{values.gpu_count} x {format_bytes(capacity)}{room} at {target.seq_len:,} tokens, {wanted}; "
                f"ranked by {result.ranked_by}.")
    if not result.options:
        st.warning("Nothing fits: try a larger GPU, a shorter sequence or a smaller batch. The nearest plans, "
                   "and how far over the capacity per GPU each is:", icon=":material/block:")
        if result.nearest:
            st.dataframe(nearest_rows(result), hide_index=True, key="fit_nearest", column_config=NEAREST_COLUMNS)
        _captions(result)
        return

    st.dataframe(fit_rows(result), hide_index=True, key="fit_table", column_config=FIT_COLUMNS)
    # SVG drawn here, not Plotly: no chart library for the page's first visit to fetch (views.svg_charts).
    st.markdown(cached_for_scenario(context, "what fits chart", lambda: fit_options_svg(result),
                                    kind, utilisation, allow_risky, search_adapters), unsafe_allow_html=True)

    # The labels themselves are the choices (not their positions): after a sidebar change
    # re-ranks the plans, a remembered label that no longer names an option resets the box
    # to the new first plan, in the browser too, so the box shows what Apply applies.
    by_label = {option_label(rank, option): option for rank, option in enumerate(result.options, 1)}
    if by_label:
        chosen = by_label[st.selectbox("Plan to apply", list(by_label), key="fit_choice")]
        risks = risks_text(chosen.risks)
        st.caption(f"Changes to your plan: {changes_text(chosen.changes)}" + (f". Risks: {risks}" if risks else ""))
        st.button("Apply this plan", type="primary", key="fit_apply", on_click=_apply,
                  args=(plan_state(chosen),))
    _captions(result)
    st.caption(f"Largest batches are the planner's: a measured peak may differ by up to {FIT_ERROR_MARGIN:.0%}; "
               "confirm one with a verification run on the Verify page.")


def _captions(result) -> None:
    unsearched = () if st.session_state.get("fit_search_adapters", True) else (
        "LoRA and QLoRA plans not searched: tick “Search LoRA and QLoRA plans” to include them.",)
    for line in (*unsearched, *result.left_out, *result.notes):
        st.caption(line)


render()
