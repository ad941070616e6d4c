"""How the MPI communicator's wait policy changes a blocking collective's time, side by side.

    python benchmarks/mpi_wait.py [--ranks 2] [--rounds 40]

Starts `ranks` processes under mpiexec (one thread each). Each round, every rank
computes for about 0.3 ms (a 160 x 160 GEMM chain, as a layer would), then runs one
blocking all-reduce through runtime.comm.mpi.MpiCommunicator; the two wait policies
alternate round by round on the same processes:

- yield: keep the core, testing and yielding, for up to YIELD_SPIN_S before sleeping
  (the default when the node's ranks fit its cores);
- sleep: start sleeping (0.2 ms, growing to 1 ms) after 200 tests (the policy when
  ranks outnumber cores, and the only one before).

Prints, per message size, the mean and median seconds of the all-reduce under
each policy and their ratio (sleep / yield).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20)


def worker(rounds: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from runtime.comm.mpi import YIELD_SPIN_S, MpiCommunicator

    torch.set_num_threads(1)
    comm = MpiCommunicator(timeout=60.0)
    group = comm.group(range(comm.world_size))
    a = torch.randn(160, 160)
    times = {(n, p): [] for n in SIZES for p in ("yield", "sleep")}
    for n in SIZES:
        buf = torch.ones(max(n // 4, 1))
        for r in range(rounds + 2):
            for policy in ("yield", "sleep"):
                comm._yield_spin_s = YIELD_SPIN_S if policy == "yield" else 0.0
                for _ in range(3):
                    a @ a
                t0 = time.perf_counter()
                group.all_reduce(buf)
                if r >= 2:  # warm-up rounds
                    times[(n, policy)].append(time.perf_counter() - t0)
    if comm.rank == 0:
        print(f"{'bytes':>9}{'yield mean us':>15}{'median':>9}{'sleep mean us':>15}{'median':>9}{'sleep/yield':>13}")
        for n in SIZES:
            y, s = times[(n, "yield")], times[(n, "sleep")]
            print(f"{n:>9}{statistics.mean(y) * 1e6:>15.1f}{statistics.median(y) * 1e6:>9.1f}"
                  f"{statistics.mean(s) * 1e6:>15.1f}{statistics.median(s) * 1e6:>9.1f}"
                  f"{statistics.mean(s) / statistics.mean(y):>13.2f}")
    comm.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mpi_rounds

    sys.exit(mpi_rounds.main(__doc__, __file__, worker, default_rounds=40))
