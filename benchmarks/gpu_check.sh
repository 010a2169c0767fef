#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): every CUDA measurement the project
# needs, in one run under 8 minutes on one H100/H200 (about 4-5 minutes expected):
# 21 scenarios in child processes (recorded in the run history; one not started within the
# 5.5-minute budget is recorded as skipped, and `--only ID,...` runs it next), the allocator check
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
# Packages carried to a machine that cannot install from the network (a lent GPU machine:
# scripts/pack_for_device.sh puts the pinned transformers, bitsandbytes, PEFT and regex in
# .whl/, as wheels and as xz archives of installed files): unpacked for this run only, into
# a folder put first on PYTHONPATH (the runs' children inherit it).
if compgen -G ".whl/*.whl" >/dev/null || compgen -G ".whl/*.tar.xz" >/dev/null; then
    site="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")"
    "$python_bin" - "$site" <<'PY'
import glob, re, sys, tarfile, zipfile
site = sys.argv[1]
here = f"cp{sys.version_info.major}{sys.version_info.minor}"
for path in sorted(glob.glob(".whl/*.tar.xz")):
    with tarfile.open(path) as archive:
        archive.extractall(site, filter="data")
for path in sorted(glob.glob(".whl/*.whl")):
    built_for = re.search(r"-(cp3\d+)-", path)
    if built_for and built_for.group(1) != here:  # a compiled wheel for the lent machine's Python
        print(f"gpu_check: {path} is built for {built_for.group(1)}, not {here}: not used", file=sys.stderr)
        continue
    with zipfile.ZipFile(path) as wheel:
        wheel.extractall(site)
PY
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# --script PATH runs another GPU script with the same packages (benchmarks/gpu_memory_snapshot.py).
script=benchmarks/gpu_check.py
if [ "${1:-}" = "--script" ]; then script="$2"; shift 2; fi
exec "$python_bin" "$script" "$@"
