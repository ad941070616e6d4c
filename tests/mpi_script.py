"""Run a Python snippet on 2 MPI ranks (mpiexec, one thread each, this checkout on PYTHONPATH)."""

import os
import subprocess
import sys
from pathlib import Path

from runtime.launch.launcher import mpiexec_args

ROOT = Path(__file__).resolve().parents[1]


def run_on_two_ranks(code: str, timeout: float) -> list[list[str]]:
    """The whitespace-split lines both ranks printed that start with "ok" or "wrong", sorted;
    fails the test (with the output's tail) when the run exits non-zero."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([*mpiexec_args(2), "-x", "PYTHONPATH", sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return sorted(line.split() for line in out.stdout.splitlines() if line.startswith(("ok", "wrong")))
