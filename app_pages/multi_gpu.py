"""The Multiple GPUs page: the sidebar's model and micro-batch on N data-parallel GPUs under
each strategy (DDP, ZeRO 1-3, FSDP2), per-GPU memory and traffic per optimizer step, DDP
against local SGD, a distributed run queued from here (N ranks under torchrun, followed
live), and distributed runs from the history beside their estimates.

Layout only: numbers, tables and figures come from views.multi_gpu_figures; refusals
from runners.launch.plan_distributed; the queue is app_pages.run_queue.
"""

import dataclasses
import uuid

import streamlit as st

from app_pages.model_cache import cached_model_shape
from app_pages.page_context import rerun_when_a_run_finishes, start_page
from app_pages.run_queue import Distributed, get_queue
from planner.errors import PlannerInputError
from planner.strategy import MAX_DEVICES, Strategy
from planner.units import format_bytes
from runners.launch import plan_distributed
from runners.request import VERIFIED_STRATEGIES
from runners.unrecorded import unrecorded_note
from views.escaping import markdown_text
from views.history_access import recent_runs
from views.multi_gpu_figures import (
    DEFAULT_GPUS,
    DEFAULT_RUN_STEPS,
    collectives_table,
    communication_figure,
    communication_table,
    local_sgd_comparison,
    local_sgd_figure,
    local_sgd_table,
    measured_runs_table,
    memory_by_strategy_figure,
    memory_table,
    strategy_plans,
)
from views.verify_results import plan_request

BYTES = st.column_config.NumberColumn(format="localized")
PERCENT = st.column_config.NumberColumn(format="%.1f%%")
# Verifiable first; ZeRO stays listed so choosing it says why it cannot be run.
VERIFY_STRATEGIES = (*VERIFIED_STRATEGIES, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3)
VERIFY_MODES = ("auto", "cpu", "cuda", "simulate")
VERIFY_MODE_HELP = ("auto: one GPU per process (NCCL) when this machine has enough GPUs, else CPU processes over "
                    "gloo. simulate is refused: a distributed run measures real tensors.")
MAX_VERIFY_STEPS = 64


def _session_id() -> str:
    # The Verify page's key: one session, one list of jobs, whichever page queued them.
    return st.session_state.setdefault("verify_session_id", uuid.uuid4().hex)


def _strategy_label(value: str) -> str:
    return value if Strategy(value) in VERIFIED_STRATEGIES else f"{value} (not verifiable)"


def _mark_asked() -> None:
    st.session_state["mgpu_verify_asked"] = True


def _verify_controls(context) -> None:
    strategy_column, processes_column, steps_column, mode_column = st.columns(4)
    choices = [s.value for s in VERIFY_STRATEGIES]
    sidebar = context.parallel.strategy.value
    strategy = Strategy(strategy_column.selectbox(
        "Strategy", choices, index=choices.index(sidebar) if sidebar in choices else 0, format_func=_strategy_label,
        key="mgpu_verify_strategy", on_change=_mark_asked))
    processes = int(processes_column.number_input("Processes", min_value=2, max_value=MAX_DEVICES, value=2, step=1,
                                                  key="mgpu_verify_processes", on_change=_mark_asked))
    steps = int(steps_column.number_input("Optimizer steps", min_value=2, max_value=MAX_VERIFY_STEPS, value=4,
                                          step=1, key="mgpu_verify_steps",
                                          help="Step 1 builds the optimizer state; the last one is measured.",
                                          on_change=_mark_asked))
    mode = mode_column.selectbox("Mode", VERIFY_MODES, key="mgpu_verify_mode", help=VERIFY_MODE_HELP,
                                 on_change=_mark_asked)
    local_sgd = None
    if strategy is Strategy.DDP and st.toggle("Local SGD", key="mgpu_verify_local_sgd",
                                              help="DDP without the per-step all-reduce: parameters are averaged "
                                                   "every K micro-batches."):
        local_sgd = int(st.number_input("Average every K micro-batches", min_value=1, value=2, step=1,
                                        key="mgpu_verify_local_sgd_k"))
    try:
        request = dataclasses.replace(plan_request(context.config, context.name, context.base_values, mode, steps),
                                      local_sgd_steps=local_sgd)
        plan = plan_distributed(request, strategy, processes)
    except PlannerInputError as error:
        st.error(str(error), icon=":material/error:")
        return
    if plan.refusal is not None and st.session_state.get("mgpu_verify_asked"):
        st.error(f"Not verifiable as chosen: {plan.refusal}", icon=":material/block:")
    elif plan.refusal is not None:
        # The page's own defaults were refused (a model too large for this machine): say why
        # beside the disabled button, not as an error, since the user has asked nothing yet.
        st.caption(f"Not verifiable as chosen: {plan.refusal}")
    else:
        st.caption(f"Runs the sidebar's scenario on {processes} processes in {plan.request.mode.value} mode (CPU "
                   "ranks talk over gloo, GPU ranks over NCCL), queued one at a time with the Verify page's runs, "
                   "and records the run in the history.")
    if st.button("Verify across processes", key="mgpu_verify_run", type="primary", disabled=plan.refusal is not None):
        if plan.refusal is None:  # a click sent before the choices changed to a refused plan
            label = (f"{strategy.value} × {processes}: {context.name} b{context.scenario.batch_size}×"
                     f"{context.scenario.seq_len}" + (f", local SGD K={local_sgd}" if local_sgd else ""))
            get_queue().submit(_session_id(), label, request, Distributed(strategy, processes))
            st.toast(f"Queued {label}.")


def _distributed_runs() -> None:
    views = [v for v in get_queue().jobs(_session_id()) if v.job.distributed is not None]
    rerun_when_a_run_finishes(sum(v.job.finished for v in views), "mgpu_seen_finished")
    for view in views:
        job = view.job
        if job.finished:
            result = job.result or {}
            note = unrecorded_note(result)
            if job.status == "ok":
                peak = format_bytes(result.get("max_rank_peak_bytes"))
                recorded = f"recorded as run {result.get('run_id')}" if note is None else "not recorded"
                st.success(f"{markdown_text(job.label)}: ok, largest rank peak {peak}; {recorded}.",
                           icon=":material/check_circle:")
            else:
                st.error(markdown_text(f"{job.label}: {job.status}. {job.error or result.get('reason') or ''}"),
                         icon=":material/error:")
            if note is not None:
                st.warning(markdown_text(f"{job.label}: {note}"), icon=":material/warning:")
            continue
        where = "running now" if view.position == 0 else f"waiting, {view.position} ahead in the queue"
        st.progress(job.fraction, text=markdown_text(f"{job.label}: {where} · {job.stage}"))  # stage: a reason
        if st.button("Cancel", key=f"mgpu_cancel_{job.id}",
                     help="Drop it from the queue, or stop it (every rank is killed; the history records it)."):
            get_queue().cancel(_session_id(), job.id)


def _distributed_runs_fragment() -> None:
    # Poll once a second only while this session has a distributed run waiting or running.
    active = any(not v.job.finished and v.job.distributed is not None for v in get_queue().jobs(_session_id()))
    st.fragment(_distributed_runs, run_every=1.0 if active else None)()


def _use_several_gpus() -> None:
    # A callback runs before the rerun draws the sidebar, so its GPU count may change.
    st.session_state["gpu_count"] = DEFAULT_GPUS


def render() -> None:
    context = start_page("Multiple GPUs")
    if context is None:
        return
    num_devices = context.parallel.num_devices  # the sidebar's: one GPU count for every page
    if num_devices == 1:
        st.info("The sidebar says 1 GPU: set its number of GPUs above 1 to plan across several.",
                icon=":material/lan:")
        st.button(f"Plan for {DEFAULT_GPUS} GPUs", key="multi_gpu_use_several", on_click=_use_several_gpus)
        return
    st.markdown(f"Planning for the sidebar's **{num_devices}** GPUs; its strategy, "
                f"**{context.parallel.strategy.value}**, is the one Plan and the other pages show.")
    scenario = context.scenario
    try:
        plans = strategy_plans(context.shape, scenario, num_devices, context.result)
    except PlannerInputError as error:
        st.error(str(error), icon=":material/error:")
        return
    estimates = plans.planned
    if plans.refused:
        st.info(plans.not_planned_line(), icon=":material/info:")

    st.header("Memory per GPU")
    st.markdown(
        f"Every GPU trains its own micro-batch of **{scenario.batch_size}** × **{scenario.seq_len:,}** tokens "
        f"(the sidebar's scenario); the effective batch is {num_devices} times larger. The strategy decides what "
        "each GPU holds of the weights, gradients and optimizer state (a full replica, or a 1/N shard) and which "
        "buffers communication adds. Figures are for rank 0, the largest when rows do not split evenly; sizes are "
        "binary (GiB = 2^30 bytes)."
    )
    st.plotly_chart(memory_by_strategy_figure(estimates, context.capacity_bytes,
                                              title=f"{context.shape.name} on {num_devices} GPUs: per-GPU peak"),
                    width="stretch", key="multi_gpu_memory_chart")
    st.dataframe(memory_table(estimates, context.capacity_bytes), hide_index=True, key="multi_gpu_memory_table",
                 column_config={"per-GPU peak (bytes)": BYTES})
    st.caption("ZeRO stages are modelled from the ZeRO paper with DeepSpeed's defaults and not verified by a run; "
               "DDP and FSDP2 are checked against two-rank runs (Verify). The largest gathered unit is the biggest "
               "set of parameters a sharded strategy gathers at once.")

    st.header("Communication")
    st.markdown(
        "**Payload** is what one GPU hands to a collective per optimizer step (the reduced tensor of an all-reduce, "
        "the gathered output of an all-gather, the full input of a reduce-scatter), as the Verify runs count it. "
        f"**Wire** bytes are what a ring algorithm sends per GPU: 2(N−1)/N of the payload for an all-reduce, "
        f"(N−1)/N for all-gather and reduce-scatter, here with N = {num_devices}."
    )
    run_steps = st.number_input("Optimizer steps in the run (S)", min_value=1, value=DEFAULT_RUN_STEPS, step=100,
                                key="multi_gpu_run_steps")
    st.plotly_chart(communication_figure(estimates), width="stretch", key="multi_gpu_comm_chart")
    st.dataframe(communication_table(estimates, run_steps), hide_index=True, key="multi_gpu_comm_table",
                 column_config={"payload per step (bytes)": BYTES, "wire per step (bytes)": BYTES})
    st.dataframe(collectives_table(estimates), hide_index=True, key="multi_gpu_collectives_table",
                 column_config={"payload per step (bytes)": BYTES, "wire per step (bytes)": BYTES})

    st.subheader("DDP against local SGD")
    st.markdown(
        "Local SGD (Accelerate's `LocalSGD` on DDP) skips the gradient all-reduce: each GPU steps on its own, and "
        "every K micro-batches the parameters are averaged (one all-reduce per parameter tensor), plus once more at "
        f"the end of the run. Per optimizer step that is {scenario.grad_accum_steps} micro-batch(es) / K of the "
        "parameters; DDP all-reduces every gradient (and broadcasts the buffers) once per optimizer step. "
        "Fewer averagings save traffic, at the cost of replicas drifting apart between them."
    )
    comparison = local_sgd_comparison(context.shape, scenario, num_devices, run_steps, base=context.result)
    st.plotly_chart(local_sgd_figure(comparison, title=f"DDP against local SGD on {num_devices} GPUs"),
                    width="stretch", key="multi_gpu_local_sgd_chart")
    st.dataframe(local_sgd_table(comparison), hide_index=True, key="multi_gpu_local_sgd_table",
                 column_config={"payload per step (bytes)": BYTES, "wire per step (bytes)": BYTES,
                                f"payload over {run_steps:,} steps (bytes)": BYTES,
                                "saving vs DDP per step (%)": PERCENT,
                                f"saving vs DDP over {run_steps:,} steps (%)": PERCENT})

    st.header("Verify across processes")
    st.markdown("Run the sidebar's scenario on several processes (DDP or FSDP2 through Accelerate, under torchrun) "
                "and measure every rank's peak and the collectives it issues; the run joins the table below.")
    _verify_controls(context)
    _distributed_runs_fragment()

    st.header("Estimated against measured")
    records, problem = recent_runs(status="ok", model=context.name)
    if problem:
        st.warning(problem, icon=":material/warning:")
    measured = measured_runs_table(records, context.config, cached_model_shape)
    if measured.empty:
        st.info("No distributed runs of this model in the run history yet: a run on several processes (DDP, FSDP "
                "or local SGD) is recorded with its per-rank peaks and counted collectives, and shows up here.")
        return
    st.markdown("Each distributed run of this model, its own scenario estimated now: the per-GPU peak against "
                "the largest rank's measured peak, and the payload per step against rank 0's counted collectives "
                "(steady-state steps; the first includes the set-up).")
    st.dataframe(measured, hide_index=True, key="multi_gpu_measured_table",
                 column_config={"estimated per-GPU peak (bytes)": BYTES, "measured max rank peak (bytes)": BYTES,
                                "estimated payload per step (bytes)": BYTES, "measured payload per step (bytes)": BYTES,
                                "peak error (%)": PERCENT, "payload error (%)": PERCENT})


render()
