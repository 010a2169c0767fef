#!/usr/bin/env bash
# Installs what the dashboard needs and starts it on http://localhost:8501.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh requirements.txt
exec .venv/bin/python -m streamlit run app.py "$@"
