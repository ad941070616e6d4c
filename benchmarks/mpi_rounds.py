"""The command line of an MPI micro-benchmark that starts itself under mpiexec.

    sys.exit(mpi_rounds.main(__doc__, __file__, worker, default_rounds=30))

`python BENCH.py [--ranks N] [--rounds R]` starts N copies of BENCH.py under mpiexec
(OMP_NUM_THREADS=1 in each) with --worker, and each copy runs worker(R).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def main(doc: str, script: str, worker: Callable[[int], None], argv: list[str] | None = None, *,
         default_rounds: int = 30) -> int:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=default_rounds)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.rounds)
        return 0
    sys.path.insert(0, str(ROOT))
    from runtime.launch.launcher import mpiexec_args

    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [*mpiexec_args(args.ranks), "-x", "OMP_NUM_THREADS", sys.executable, script, "--worker",
           "--rounds", str(args.rounds)]
    return subprocess.run(cmd, env=env).returncode
