"""Several asynchronous collectives of one MPI group: all outstanding at once, or one after another.

    python benchmarks/mpi_queue.py [--ranks 2] [--rounds 30]

Starts `ranks` processes under mpiexec (one thread each). Each round, every rank writes
four gradient-like buckets (1 MiB, 777 KiB, 1 MiB, 806 KiB of fp32, as the small GPT's
bidirectional pipeline all-reduces after its last backward), then all-reduces them
asynchronously and waits for all four, two ways alternating round by round:

- together: four MPI Iallreduce requests outstanding at once, then waited (what the
  runtime's MPI communicator did before it queued collectives per group);
- queued: through runtime.comm.mpi.MpiCommunicator, which starts a group's next collective
  only when the one before it is done.

Prints the mean and median milliseconds of each and their ratio (together / queued).

Measured on the project's 2-core VM, 2 ranks, the two ways alternating in one run: together
2.1-2.3 ms, queued 1.25-1.3 ms while the VM moved data fast; 3.4-3.6 ms against 2.85-2.9 ms
while it moved data slowly. Hence the runtime's queue per group (runtime/comm/mpi.py).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = (1 << 18, 777 * 256, 1 << 18, 806 * 256)  # fp32 elements


def worker(rounds: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    from mpi4py import MPI

    from runtime.comm.mpi import MpiCommunicator

    torch.set_num_threads(1)
    comm = MpiCommunicator(timeout=60.0)
    group = comm.group(range(comm.world_size))
    bufs = [torch.ones(n) for n in BUCKETS]
    src = [torch.ones(n) for n in BUCKETS]
    times: dict[str, list[float]] = {"together": [], "queued": []}
    for r in range(rounds + 2):
        for way in ("together", "queued"):
            for b, s in zip(bufs, src):
                b.copy_(s)
            group.all_reduce(torch.zeros(1))  # start together
            t0 = time.perf_counter()
            if way == "together":
                reqs = [MPI.COMM_WORLD.Iallreduce(MPI.IN_PLACE, b.numpy(), MPI.SUM) for b in bufs]
                while not MPI.Request.Testall(reqs):
                    os.sched_yield()
            else:
                handles = [group.all_reduce(b, async_op=True) for b in bufs]
                for h in handles:
                    h.wait()
            if r >= 2:  # warm-up rounds
                times[way].append(time.perf_counter() - t0)
    if comm.rank == 0:
        t, q = times["together"], times["queued"]
        mib = sum(BUCKETS) * 4 / 2**20
        print(f"four async all-reduces of {mib:.2f} MiB in all over {comm.world_size} ranks, {rounds} rounds each:")
        print(f"  together: mean {statistics.mean(t) * 1e3:.3f} ms, median {statistics.median(t) * 1e3:.3f} ms")
        print(f"  queued:   mean {statistics.mean(q) * 1e3:.3f} ms, median {statistics.median(q) * 1e3:.3f} ms")
        print(f"  together / queued: {statistics.mean(t) / statistics.mean(q):.2f} (means), "
              f"{statistics.median(t) / statistics.median(q):.2f} (medians)")
    comm.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mpi_rounds

    sys.exit(mpi_rounds.main(__doc__, __file__, worker, default_rounds=30))
