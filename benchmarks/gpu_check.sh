#!/usr/bin/env bash
# The CUDA verification matrix (benchmarks/gpu_check.py) on a machine with a GPU.
# Uses .venv when present (bash scripts/setup_env.sh makes it; on a CUDA machine the
# torch==2.13.0 pin resolves to a CUDA build), else the python on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=python3
[ -x .venv/bin/python ] && python_bin=.venv/bin/python
exec "$python_bin" benchmarks/gpu_check.py "$@"
