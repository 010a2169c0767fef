"""Tables as Markdown: the report's Markdown export and the Plan page's static tables.

The Plan page writes its tables as Markdown rather than st.table: an Arrow table needs two
JavaScript chunks (1.2 MiB) that each new browser session fetched before its first page was
complete (benchmarks/browser_speed.py). Every cell is escaped (views.escaping.markdown_text),
so a model or file name renders as its text.
"""

from __future__ import annotations

import math

import pandas as pd

from views.escaping import markdown_text


def float_cell(value: float) -> str:
    # Step times, throughputs and percentages: two decimals are what a reader compares, in
    # HTML as in Markdown (46.404661 s -> 46.40, 56040.529397 tokens/s -> 56,040.53).
    return f"{value:,.2f}"


def markdown_cell(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if isinstance(value, float):
        return float_cell(value)
    return markdown_text(value)


def markdown_table(table: pd.DataFrame, right: tuple[str, ...] = ()) -> str:
    """`table` as a GitHub-flavoured Markdown table; the columns named in `right` aligned right
    (byte counts, so that their digits line up)."""
    header = "| " + " | ".join(markdown_cell(c) for c in table.columns) + " |"
    rule = "|" + "|".join("---:" if c in right else "---" for c in table.columns) + "|"
    rows = ["| " + " | ".join(markdown_cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *rows])
