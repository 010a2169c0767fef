"""Starts the dashboard (`streamlit run app.py`) with what its pages import already loaded.

A Streamlit server imports a page's modules on the first session's first script run:
pandas, Plotly and the planner take about 1.5 s on two cores, all of it in front of the
first user's first page. Imported here first, in the server's own process, they are
shared by every session, so the first page costs what later ones do. Nothing is computed
for any session: the caches still fill on first use.

Run: .venv/bin/python scripts/serve.py [streamlit options], as scripts/dashboard.sh does.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the pages import (the plain modules beneath them; a page module itself draws when imported).
WARM_MODULES = ("pandas", "plotly.graph_objects", "views", "views.breakdown", "views.comparison", "views.figures",
                "views.fit_table", "views.inputs", "app_pages.fit_view", "app_pages.query_state",
                "planner.estimate", "planner.fit", "planner.verdict", "planner.loading", "reporting")


def warm() -> None:
    sys.path.insert(0, str(ROOT))
    for name in WARM_MODULES:
        importlib.import_module(name)
    from views.inputs import DEFAULTS
    from planner.loading import load_model_shape
    from planner.scenario import Task

    # The default model's shape file and Plotly's validators (imported lazily, on first use).
    load_model_shape(str(DEFAULTS["catalog_model"]), Task(DEFAULTS["task"]))
    import plotly.graph_objects as go

    go.Figure(data=[go.Bar(x=[0], y=[0]), go.Scatter(x=[0], y=[0])]).to_dict()


def main() -> None:
    warm()
    from streamlit.web import cli

    sys.argv = ["streamlit", "run", str(ROOT / "app.py"), *sys.argv[1:]]
    sys.exit(cli.main())


if __name__ == "__main__":
    main()
