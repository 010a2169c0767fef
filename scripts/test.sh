#!/usr/bin/env bash
# Installs what the tests need and runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh requirements-dev.txt
exec .venv/bin/python -m pytest "$@"
