"""Dashboard pages (run by app.py's st.navigation router) and the plain modules they use.

Pages: plan.py. Plain modules, with no Streamlit: inputs.py (sidebar values -> planner
inputs), breakdown.py (tables and the fits verdict), figures.py (plotly figures).
Streamlit glue shared by pages: model_cache.py.
"""
