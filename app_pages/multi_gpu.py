"""The Multiple GPUs page: the sidebar's model and micro-batch on N data-parallel GPUs under
each strategy (DDP, ZeRO 1-3, FSDP2), per-GPU memory and traffic per optimizer step, DDP
against local SGD, and distributed runs from the history beside their estimates.

Layout only: numbers, tables and figures come from app_pages.multi_gpu_figures.
"""

import streamlit as st

from app_pages.history_access import recent_runs
from app_pages.model_cache import cached_model_shape
from app_pages.multi_gpu_figures import (
    DEFAULT_GPUS,
    DEFAULT_RUN_STEPS,
    collectives_table,
    communication_figure,
    communication_table,
    gpus_for_page,
    local_sgd_comparison,
    local_sgd_figure,
    local_sgd_table,
    measured_runs_table,
    memory_by_strategy_figure,
    memory_table,
    strategy_estimates,
)
from app_pages.page_context import start_page
from planner.errors import PlannerInputError
from planner.strategy import MAX_DEVICES

BYTES = st.column_config.NumberColumn(format="localized")
PERCENT = st.column_config.NumberColumn(format="%.1f%%")


def render() -> None:
    context = start_page("Multiple GPUs")
    if context is None:
        return
    num_devices = gpus_for_page(context.values.gpu_count)
    if num_devices is None:
        num_devices = st.number_input(
            "Number of GPUs", min_value=2, max_value=MAX_DEVICES, value=DEFAULT_GPUS, step=1, key="multi_gpu_count",
            help="The sidebar's number of GPUs is 1; set it above 1 there, or choose here how many to plan for.")
    else:
        st.markdown(f"Planning for the sidebar's **{num_devices}** GPUs.")
    scenario = context.scenario
    try:
        estimates = strategy_estimates(context.shape, scenario, num_devices, context.result)
    except PlannerInputError as error:
        st.error(str(error), icon=":material/error:")
        return

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
