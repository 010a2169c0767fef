"""The Techniques page: the lessons' memory-saving techniques on the chosen model and batch,
estimated side by side (and measured, where the run history holds a run of exactly that
scenario), with the saving against the AdamW fp32 baseline and what each costs; then, when
asked, full fine-tuning, LoRA and QLoRA on the sidebar's own scenario, side by side.

Layout only: rows come from views.comparison, figures from views.figures.
"""

import streamlit as st

from app_pages.page_context import method_comparison, start_page
from views.comparison import accumulation_note, compare_techniques, comparison_table, method_table
from views.escaping import markdown_text
from views.figures import technique_bars_figure
from views.history_access import recent_runs


def render() -> None:
    context = start_page("Techniques")
    if context is None:
        return
    scenario = context.scenario
    st.markdown(
        f"Each row starts from the sidebar's batch of **{scenario.batch_size}** × **{scenario.seq_len:,}** tokens "
        f"({scenario.task.value}, {scenario.attention.value} attention, {scenario.device.value}) with AdamW in fp32, "
        "no checkpointing and no accumulation, and changes only what the technique names. The sidebar's optimizer, "
        "precision, checkpointing, accumulation and fine-tuning method are not used here (every row fine-tunes "
        "in full; LoRA and QLoRA are compared below)."
        + (f" Each row is one GPU holding a full replica: the sidebar's {context.parallel.strategy.value} on "
           f"{context.parallel.num_devices} GPUs is shown on Plan and Multiple GPUs." if context.parallel.distributed
           else "")
    )
    records, problem = recent_runs(status="ok", model=context.name)
    if problem:
        st.warning(problem, icon=":material/warning:")
    rows = compare_techniques(context.shape, context.base_values, records, context.config)
    table = comparison_table(rows, context.capacity_bytes)
    st.dataframe(
        table, hide_index=True, key="techniques_table",
        # Eleven columns share the page's width (about 1,000 px in a 1,440 px window): widths
        # in pixels and short headers (full names in their help), so none is cut off at the
        # right edge; long technique names and costs show whole on hover.
        column_config={
            "technique": st.column_config.TextColumn("technique", width=200),
            "micro-batch × accumulation": st.column_config.TextColumn("micro×acc", width=75,
                                                                      help="micro-batch × accumulation steps"),
            "estimated peak (bytes)": st.column_config.NumberColumn("est. bytes", format="localized",
                                                                    width=105),
            "estimated peak": st.column_config.TextColumn("estimated", width=80, help="estimated peak"),
            "fits": st.column_config.CheckboxColumn("fits", width=40),
            "saving vs baseline (%)": st.column_config.NumberColumn("saving", format="%.1f%%", width=60,
                                                                    help="saving against the baseline's peak"),
            "measured peak (bytes)": st.column_config.NumberColumn("meas. bytes", format="localized",
                                                                   width=105),
            "measured peak": st.column_config.TextColumn("measured", width=75, help="measured peak"),
            "measured by": st.column_config.TextColumn("by", width=45, help="measurement mode of the run"),
            "cost": st.column_config.TextColumn("cost", width=140),
            "lesson": st.column_config.TextColumn("lesson", width=50),
        },
    )
    note = accumulation_note(scenario.batch_size)
    if note is not None:
        st.info(note, icon=":material/info:")
    st.plotly_chart(
        technique_bars_figure([r.technique.label for r in rows], [r.peak_bytes for r in rows],
                              [r.measured_peak_bytes for r in rows], context.capacity_bytes,
                              title=f"{context.shape.name}: peak by technique"),
        width="stretch", key="techniques_chart")
    measured = sum(r.measured_peak_bytes is not None for r in rows)
    st.caption(
        f"Measured: {measured} of {len(rows)} techniques have a finished run of exactly this scenario in the run "
        "history (any device kind; the newest is shown). Start runs on the Verify page. Costs: checkpointing "
        "recomputes each block's forward during backward (≈ one extra forward, ≈ +33% compute); accumulation "
        "takes k smaller micro-batches per optimizer step; Adafactor and 8-bit Adam approximate Adam's statistics."
    )

    st.subheader("Full fine-tuning, LoRA and QLoRA")
    st.markdown(
        f"The sidebar's own scenario ({context.scenario.optimizer.value}, {context.scenario.precision.value}, "
        f"batch {scenario.batch_size} × {scenario.grad_accum_steps} accumulation) three ways: every parameter "
        "trained, LoRA adapters on a frozen base, and the same on a 4-bit base, with the sidebar's LoRA settings.")
    methods = method_comparison(context, records, key="techniques_compare_methods")
    if methods is not None:
        # Twelve columns in the page's width (TABLE_WIDTH_PX in the tests): the formatted peak
        # (or the refusal) and the measured bytes stand for their pairs, full text on hover.
        byte_column = {"format": "localized", "width": 80}
        st.dataframe(
            method_table(methods, context.capacity_bytes), hide_index=True, key="methods_table",
            column_order=("method", "settings", "weights (bytes)", "gradients (bytes)", "optimizer state (bytes)",
                          "activations (bytes)", "peak (bytes)", "peak", "trainable parameters",
                          "frozen weights (bytes)", "measured peak (bytes)", "measured by"),
            column_config={
                "method": st.column_config.TextColumn("method", width=85),
                "settings": st.column_config.TextColumn("settings", width=100),
                "weights (bytes)": st.column_config.NumberColumn("weights", **byte_column),
                "gradients (bytes)": st.column_config.NumberColumn("gradients", **byte_column),
                "optimizer state (bytes)": st.column_config.NumberColumn("opt. state", **byte_column,
                                                                         help="optimizer state (bytes)"),
                "activations (bytes)": st.column_config.NumberColumn("activations", **byte_column,
                                                                     help="saved by one micro-batch's forward"),
                "peak (bytes)": st.column_config.NumberColumn("peak bytes", **byte_column),
                "peak": st.column_config.TextColumn("peak", width=70, help="estimated peak, or why it is refused"),
                "trainable parameters": st.column_config.NumberColumn("trainable", format="localized", width=80,
                                                                      help="trainable parameters"),
                "frozen weights (bytes)": st.column_config.NumberColumn("frozen", **byte_column,
                                                                        help="frozen weights (bytes)"),
                "measured peak (bytes)": st.column_config.NumberColumn("measured", **byte_column,
                                                                       help="measured peak (bytes); empty: no run"),
                "measured by": st.column_config.TextColumn("by", width=40, help="measurement mode of the run"),
            })
        for row in methods:
            if row.error is not None:
                st.caption(f"{row.method.value}: {markdown_text(row.error)}")
        st.caption("Bytes are the estimate's totals by category (the Plan page shows them at the peak). Measured: "
                   "a finished run of exactly that plan in the run history, LoRA settings included.")


render()
