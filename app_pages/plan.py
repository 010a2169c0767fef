"""The Plan page: the sidebar's scenario estimated on its model, the peak's breakdown by
category, whether it fits the chosen GPU and by how much, and where and why the peak is.

Layout only: numbers come from planner.estimate and app_pages.breakdown.
"""

import streamlit as st

from app_pages.breakdown import breakdown_table, verdict_for
from app_pages.figures import phase_breakdown_figure
from app_pages.inputs import SidebarValues, capacity_bytes, model_config, scenario_for
from app_pages.model_cache import cached_model_shape
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.units import format_bytes


def render() -> None:
    st.title("Plan")
    values = SidebarValues.from_state(st.session_state)
    try:
        chosen = model_config(values)
        if chosen is None:
            st.info("Upload a model's config.json in the sidebar, or pick a catalog model.")
            return
        config, name = chosen
        scenario = scenario_for(values)
        shape = cached_model_shape(config, name, scenario)
        result = estimate(shape, scenario)
        capacity = capacity_bytes(values)
    except PlannerInputError as error:
        # Bad input is the user's to fix: say what and how, keep the page alive.
        st.error(str(error), icon=":material/error:")
        return

    positions = f", {shape.max_positions:,} positions" if shape.max_positions is not None else ""
    st.caption(f"**{shape.name}**: {shape.architecture}, {shape.num_parameters:,} parameters{positions}")

    verdict = verdict_for(result, capacity)
    if verdict.fits:
        st.success(verdict.headline, icon=":material/check_circle:")
    else:
        st.warning(verdict.headline, icon=":material/block:")
    peak_column, capacity_column, margin_column = st.columns(3)
    peak_column.metric("Peak", format_bytes(verdict.peak_bytes))
    capacity_column.metric("Capacity", format_bytes(verdict.capacity_bytes))
    margin_column.metric("Margin", f"{verdict.margin_gib:+,.2f} GiB")
    st.markdown(f"The peak is in the **{result.peak_phase.value}** phase: {result.peak_reason}.")

    st.subheader("Live at the peak")
    st.dataframe(
        breakdown_table(result),
        hide_index=True,
        column_config={"bytes": st.column_config.NumberColumn("bytes", format="localized")},
    )
    st.caption(
        f"Activations saved by one micro-batch's forward: {format_bytes(result.activations_bytes)}. "
        "Capacity is the total the driver reports; the CUDA context and the caching allocator's "
        "slack take part of it and are not in the peak."
    )
    st.plotly_chart(phase_breakdown_figure(result, capacity), width="stretch")
    for note in result.notes:
        st.info(note, icon=":material/info:")


render()
