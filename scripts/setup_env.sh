#!/usr/bin/env bash
# Creates .venv (once) and installs the project's requirements into it.
# torch is pinned to 2.13.0: on this project's machines pip takes the CPU build lying on
# disk; on a machine with CUDA the same pin resolves to the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
requirements="${1:-requirements.txt}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r "$requirements"
