#!/usr/bin/env bash
# Installs what the tests need and runs them, on two pytest-xdist workers (the suite is
# CPU-bound and mostly single-threaded; one test module per worker at a time, so module
# fixtures are built once; the longest modules first, in tests/conftest.py's order, which
# xdist keeps only with --no-loadscope-reorder). Extra arguments go to pytest (`-n 0` runs
# in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh requirements-dev.txt
# One math thread per worker: two workers on two cores, not four threads fighting for them.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder "$@"
