"""Report export: the plan, its technique comparison and verification results as one
self-contained HTML file (interactive plotly charts, plotly.js inline, no network needed),
Markdown, CSV or JSON. No Streamlit here: the dashboard's Report page and the command line
(`python -m reporting ... --out FILE`, reporting/cli.py) both call build_report / render_report.
The tables and figures a report shows are the pages' own, built once in `views`.
"""

from reporting.build import (
    Report,
    build_report,
    render_report,
    report_for_values,
    write_report,
)

__all__ = ["Report", "build_report", "render_report", "report_for_values", "write_report"]
