#!/bin/bash
# The Python package's tests (pytest, tests/python) against the build:
#   run.sh BUILD_DIR
# PyTorch and pytest come from Debian (python3-torch, python3-pytest):
# deploy/build.sh installs them when it builds everything; without them
# (and without a way to install them) the tests are skipped (exit 77).
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
python=/usr/bin/python3
if ! "$python" -c 'import torch, pytest, numpy' 2>/dev/null; then
  echo "python3-torch, python3-pytest or python3-numpy missing: run deploy/build.sh (no target) first" >&2
  exit 77
fi
if [ ! -f "$build"/python/pstrain/__init__.py ]; then
  echo "no Python package in $build/python (pybind11-dev missing at configure time?)" >&2
  exit 1
fi
export PYTHONPATH="$build/python:$here${PYTHONPATH:+:$PYTHONPATH}"
export PSTRAIN_BIN_DIR="$build/bin"
# One BLAS and one torch thread per process, as pstrain's own workers run.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# The ten slowest tests are listed at the end (where CI time goes).
exec "$python" -m pytest -q --durations=10 -p no:cacheprovider "$here"
