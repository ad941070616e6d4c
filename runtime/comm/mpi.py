"""`MpiCommunicator`: runtime.comm's Communicator protocol over mpi4py.

Non-blocking MPI calls on NumPy views of CPU tensors, completed by polling with a
deadline while watching for an abort message from a failed peer (runtime/comm/__init__.py's
failure protocol); a process group's collectives start one after another in the order
issued (MpiCommunicator._enqueue). mpi4py is imported when a communicator is made.

An abort message is UTF-8 JSON ({"reason": text}) signed with the job secret as the
store's messages are (runtime/comm/jobauth.py): bytes from a peer are never unpickled, and
one that does not verify is logged and ignored.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Callable, Sequence

import torch

from runtime.comm import CommError, Group, PeerFailure, SoloGroup, group_send_recv
from runtime.comm.jobauth import SECRET_ENV, Signer, shown, signer_from_env
from runtime.vocab import Backend, Collective

# Above every p2p_tag (which stay below 2**29); OpenMPI's MPI_TAG_UB is 2**31 - 1.
_ABORT_TAG = 1_500_000_000
_ACK_TAG = 1_500_000_001
_ABORT_BYTES = 1 << 16
# characters of a failure reason sent: JSON escapes each at most as \uXXXX, and the signed message
# (64 hex digits, a separator, the JSON) must fit the receive buffer
_REASON_CHARS = 8000
# Seconds an MPI wait keeps its core (testing, yielding in between) before it sleeps, when the
# node's ranks fit its cores (MpiCommunicator).
YIELD_SPIN_S = 0.02


def _node_cpus() -> int:
    # The node's CPUs, not this process's affinity: mpiexec binds each rank to one core by
    # default, and ranks bound to cores of their own do not oversubscribe the node.
    return os.cpu_count() or 1


class _MpiHandle:
    """A pending MPI request. `keep`: the buffers MPI reads and writes until it completes; the
    handle holds them (mpi4py does not), so that a caller's temporary tensor cannot be freed
    and its memory reused while MPI still writes into it. `req` is None for a collective
    still queued behind an earlier one of its group (MpiCommunicator._enqueue)."""

    def __init__(self, comm: "MpiCommunicator", req, what: str, after: Callable[[], None] | None = None,
                 keep: tuple = ()):
        self._comm = comm
        self._req = req
        self._what = what
        self._after = after
        self._keep = keep
        self._callbacks: list[Callable[[], None]] = []
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._comm._poll(self, self._what)
        self._done = True
        self._keep = ()
        if self._after is not None:
            self._after()
        for fn in self._callbacks:
            fn()

    def on_complete(self, fn):
        self._callbacks.append(fn)


def _np(t: torch.Tensor):
    if t.device.type != "cpu":
        raise ValueError("the MPI communicator moves CPU tensors only; use --backend nccl on GPUs")
    if not t.is_contiguous():
        raise ValueError("the MPI communicator needs contiguous tensors")
    if t.dtype == torch.bfloat16:
        return t.detach().view(torch.int16).numpy()
    return t.detach().numpy()


class _MpiGroup:
    def __init__(self, comm: "MpiCommunicator", ranks: tuple[int, ...], mpi_comm):
        self.ranks = ranks
        self._comm = comm
        self._c = mpi_comm

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self._c.Get_rank()

    def _run(self, start: Callable[[], object], what, async_op, after=None, keep=()):
        """Start the collective `start()` begins (queued behind this group's unfinished ones)."""
        h = _MpiHandle(self._comm, None, f"{what} on ranks {list(self.ranks)}", after, keep)
        self._comm._enqueue(self, h, start)
        if async_op:
            return h
        h.wait()
        return None

    def all_reduce(self, tensor, op="sum", async_op=False):
        from mpi4py import MPI

        if tensor.dtype == torch.bfloat16:
            raise ValueError("the MPI communicator cannot reduce bfloat16 tensors; use fp32 or gloo/nccl")
        mop = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        buf = _np(tensor)
        return self._run(lambda: self._c.Iallreduce(MPI.IN_PLACE, buf, mop), f"all_reduce({op})", async_op,
                         keep=(buf,))

    def all_gather(self, output, tensor, async_op=False):
        src = tensor.clone() if tensor.data_ptr() == output.data_ptr() else tensor
        # Gather into a buffer of our own and copy out on completion: handing `output` to numpy
        # would mark its storage non-resizable for good, and ZeRO-3 frees and re-grows the
        # parameter storage it gathers into between uses.
        staging = torch.empty_like(output)
        bufs = (_np(src), _np(staging))
        return self._run(lambda: self._c.Iallgather(*bufs), Collective.ALL_GATHER, async_op,
                         after=lambda: output.copy_(staging), keep=bufs)

    def reduce_scatter(self, output, tensor, async_op=False):
        from mpi4py import MPI

        bufs = (_np(tensor), _np(output))
        return self._run(lambda: self._c.Ireduce_scatter_block(*bufs, MPI.SUM), Collective.REDUCE_SCATTER, async_op,
                         keep=bufs)

    def broadcast(self, tensor, src, async_op=False):
        buf = _np(tensor)
        return self._run(lambda: self._c.Ibcast(buf, root=self.ranks.index(src)), Collective.BROADCAST, async_op,
                         keep=(buf,))

    def all_to_all(self, output, tensor, async_op=False):
        bufs = (_np(tensor), _np(output))
        return self._run(lambda: self._c.Ialltoall(*bufs), Collective.ALL_TO_ALL, async_op, keep=bufs)

    def send_recv(self, send, dst, recv, src, tag):
        return group_send_recv(self._comm, self.ranks, send, dst, recv, src, tag)


class MpiCommunicator:
    """mpi4py over MPI.COMM_WORLD; every wait polls with a deadline and watches for an abort."""

    backend = Backend.MPI.value

    def __init__(self, timeout: float = 300.0, signer: Signer | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        self._world = MPI.COMM_WORLD
        self.rank = self._world.Get_rank()
        self.world_size = self._world.Get_size()
        self.device = torch.device("cpu")
        self.timeout = float(timeout)
        self._groups: dict[tuple[int, ...], Group] = {}
        self.signer = signer if signer is not None else signer_from_env()
        self._abort_buf = bytearray(_ABORT_BYTES)
        self._abort_req = self._post_abort_recv()
        self._abort_reason: str | None = None
        self._failed = False
        self._group_tag = 100
        # MPI has no progress thread: a wait must keep testing. When this node's ranks fit its
        # cores, a wait keeps its core (yielding between tests) for up to YIELD_SPIN_S before
        # backing off to sleeps: a sleep of 0.2 ms costs 0.2 ms to several ms on a loaded or
        # virtualized host, far more than the microseconds a small shared-memory transfer takes.
        # With more ranks than cores the sleeps start at once, leaving the cores to the others.
        local = self._world.Split_type(MPI.COMM_TYPE_SHARED)
        self._local_ranks = local.Get_size()
        local.Free()
        self._yield_spin_s = YIELD_SPIN_S if self._local_ranks <= _node_cpus() else 0.0
        # Collectives of one group run one at a time, in the order issued (every member issues
        # them in the same order, so every member starts them in that order too). Open MPI
        # progresses several outstanding non-blocking collectives of a communicator slower than
        # the same ones one after another (benchmarks/mpi_queue.py measures both ways).
        # Every poll, whatever it waits for, starts a group's next one once its predecessor is done.
        self._queues: dict[int, collections.deque] = {}

    def _post_abort_recv(self):
        self._abort_buf[:] = bytes(_ABORT_BYTES)
        return self._world.Irecv([self._abort_buf, self._MPI.BYTE], source=self._MPI.ANY_SOURCE, tag=_ABORT_TAG)

    def _abort_message(self, data: bytes) -> str | None:
        """The reason a signed abort message carries; None (logged) for any other bytes."""
        text = self.signer.verify(data)
        try:
            reason = json.loads(text)["reason"] if text is not None else None
        except (ValueError, TypeError, KeyError):
            reason = None
        if not isinstance(reason, str):
            print(f"meshplan rank {self.rank}: warning: ignored a failure message on the MPI abort channel that "
                  f"fails authentication ({shown(data)}); every rank of a job needs the same {SECRET_ENV}",
                  file=sys.stderr, flush=True)
            return None
        return reason

    def _received_abort(self) -> str | None:
        """A peer's verified failure reason, once one has arrived (a message that does not verify is
        dropped and the channel listens again)."""
        if self._abort_reason is not None:
            return self._abort_reason
        if not self._abort_req.Test():
            return None
        data = bytes(self._abort_buf).rstrip(b"\0")
        self._abort_req = self._post_abort_recv()
        self._abort_reason = self._abort_message(data)
        return self._abort_reason

    def group(self, ranks: Sequence[int]) -> Group:
        key = tuple(int(r) for r in ranks)
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} asked for group {list(key)} that does not contain it")
        if key not in self._groups:
            if len(key) == 1:
                self._groups[key] = SoloGroup(self.rank)
            elif key == tuple(range(self.world_size)):
                self._groups[key] = _MpiGroup(self, key, self._world)
            else:
                g = self._world.Get_group().Incl(list(key))
                self._groups[key] = _MpiGroup(self, key, self._world.Create_group(g, tag=self._group_tag))
                self._group_tag += 1
        return self._groups[key]

    def isend(self, tensor, peer, tag):
        buf = _np(tensor)
        return _MpiHandle(self, self._world.Isend(buf, dest=peer, tag=tag), f"send to rank {peer} (tag {tag})",
                          keep=(buf,))

    def irecv(self, tensor, peer, tag):
        buf = _np(tensor)
        return _MpiHandle(self, self._world.Irecv(buf, source=peer, tag=tag), f"recv from rank {peer} (tag {tag})",
                          keep=(buf,))

    @property
    def single_node(self) -> bool:
        """Every rank runs on this node (shared memory reaches them all)."""
        return self._local_ranks == self.world_size

    def share(self, value, root: int = 0):
        """`root`'s `value` (small, JSON: numbers, strings, lists, None; a tuple comes back a list) on every
        rank; a collective over all ranks. Sent as JSON bytes: nothing a peer sends is unpickled."""
        import numpy as np

        data = json.dumps(value).encode() if self.rank == root else b""
        size = np.array([len(data)], dtype=np.int64)
        self._world.Bcast(size, root=root)
        buf = bytearray(data) if self.rank == root else bytearray(int(size[0]))
        self._world.Bcast([buf, self._MPI.BYTE], root=root)
        return json.loads(bytes(buf))

    def barrier(self) -> None:
        self._poll(self._world.Ibarrier(), "barrier")

    def _enqueue(self, group: "_MpiGroup", handle: _MpiHandle, start: Callable[[], object]) -> None:
        """Queue `handle`'s collective (begun by start()) behind `group`'s unfinished ones."""
        self._queues.setdefault(id(group), collections.deque()).append((handle, start))
        self._advance_group(id(group))  # starts it now when the group has nothing unfinished before it

    def _advance(self) -> None:
        """Start each group's next queued collective once the one before it is done."""
        for key in list(self._queues):
            self._advance_group(key)

    def _advance_group(self, key: int) -> None:
        q = self._queues[key]
        while q:
            head = q[0][0]
            if head._req is None:
                head._req = q[0][1]()
            if not head._req.Test():  # a completed request becomes MPI.REQUEST_NULL: Test() stays True
                break
            q.popleft()
        if not q:
            del self._queues[key]

    def _poll(self, req, what: str) -> None:
        """Wait for `req` (an MPI request, or a handle whose collective may still be queued),
        testing it and the other pending collectives, with a deadline, watching for an abort."""
        if isinstance(req, _MpiHandle):
            def done() -> bool:
                return req._req is not None and req._req.Test()
        else:
            done = req.Test
        start = time.monotonic()
        deadline = start + self.timeout
        spin_until = start + self._yield_spin_s
        spins = 0
        while True:
            if self._queues:
                self._advance()
            if done():
                break
            if self._received_abort() is not None:
                raise PeerFailure(self._abort_reason)
            now = time.monotonic()
            if now > deadline:
                raise CommError(f"rank {self.rank}: {what} did not complete within {self.timeout:.0f} s")
            spins += 1
            if now < spin_until:
                os.sched_yield()
            elif spins > 200:
                time.sleep(min(1e-3, 1e-6 * spins))

    def report_failure(self, reason: str, grace: float = 3.0) -> None:
        self._failed = True
        data = self.signer.sign(json.dumps({"reason": reason[:_REASON_CHARS]})).encode()
        reqs = [self._world.Isend([data, self._MPI.BYTE], dest=r, tag=_ABORT_TAG)
                for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + grace
        acks = [self._world.Irecv(bytearray(8), source=r, tag=_ACK_TAG)
                for r in range(self.world_size) if r != self.rank]
        while time.monotonic() < deadline and not all(a.Test() for a in acks):
            time.sleep(0.01)
        del reqs

    def failure_reason(self, timeout: float = 2.0) -> str | None:
        deadline = time.monotonic() + timeout
        while self._received_abort() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._abort_reason

    def acknowledge_failure(self, grace: float = 10.0) -> None:
        # Tell every rank (the failing one waits for acks before it exits).
        for r in range(self.world_size):
            if r != self.rank:
                self._world.Isend(bytearray(8), dest=r, tag=_ACK_TAG)

    def shutdown(self) -> None:
        self._groups.clear()
        self._queues.clear()  # collectives issued but never waited for (none in a finished run)
        if not self._abort_req.Test():
            self._abort_req.Cancel()
            self._abort_req.Wait()
