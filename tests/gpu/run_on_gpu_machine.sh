#!/usr/bin/env bash
# Run meshplan's gpu test tier (tests/gpu) on a machine with a GPU, PyTorch (2.11 or newer),
# transformers and mpi4py, but no package registry: from this checkout, without installing meshplan.
#
#   tests/gpu/run_on_gpu_machine.sh WHEELS_DIR [pytest options...]
#
# WHEELS_DIR holds the wheels of what such a machine lacks: OR-Tools (the planner's sharding integer
# program) and the two packages it needs that are missing or too old there. Fetch them where pip
# reaches a registry (for CPython 3.12 on x86-64 Linux; change --python-version to the GPU
# machine's Python):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#       -d WHEELS_DIR ortools==9.15.6755 immutabledict==4.3.1 protobuf==6.33.6
#
# The script installs them (pip install --no-index --no-deps --target, into a temporary directory
# removed at exit), puts that directory and this checkout first on PYTHONPATH (the rank processes the
# tests start inherit it), prints what it runs on, and runs `python3 -m pytest tests/gpu` (with any
# further arguments). A `meshplan` command (python3 -m planner.app.cli) is on PATH for tests that
# start it. The exit status is pytest's (2 for a usage error here). PYTHON picks the interpreter
# (default: python3, the one that holds PyTorch).
set -euo pipefail

usage() { echo "usage: $0 WHEELS_DIR [pytest options...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
wheels=$1
shift
[ -d "$wheels" ] || { echo "$0: $wheels is not a directory of wheels" >&2; usage; }
compgen -G "$wheels/*.whl" >/dev/null || { echo "$0: no .whl files in $wheels (see this script's header)" >&2; exit 2; }

py=${PYTHON:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)   # the checkout's root
work=$(mktemp -d "${TMPDIR:-/tmp}/meshplan-gpu-tier.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "$wheels"/*.whl
mkdir -p "$work/bin"
printf '#!/bin/sh\nexec %q -m planner.app.cli "$@"\n' "$py" >"$work/bin/meshplan"
chmod +x "$work/bin/meshplan"

export PYTHONPATH="$here:$work/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$work/bin:$PATH"
export PYTHONUNBUFFERED=1
export MESHPLAN_CACHE_DIR="$work/cache"   # tests/conftest.py isolates it too; so does anything started here

cd "$here"
"$py" - <<'EOF'
import sys
import ortools
import torch
import transformers

cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"ortools {ortools.__version__} ({ortools.__path__[0]}); CUDA: "
      + (f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})"
         if cuda else "none (every test of the tier will be skipped)"), flush=True)
EOF
set +e
"$py" -m pytest tests/gpu -p no:cacheprovider -rs "$@"
exit $?
