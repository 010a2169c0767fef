#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): every CUDA measurement the project
# needs, in one run under 8 minutes on one H100/H200 (about 4-5 minutes expected):
# 14 scenarios in child processes (recorded in the run history), the allocator check
# (benchmarks/allocator_gpu_check.py) and the fake-CUDA check
# (scripts/check_fake_cuda_on_gpu.py --steps). Writes benchmarks/results/gpu_check.{json,md}
# and benchmarks/results/allocator_gpu_check.{json,md}.
#   bash benchmarks/gpu_check.sh             # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --dry-run   # the same path on CPU, tiny configs, a temp dir
# Uses .venv when present (bash scripts/setup_env.sh makes it; on a CUDA machine the
# torch==2.13.0 pin resolves to a CUDA build), else the python on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=python3
[ -x .venv/bin/python ] && python_bin=.venv/bin/python
# Wheels carried to a machine that cannot install from the network (e.g. bitsandbytes on a
# lent GPU machine, whose image lacks it): put in .whl/, installed for this run only.
if compgen -G ".whl/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/gpu_check_site"
    "$python_bin" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python_bin" benchmarks/gpu_check.py "$@"
