"""What the dashboard's pages and the exported report both show, built once: plain Python,
no Streamlit. Pages lay these objects out with widgets; the report renders the same ones.

breakdown.py (the table at the peak and the fits verdict), comparison.py (the lessons'
techniques side by side, memory against batch size), figures.py (plotly figures),
fit_table.py (the fit finder's rows and the nearest plans), multi_gpu_figures.py (the
strategies' memory, traffic and local SGD, tables and figures), verify_results.py
(verification requests, run history tables, estimated against measured), history_access.py
(reading the run history), escaping.py (user text for Markdown, Plotly and CSV),
inputs.py (the sidebar's values, GPU presets, and what they mean to the planner).

Layers, bottom to top: planner -> runners -> views -> (report) -> pages -> app.py; a module
imports only from its own layer and those beneath it (tests/test_layers.py).
"""
