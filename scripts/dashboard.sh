#!/usr/bin/env bash
# Installs what the dashboard needs and starts it on http://localhost:8501 (scripts/serve.py:
# `streamlit run app.py` with the modules its pages import loaded first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh requirements.txt
exec .venv/bin/python scripts/serve.py "$@"
