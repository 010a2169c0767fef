"""The fit finder's answer (planner.fit.FitResult) as table rows, built once beneath the What
fits page and the report: the plans that fit, best first, each with its changes to the
user's plan and the risks they take; when nothing fits, the nearest plans and by how much
each misses. Raw numbers (bytes, seconds) sit beside the formatted sizes (binary units)."""

from __future__ import annotations

from planner.fit import Change, FitResult, Risk
from planner.units import format_bytes

YOUR_PLAN = "none (your plan)"


def changes_text(changes: tuple[Change, ...]) -> str:
    """The changes to the user's plan in words, costliest first; "none (your plan)" for their own."""
    return "; ".join(change.text for change in changes) if changes else YOUR_PLAN


def risks_text(risks: tuple[Risk, ...]) -> str:
    """The risks to model quality a plan takes, in words; empty when it takes none."""
    return "; ".join(risk.value for risk in risks)


def _plan_columns(rank: int, plan, j: dict) -> dict:
    """The columns a fitting plan and a near miss share (`plan`: a FitOption or NearMiss,
    `j` its JSON)."""
    return {
        "rank": rank, "changes": changes_text(plan.changes), "risks": risks_text(plan.risks),
        "method": j["finetune"], "optimizer": j["optimizer"], "precision": j["precision"],
        "checkpointing": j["gradient_checkpointing"], "micro-batch": j["batch_size"],
        "accumulation": j["grad_accum"], "strategy": j["strategy"],
    }


def fit_rows(result: FitResult) -> list[dict]:
    """One row per plan that fits, best first."""
    rows = []
    for rank, option in enumerate(result.options, 1):
        j = option.to_json()
        rows.append({
            **_plan_columns(rank, option, j),
            "largest micro-batch": j["max_batch_size"], "largest sequence": j["max_seq_len"],
            "peak": format_bytes(j["peak_bytes"]), "peak (bytes)": j["peak_bytes"],
            "step time (s)": j["step_time_s"], "tokens/s": j["tokens_per_s"],
        })
    return rows


def nearest_rows(result: FitResult) -> list[dict]:
    """When nothing fits: one row per nearest plan, nearest first, with how far over the
    capacity per GPU its peak is (bytes and percent of the capacity)."""
    rows = []
    for rank, miss in enumerate(result.nearest, 1):
        j = miss.to_json()
        rows.append({
            **_plan_columns(rank, miss, j),
            "peak": format_bytes(j["peak_bytes"]), "peak (bytes)": j["peak_bytes"],
            "over by": format_bytes(j["over_bytes"]), "over by (bytes)": j["over_bytes"],
            "over by (%)": j["over_pct"],
        })
    return rows
