#!/usr/bin/env bash
# Packs, into .whl/ (ignored by git), the pinned packages a lent GPU machine lacks, so that
# benchmarks/gpu_check.sh there measures with the transformers this project pins and with
# bitsandbytes and PEFT. That machine cannot reach a package registry, its Python is 3.12
# with a CUDA 13.0 torch build of its own (2.11 when last read: library/device/KINDS.md),
# and the working tree that travels to it is limited to 64 MiB, of which the tracked files
# take about 52 MB. So:
#   - transformers and bitsandbytes travel as xz archives of their installed files (the
#     transformers wheel alone is 13.5 MB, its xz archive 3.8 MB), bitsandbytes with its
#     CUDA 13.0 and CPU libraries only (the other CUDA and ROCm builds are 120 MB);
#   - PEFT travels as its wheel, and regex (transformers needs a recent one; compiled) as a
#     CPython 3.12 wheel.
# benchmarks/gpu_check.sh unpacks .whl/*.tar.xz and .whl/*.whl into a temporary folder put
# first on PYTHONPATH. On the lent machine (carry: [".whl"]):
#   bash benchmarks/gpu_check.sh --out "$OUT" --export "$OUT"
# Usage, here, after bash scripts/setup_env.sh:  bash scripts/pack_for_device.sh [CUDA]
#   CUDA: the device torch's CUDA version without the dot (default 130, i.e. 13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda="${1:-130}"
python_bin=.venv/bin/python
[ -x "$python_bin" ] || { echo "pack_for_device: no .venv here: run bash scripts/setup_env.sh first" >&2; exit 2; }
site="$("$python_bin" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
[ -f "$site/bitsandbytes/libbitsandbytes_cuda$cuda.so" ] || {
    echo "pack_for_device: bitsandbytes has no CUDA $cuda library ($site/bitsandbytes)" >&2; exit 2; }
rm -rf .whl && mkdir -p .whl
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

dist_info() {  # the installed package's dist-info folder name (metadata.version reads it)
    "$python_bin" -c "from importlib import metadata; d = metadata.distribution('$1'); print(f\"{d.metadata['Name'].replace('-', '_')}-{d.version}.dist-info\")"
}
stage() {  # name, then the folders under site-packages it holds
    local name="$1"; shift
    mkdir -p "$work/$name"
    for folder in "$@"; do cp -r "$site/$folder" "$work/$name/"; done
    find "$work/$name" -name __pycache__ -prune -exec rm -rf {} +
}
pack() {
    tar -C "$work/$1" -cf - . | xz -9 -T0 > ".whl/$1.tar.xz"
}

stage transformers transformers "$(dist_info transformers)"
pack transformers
stage bitsandbytes bitsandbytes "$(dist_info bitsandbytes)"
find "$work/bitsandbytes/bitsandbytes" -maxdepth 1 -name 'libbitsandbytes_*.so' \
    ! -name "libbitsandbytes_cuda$cuda.so" ! -name 'libbitsandbytes_cpu.so' -delete
pack bitsandbytes

peft_version="$("$python_bin" -c 'from importlib import metadata; print(metadata.version("peft"))')"
"$python_bin" -m pip download -q --no-deps --only-binary=:all: -d .whl "peft==$peft_version"
"$python_bin" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl regex
ls -l .whl
echo "pack_for_device: $(du -cb .whl | tail -1 | cut -f1) bytes in .whl/; tracked files: $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes (64 MiB travel in all)"
