"""Dashboard pages (run by app.py's st.navigation router) and the plain modules they use.

Pages: plan.py, what_fits.py, techniques.py, verify.py, report.py.
Plain modules, with no Streamlit: inputs.py (sidebar values -> planner inputs),
query_state.py (sidebar values <-> the URL query string), breakdown.py (tables and the
fits verdict; the largest batch / sequence and the fit finder are planner.fit), comparison.py (the
lessons' techniques side by side), verify_results.py (verification requests, run history
tables), run_queue.py (the process-wide verification queue), history_access.py (reading
the run history), figures.py (plotly figures). The report builder is the top-level
`reporting` package.
Streamlit glue shared by pages: model_cache.py, page_context.py.
"""
