"""The What fits page: every technique combination that fits the sidebar's GPU and
reaches a target batch, ranked by estimated step time (planner.fit, planner.step_time),
a chart of peak against step time with the capacity line, and "apply this plan", which
writes the chosen combination into the shared sidebar controls.

Layout only: numbers come from planner.fit and app_pages.fit_view.
"""

import streamlit as st

from app_pages.figures import fit_options_figure
from app_pages.fit_view import TARGET_LABELS, TargetKind, fit_rows, gpu_for, option_label, plan_state, target_for
from app_pages.page_context import start_page
from planner.errors import PlannerInputError
from planner.fit import FIT_ERROR_MARGIN, find_fits
from planner.step_time import DEFAULT_UTILISATION
from planner.units import format_bytes


# Thirteen columns share the page's width (about 1,000 px in a 1,440 px window): widths in
# pixels and short headers (full names in their help), so none is cut off at the right edge.
FIT_COLUMNS = {
    "rank": st.column_config.NumberColumn("#", width=40, help="rank, best first"),
    "optimizer": st.column_config.TextColumn("optimizer", width=95),
    "precision": st.column_config.TextColumn("precision", width=95),
    "checkpointing": st.column_config.CheckboxColumn("ckpt", width=45, help="gradient checkpointing"),
    "micro-batch": st.column_config.NumberColumn("micro", width=55, help="sequences per micro-batch"),
    "accumulation": st.column_config.NumberColumn("accum", width=55, help="gradient accumulation steps"),
    "strategy": st.column_config.TextColumn("strategy", width=125),
    "largest micro-batch": st.column_config.NumberColumn("max micro", width=75, help="largest micro-batch that fits"),
    "largest sequence": st.column_config.NumberColumn("max seq", width=65,
                                                      help="largest sequence length (tokens) that fits"),
    "peak": st.column_config.TextColumn("peak", width=85, help="estimated peak per GPU, binary units"),
    "peak (bytes)": st.column_config.NumberColumn("peak bytes", format="localized", width=105),
    "step time (s)": st.column_config.NumberColumn("step (s)", format="%.3f", width=60,
                                                   help="estimated time per optimizer step, seconds"),
    "tokens/s": st.column_config.NumberColumn("tokens/s", format="%.0f", width=70),
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
    gpu = gpu_for(values, capacity)
    try:
        target = target_for(values, kind)
        result = find_fits(shape, context.scenario, capacity, target, gpu, values.gpu_count, utilisation)
    except PlannerInputError as error:
        st.error(str(error), icon=":material/error:")
        return
    wanted = {TargetKind.EFFECTIVE_BATCH.value: f"effective batch {target.effective_batch}",
              TargetKind.BATCH.value: f"batch {target.batch_size}",
              TargetKind.LARGEST.value: "the largest batch"}[kind]
    st.markdown(f"**{len(result.options)}** of {result.combinations} combinations fit "
                f"{values.gpu_count} x {format_bytes(capacity)} at {target.seq_len:,} tokens, {wanted}; "
                f"ranked by {result.ranked_by}.")
    if not result.options:
        st.warning("Nothing fits: try a larger GPU, a shorter sequence or a smaller batch.", icon=":material/block:")
        return

    st.dataframe(fit_rows(result), hide_index=True, key="fit_table", column_config=FIT_COLUMNS)
    st.plotly_chart(fit_options_figure(result), width="stretch", key="fit_chart")

    # The labels themselves are the choices (not their positions): after a sidebar change
    # re-ranks the plans, a remembered label that no longer names an option resets the box
    # to the new first plan, in the browser too, so the box shows what Apply applies.
    by_label = {option_label(rank, option): option for rank, option in enumerate(result.options, 1)}
    chosen = by_label[st.selectbox("Plan to apply", list(by_label), key="fit_choice")]
    st.button("Apply this plan", type="primary", key="fit_apply", on_click=_apply,
              args=(plan_state(chosen),))
    for note in result.notes:
        st.caption(note)
    st.caption(f"Largest batches are the planner's: a measured peak may differ by up to {FIT_ERROR_MARGIN:.0%}; "
               "confirm one with a verification run on the Verify page.")


render()
