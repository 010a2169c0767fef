"""The Report page: the current plan (its fine-tuning method included), its technique
comparison, full / LoRA / QLoRA side by side when ticked, and this model's verification
runs, downloaded as self-contained HTML, Markdown, CSV or JSON.

Layout only: reporting.build_report computes, reporting.render_report writes.
"""

import streamlit as st

from app_pages.page_context import combination_progress, method_comparison, start_page
from planner.errors import PlannerInputError
from planner.units import format_bytes
from reporting import build_report, render_report
from reporting.build import MIME_TYPES, export_file_name
from views.breakdown import peak_bytes
from views.history_access import recent_runs
from views.inputs import preset_gpu, total_capacity_bytes

# Short labels: four buttons share the page's width; what each file holds is in its help.
FORMAT_LABELS = {"html": "HTML", "md": "Markdown", "csv": "CSV", "json": "JSON"}
PREVIEW_HEIGHT_PX = 640
FORMAT_HELP = {"html": "Self-contained page with interactive charts; opens with no network.",
               "md": "The plan and its tables as Markdown.", "csv": "Every table in one CSV, a section column apart.",
               "json": "Every number, raw bytes."}


def render() -> None:
    context = start_page("Report")
    if context is None:
        return
    records, problem = recent_runs(limit=1000, model=context.name)
    if problem:
        st.warning(problem, icon=":material/warning:")
    methods = method_comparison(context, records, key="report_compare_methods")
    # The report's What fits search: on CUDA a 7B model's first one replays the caching
    # allocator for a minute or more (benchmarks/fit_speed.py); later ones are cached.
    try:
        with combination_progress("Searching what fits") as progress:
            report = build_report(context.shape, context.plan_values, context.capacity_bytes,
                                  context.values.gpu_preset, context.values.gpu_count, records, context.config,
                                  strategy=context.parallel.strategy, gpu=preset_gpu(context.values),
                                  search_adapters=st.session_state.get("fit_search_adapters", True),
                                  methods=methods, progress=progress)
    except PlannerInputError as error:
        st.error(str(error), icon=":material/error:")
        return
    peak = format_bytes(peak_bytes(report.per_gpu))
    strategy = f" with {context.parallel.strategy.value}" if context.parallel.distributed else ""
    st.metric("Peak of this plan", peak, help="Per GPU" + strategy)
    st.markdown(
        f"The plan ({peak} peak per GPU on {report.gpu_label}, "
        f"{format_bytes(total_capacity_bytes(context.values))} over {report.gpu_count} GPU(s){strategy}), "
        f"{len(report.techniques)} techniques and {len(report.runs)} verification run(s) of this model."
    )
    columns = st.columns(len(FORMAT_LABELS))
    for column, (fmt, label) in zip(columns, FORMAT_LABELS.items()):
        # HTML carries plotly.js (several MB): built only when its button is clicked.
        data = (lambda report=report: render_report(report, "html")) if fmt == "html" else render_report(report, fmt)
        column.download_button(label, data=data, file_name=export_file_name(context.name, fmt), mime=MIME_TYPES[fmt],
                               key=f"download_{fmt}", width="stretch", on_click="ignore", help=FORMAT_HELP[fmt],
                               icon=":material/download:")
    # A scrolling box of its own inside the expander: the report's wide tables scroll inside
    # the border instead of running past it.
    with st.expander("Markdown preview", expanded=True), st.container(height=PREVIEW_HEIGHT_PX, border=False):
        st.markdown(render_report(report, "md"))


render()
