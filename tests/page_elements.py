"""Reading the Plan page's static elements back in AppTest: its Markdown tables
(views.markdown_table) and its SVG charts (views.svg_charts), whose drawn elements carry
their values as data- attributes."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pandas as pd

SVG = "{http://www.w3.org/2000/svg}"
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_ESCAPED = re.compile(r"\\(.)")


def markdown_tables(at) -> list[pd.DataFrame]:
    """Every Markdown table the page shows, cells as the text they render."""
    tables = []
    for element in at.markdown:
        lines = element.value.splitlines()
        if len(lines) < 2 or not lines[0].startswith("| ") or not set(lines[1]) <= set("|-: "):
            continue
        rows = [[_ESCAPED.sub(r"\1", cell.strip()) for cell in _CELL_SPLIT.split(line.strip())[1:-1]]
                for number, line in enumerate(lines) if number != 1]
        tables.append(pd.DataFrame(rows[1:], columns=rows[0]))
    return tables


def plan_charts(at) -> list[ET.Element]:
    return [ET.fromstring(element.value) for element in at.markdown if element.value.startswith("<svg class='plan-chart'")]


def chart(at, index: int) -> dict:
    """One chart's content: title, legend names, each series' batches and bytes (None: a gap),
    the user's marker, the capacity line's bytes."""
    root = plan_charts(at)[index]
    series = {}
    for group in root.iter(f"{SVG}g"):
        if group.get("class") != "series":
            continue
        drawn = {int(c.get("data-batch")): int(c.get("data-bytes")) for c in group.iter(f"{SVG}circle")}
        batches = [int(b) for b in group.get("data-batches").split()]
        series[group.get("data-name")] = {"x": batches, "bytes": [drawn.get(b) for b in batches]}
    current = next(({"batch": int(g.get("data-batch")), "bytes": int(g.get("data-bytes")),
                     "hover": g.find(f"{SVG}title").text}
                    for g in root.iter(f"{SVG}g") if g.get("class") == "current"), None)
    capacity = next((int(line.get("data-bytes")) for line in root.iter(f"{SVG}line")
                     if line.get("class") == "capacity"), None)
    legend = [g.get("data-name") for g in root.iter(f"{SVG}g") if g.get("class") == "legend-entry"]
    return {"title": root.get("aria-label"), "legend": legend, "series": series, "current": current,
            "capacity_bytes": capacity, "text": "".join(root.itertext())}
