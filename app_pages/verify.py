"""The Verify page: queue verification runs (the current plan, or every technique of the
Techniques page) one at a time, follow them live, compare estimate with measurement per
category and per technique, and browse the run history.

Layout only: the queue is app_pages.run_queue, data shaping views.verify_results.
"""

import dataclasses
import uuid

import streamlit as st

from app_pages.page_context import (
    estimate_with_progress,
    rerun_when_a_run_finishes,
    start_page,
)
from app_pages.run_queue import get_queue
from planner.errors import PlannerInputError
from planner.units import format_bytes
from runners.history import RunMode, RunStatus
from runners.unrecorded import unrecorded_note
from runners.verify import cuda_is_likely_available
from views.escaping import markdown_text
from views.figures import (
    category_comparison_figure,
    estimate_vs_measured_scatter,
    technique_bars_figure,
)
from views.history_access import recent_runs
from views.verify_results import (
    MODES,
    category_values,
    filter_history,
    history_table,
    measured_device,
    plan_request,
    scatter_points,
    technique_requests,
)

MODE_HELP = ("auto: CUDA when there is a GPU, else a real CPU run when it fits in free RAM, else simulate. "
             "simulate: fake tensors, nothing allocated, so any model size can be checked on this machine.")


def _session_id() -> str:
    return st.session_state.setdefault("verify_session_id", uuid.uuid4().hex)


def _submit(context, mode: str, steps: int, every_technique: bool) -> None:
    queue = get_queue()
    try:
        if every_technique:
            requests = technique_requests(context.config, context.name, context.base_values, mode, steps)
        else:
            method = context.scenario.finetune
            lora = f" {method.method.value} r{method.lora_r}" if method.uses_adapters else ""
            label = f"plan: {context.name} b{context.scenario.batch_size}×{context.scenario.seq_len}{lora}"
            requests = [(label, plan_request(context.config, context.name, context.plan_values, mode, steps))]
    except PlannerInputError as error:
        st.error(str(error), icon=":material/error:")
        return
    for label, request in requests:
        queue.submit(_session_id(), label, request)
    st.toast(f"Queued {len(requests)} run(s).")


def _live_runs() -> None:
    views = get_queue().jobs(_session_id())
    if not views:
        st.caption("No runs queued in this session yet.")
        return
    rerun_when_a_run_finishes(sum(v.job.finished for v in views), "verify_seen_finished")
    for view in views:
        job = view.job
        where = ("running now" if view.position == 0 else
                 f"waiting, {view.position} ahead in the queue" if view.position is not None else job.status)
        st.progress(job.fraction, text=markdown_text(f"{job.label}: {where} · {job.stage}"))  # stage: a reason
        if not job.finished and st.button("Cancel", key=f"cancel_{job.id}", help="Drop it from the queue, or "
                                          "stop it (its child process is killed; the history records it)."):
            get_queue().cancel(_session_id(), job.id)
        with st.expander(f"log of {markdown_text(job.label)}", expanded=False):
            st.code("\n".join(job.log), language=None)
    finished = [v.job for v in views
                if v.job.result is not None and v.job.result.get("status") == "ok" and v.job.result.get("measured")]
    if finished:
        st.subheader("Results of this session")
        st.plotly_chart(
            technique_bars_figure([j.label for j in finished], [j.result["estimated"]["peak_bytes"] for j in finished],
                                  [j.result["measured"]["peak_bytes"] for j in finished],
                                  title="Peak by run: estimated against measured"),
            width="stretch", key="session_runs_chart")
        labels = {j.id: f"{j.label} ({j.id})" for j in finished}
        chosen = st.selectbox("Categories of run", list(labels), format_func=labels.get, key="verify_result_choice")
        job = next((j for j in finished if j.id == chosen), finished[0])
        estimated, measured = category_values(job.result["estimated"], job.result["measured"])
        st.plotly_chart(category_comparison_figure(estimated, measured, title=f"{job.label}: by category "
                                                   f"({job.result['mode']})"), width="stretch",
                        key="session_categories_chart")
    for job in (v.job for v in views):
        if job.finished and job.status != "ok":
            why = job.error or (job.result or {}).get("reason") or ""
            st.warning(markdown_text(f"{job.label}: {job.status}. {why}"), icon=":material/warning:")
        note = unrecorded_note(job.result or {}) if job.finished else None
        if note is not None:
            st.warning(markdown_text(f"{job.label}: {note}"), icon=":material/warning:")


def _live_runs_fragment() -> None:
    # Poll once a second only while this session has a run waiting or running.
    active = any(not v.job.finished for v in get_queue().jobs(_session_id()))
    st.fragment(_live_runs, run_every=1.0 if active else None)()


def _history() -> None:
    st.subheader("Run history")
    records, problem = recent_runs(limit=1000)
    if problem:
        st.warning(problem, icon=":material/warning:")
        return
    table = history_table(records)
    if table.empty:
        st.caption("No runs recorded yet.")
        return
    models, statuses, modes = st.columns(3)
    table = filter_history(
        table,
        models.multiselect("Model", sorted(table["model"].unique()), key="history_models"),
        statuses.multiselect("Status", [s.value for s in RunStatus], key="history_statuses"),
        modes.multiselect("Mode", [m.value for m in RunMode], key="history_modes"),
    )
    st.dataframe(table, hide_index=True, key="history_table", column_config={
        "estimated peak (bytes)": st.column_config.NumberColumn(format="localized"),
        "measured peak (bytes)": st.column_config.NumberColumn(format="localized"),
        "error (%)": st.column_config.NumberColumn(format="%+.2f%%"),
    })
    estimated, measured, labels = scatter_points(table)
    if estimated:
        st.plotly_chart(estimate_vs_measured_scatter(estimated, measured, labels), width="stretch",
                        key="history_scatter")


def render() -> None:
    context = start_page("Verify")
    if context is None:
        _history()
        return
    mode_column, steps_column = st.columns(2)
    mode = mode_column.selectbox("Measurement mode", MODES, key="verify_mode", help=MODE_HELP)
    steps = steps_column.number_input("Optimizer steps (the last one is measured)", min_value=2, max_value=20,
                                      value=3, step=1, key="verify_steps")
    # The headline is the estimate a run in this mode is compared with: its device kind's
    # kernels (CPU for cpu and simulate), not necessarily the sidebar's.
    device = measured_device(mode, cuda_is_likely_available())
    try:
        compared = (context.result if device is context.scenario.device
                    else estimate_with_progress(context.shape, dataclasses.replace(context.scenario, device=device)))
    except PlannerInputError as error:
        st.error(str(error), icon=":material/error:")
        return
    st.metric("Estimated peak a run is compared with", format_bytes(compared.peak_bytes),
              help=f"{compared.peak_bytes:,} bytes with {device.value} kernels, the kind a {mode} run measures.")
    if device is not context.scenario.device:
        st.caption(f"A {mode} run measures {device.value} kernels, so it is compared with the {device.value} "
                   f"estimate; the sidebar's {context.scenario.device.value} estimate is "
                   f"{format_bytes(context.result.peak_bytes)} (Plan).")
    plan_column, all_column = st.columns(2)
    if plan_column.button("Verify this plan", key="verify_plan", type="primary"):
        _submit(context, mode, int(steps), every_technique=False)
    if all_column.button("Verify every technique", key="verify_techniques"):
        _submit(context, mode, int(steps), every_technique=True)
    st.caption("Runs are queued one at a time for the whole server (each session sees its own). Each runs in a "
               "child process and is recorded in the run history, which the Techniques page reads back.")
    _live_runs_fragment()
    _history()


render()
