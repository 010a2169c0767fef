"""Dashboard pages (run by app.py's st.navigation router): widgets and layout only.

Pages: plan.py, what_fits.py, techniques.py, multi_gpu.py, verify.py, report.py.
What a page shows and a report shows too (tables, figures, escaping, the sidebar's values
and GPU presets, the run history) is built in `views`, beneath both; the report itself is
`reporting`. Nothing beneath this package imports it (tests/test_layers.py).
Page-only plain modules, with no Streamlit: query_state.py (sidebar values <-> the URL
query string), fit_view.py (the What fits page's target and "apply this plan"),
run_queue.py (the process-wide verification queue).
Streamlit glue shared by pages: model_cache.py, page_context.py.
"""
