"""`Communicator`: point-to-point and collective communication, behind one protocol.

Two implementations:

* `TorchCommunicator` over torch.distributed process groups (gloo on CPU,
  NCCL on GPU). Process groups are constructed directly from a TCPStore and
  kept in this object: nothing is registered in torch.distributed's global
  state, and a sub-group is built by its members only.
* `MpiCommunicator` over mpi4py (non-blocking MPI calls on NumPy views of
  CPU tensors, completed by polling with a deadline).

A `Group` is this rank's view of one set of ranks (a mesh axis): collectives
on it take tensors in place. Asynchronous calls return a `Handle`; `wait()`
completes it or raises `CommError` / `PeerFailure`.

Failure protocol (so no rank is left hanging): a rank that fails calls
`report_failure(reason)`, which publishes the reason (the TCPStore key
"meshplan/abort", or an MPI message to every rank) and then exits. Its
peers' pending operations fail (gloo: the connection closes; MPI: the
polling loop sees the abort message; every backend: the collective
timeout), they read the reason with `failure_reason()` and exit naming it.
"""

from __future__ import annotations

import collections
import datetime
import gc
import os
import pickle
import time
from typing import Callable, Protocol, Sequence

import torch

ABORT_KEY = "meshplan/abort"
ACK_KEY = "meshplan/abort_acks"
REDUCE_OPS = ("sum", "max", "min")


class CommError(RuntimeError):
    """A communication failed or timed out (the message names the operation)."""


class PeerFailure(RuntimeError):
    """Another rank failed; the message is its reason."""


class Handle(Protocol):
    """An asynchronous operation in flight."""

    def wait(self) -> None: ...

    def on_complete(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (from any thread) when the operation completes, or at wait() if the
        backend cannot tell earlier."""


class Group(Protocol):
    """This rank's view of a set of ranks. `rank` is the position of this process in `ranks`."""

    ranks: tuple[int, ...]

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle | None: ...

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        """output (size * n,) = concatenation of every member's tensor (n,), in group order."""

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        """output (n,) = this member's n-slice of the sum over members of tensor (size * n,)."""

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Handle | None:
        """`src` is a global rank in the group."""


class Communicator(Protocol):
    rank: int
    world_size: int
    backend: str
    device: torch.device

    def group(self, ranks: Sequence[int]) -> Group:
        """The group of `ranks` (which contain this rank). Members must ask in the same order."""

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...

    def barrier(self) -> None: ...

    def report_failure(self, reason: str, grace: float = 10.0) -> None:
        """Tell the other ranks why this rank stops (it exits afterwards)."""

    def failure_reason(self, timeout: float = 2.0) -> str | None: ...

    def acknowledge_failure(self, grace: float = 10.0) -> None:
        """This rank read another rank's reason and stops too."""

    def shutdown(self) -> None: ...


# ---------------------------------------------------------------------------
# trivial handles and groups


class DoneHandle:
    """An operation that completed when it was issued (size-1 groups)."""

    def wait(self) -> None:
        return None

    def on_complete(self, fn: Callable[[], None]) -> None:
        fn()


class SoloGroup:
    """A group of one rank: every collective is the identity."""

    def __init__(self, rank: int):
        self.ranks = (rank,)

    @property
    def size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def all_reduce(self, tensor, op="sum", async_op=False):
        return DoneHandle() if async_op else None

    def all_gather(self, output, tensor, async_op=False):
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor.reshape(-1))
        return DoneHandle() if async_op else None

    def reduce_scatter(self, output, tensor, async_op=False):
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor.reshape(-1))
        return DoneHandle() if async_op else None

    def broadcast(self, tensor, src, async_op=False):
        return DoneHandle() if async_op else None


# ---------------------------------------------------------------------------
# torch.distributed


class _TorchHandle:
    def __init__(self, work, comm: "TorchCommunicator", what: str, has_future: bool):
        self._work = work
        self._comm = comm
        self._what = what
        self._has_future = has_future
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        try:
            self._work.wait()
        except Exception as e:  # gloo: peer closed / timeout; nccl: timeout
            raise self._comm._translate(e, self._what) from None
        self._done = True
        if not self._has_future:
            for fn in getattr(self, "_callbacks", ()):
                fn()

    def on_complete(self, fn: Callable[[], None]) -> None:
        if self._has_future and not self._done:
            try:
                self._work.get_future().add_done_callback(lambda _f: fn())
                return
            except RuntimeError:  # gloo's reduce_scatter and p2p works have no future
                self._has_future = False
        if self._done:
            fn()
        else:
            self.__dict__.setdefault("_callbacks", []).append(fn)


class _TorchGroup:
    def __init__(self, comm: "TorchCommunicator", ranks: tuple[int, ...], pg):
        self.ranks = ranks
        self._comm = comm
        self._pg = pg
        self._rank = ranks.index(comm.rank)
        self._name = "-".join(map(str, ranks))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self._rank

    def _run(self, work, what: str, async_op: bool):
        h = _TorchHandle(work, self._comm, f"{what} on ranks {list(self.ranks)}", has_future=True)
        if async_op:
            return h
        h.wait()
        return None

    def all_reduce(self, tensor, op="sum", async_op=False):
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = _torch_op(op)
        return self._run(self._pg.allreduce([tensor], opts), f"all_reduce({op})", async_op)

    def all_gather(self, output, tensor, async_op=False):
        return self._run(self._pg._allgather_base(output, tensor), "all_gather", async_op)

    def reduce_scatter(self, output, tensor, async_op=False):
        return self._run(self._pg._reduce_scatter_base(output, tensor), "reduce_scatter", async_op)

    def broadcast(self, tensor, src, async_op=False):
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = self.ranks.index(src)
        opts.rootTensor = 0
        return self._run(self._pg.broadcast([tensor], opts), "broadcast", async_op)


def _torch_op(op: str):
    import torch.distributed as dist

    try:
        return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; known: {', '.join(REDUCE_OPS)}") from None


class TorchCommunicator:
    """torch.distributed process groups built directly from a TCPStore (no global state).

    Args:
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        rank, world_size: this process and the number of processes.
        master_addr, master_port: where the TCPStore lives (rank 0 hosts it unless
            `use_agent_store`, as under torchrun, where the launcher's agent does).
        timeout: seconds before a rendezvous or collective gives up.
    """

    def __init__(self, backend: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 timeout: float = 300.0, use_agent_store: bool = False, device: torch.device | None = None,
                 prefix: str = "meshplan"):
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown torch.distributed backend {backend!r}; use gloo or nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA devices; use --backend gloo on CPU")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self._td = datetime.timedelta(seconds=self.timeout)
        if device is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))) \
                if backend == "nccl" else torch.device("cpu")
        self.device = device
        if backend == "nccl":
            torch.cuda.set_device(device)
        self._hosts_store = rank == 0 and not use_agent_store
        try:
            raw = dist.TCPStore(master_addr, int(master_port), world_size, self._hosts_store, timeout=self._td,
                                wait_for_workers=False)
        except Exception as e:
            raise CommError(f"rank {rank}: cannot reach the rendezvous store at {master_addr}:{master_port} "
                            f"within {self.timeout:.0f} s ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        self._raw_store = raw
        self.store = dist.PrefixStore(prefix, raw)
        self._groups: dict[tuple[int, ...], Group] = {}
        self._failed = False
        # Set by the rank (runtime/watchdog.py): names a dead or stuck peer when nobody published a reason.
        self.diagnose: Callable[[], str | None] | None = None
        self._world_pg = self._make_pg(tuple(range(world_size)))

    def _make_pg(self, ranks: tuple[int, ...], kind: str = "g"):
        import torch.distributed as dist

        store = dist.PrefixStore(kind + "-".join(map(str, ranks)) if len(ranks) < 64 else f"{kind}{hash(ranks)}",
                                 self.store)
        rank = ranks.index(self.rank)
        try:
            if self.backend == "gloo":
                return dist.ProcessGroupGloo(store, rank, len(ranks), self._td)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._td
            return dist.ProcessGroupNCCL(store, rank, len(ranks), opts)
        except Exception as e:
            raise self._translate(e, f"creating the process group of ranks {list(ranks)}") from None

    def group(self, ranks: Sequence[int]) -> Group:
        key = tuple(int(r) for r in ranks)
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} asked for group {list(key)} that does not contain it")
        if key not in self._groups:
            # Collectives over all ranks get a process group of their own ("c" prefix): gloo
            # matches messages by slot, and a collective's slot on the group that carries the
            # point-to-point traffic can collide with a p2p tag when both are in flight.
            self._groups[key] = SoloGroup(self.rank) if len(key) == 1 else \
                _TorchGroup(self, key, self._make_pg(key, "c" if key == tuple(range(self.world_size)) else "g"))
        return self._groups[key]

    def isend(self, tensor, peer, tag):
        return _TorchHandle(self._world_pg.send([tensor], peer, tag), self, f"send to rank {peer} (tag {tag})",
                            has_future=False)

    def irecv(self, tensor, peer, tag):
        return _TorchHandle(self._world_pg.recv([tensor], peer, tag), self, f"recv from rank {peer} (tag {tag})",
                            has_future=False)

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self.group(range(self.world_size)).all_reduce(t)

    # ---- failure protocol ----------------------------------------------
    def report_failure(self, reason: str, grace: float = 10.0) -> None:
        """Publish `reason` (the first reason wins). This rank then exits, which closes its
        connections, so every peer waiting on it fails and reads the reason."""
        self._failed = True
        try:
            self.store.compare_set(ABORT_KEY, "", reason)
        except Exception:
            pass
        self._linger(grace)

    def _linger(self, grace: float) -> None:
        """A rank that hosts the store stays until the others have read the reason (or `grace`)."""
        try:
            self.store.add(ACK_KEY, 1)
            if self._hosts_store:
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and int(self.store.add(ACK_KEY, 0)) < self.world_size:
                    time.sleep(0.05)
        except Exception:
            pass

    def failure_reason(self, timeout: float = 2.0) -> str | None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.store.check([ABORT_KEY]):
                    return self.store.get(ABORT_KEY).decode()
            except Exception:  # the store is gone (its host exited)
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def acknowledge_failure(self, grace: float = 10.0) -> None:
        self._linger(grace)

    def _translate(self, e: BaseException, what: str) -> Exception:
        # The failing rank publishes its reason right after its connections drop: wait for it.
        reason = None if self._failed else self._reason_or_diagnosis()
        if reason:
            return PeerFailure(reason)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return CommError(f"rank {self.rank}: {what} failed: {first[:300]}")

    def _reason_or_diagnosis(self) -> str | None:
        """The published failure reason; if none comes soon, the watchdog's diagnosis, published for the
        others (a rank killed by a signal cannot say why)."""
        reason = self.failure_reason(timeout=2.0 if self.diagnose else 10.0)
        if reason or self.diagnose is None:
            return reason
        found = self.diagnose()
        if found:
            try:
                self.store.compare_set(ABORT_KEY, "", found)
            except Exception:
                return found
        return self.failure_reason(timeout=0.5 if found else 2.0) or found

    def shutdown(self) -> None:
        """Shut every process group down and drop it now, while the interpreter is alive.

        A gloo process group that is still referenced when Python exits is destroyed
        during interpreter finalization and can abort the process ("terminate called
        without an active exception"); groups outlive their users through reference
        cycles (autograd hooks), so they are released explicitly here.
        """
        groups = [g for g in self._groups.values() if isinstance(g, _TorchGroup)]
        pgs = [g._pg for g in groups if g._pg is not None]
        if self._world_pg is not None:
            pgs.append(self._world_pg)
        for pg in {id(p): p for p in pgs}.values():
            try:
                pg.shutdown()
            except Exception:
                pass
        for g in groups:
            g._pg = None
        self._groups.clear()
        self._world_pg = None
        del pgs
        gc.collect()


# ---------------------------------------------------------------------------
# MPI


# Above every p2p_tag (which stay below 2**29); OpenMPI's MPI_TAG_UB is 2**31 - 1.
_ABORT_TAG = 1_500_000_000
_ACK_TAG = 1_500_000_001
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
        return self._run(lambda: self._c.Iallgather(*bufs), "all_gather", async_op,
                         after=lambda: output.copy_(staging), keep=bufs)

    def reduce_scatter(self, output, tensor, async_op=False):
        from mpi4py import MPI

        bufs = (_np(tensor), _np(output))
        return self._run(lambda: self._c.Ireduce_scatter_block(*bufs, MPI.SUM), "reduce_scatter", async_op,
                         keep=bufs)

    def broadcast(self, tensor, src, async_op=False):
        buf = _np(tensor)
        return self._run(lambda: self._c.Ibcast(buf, root=self.ranks.index(src)), "broadcast", async_op,
                         keep=(buf,))


class MpiCommunicator:
    """mpi4py over MPI.COMM_WORLD; every wait polls with a deadline and watches for an abort."""

    backend = "mpi"

    def __init__(self, timeout: float = 300.0):
        from mpi4py import MPI

        self._MPI = MPI
        self._world = MPI.COMM_WORLD
        self.rank = self._world.Get_rank()
        self.world_size = self._world.Get_size()
        self.device = torch.device("cpu")
        self.timeout = float(timeout)
        self._groups: dict[tuple[int, ...], Group] = {}
        self._abort_buf = bytearray(1 << 16)
        self._abort_req = self._world.Irecv([self._abort_buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=_ABORT_TAG)
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
        # the same one after another: four gradient buckets (3.6 MiB) issued together took
        # 2.1-2.3 ms to all-reduce on 2 ranks of the 2-core VM, queued 1.25-1.3 ms, while the VM
        # moved data fast; 3.4-3.6 ms against 2.85-2.9 ms while it moved data slowly
        # (benchmarks/mpi_queue.py, the two ways alternating in one run).
        # Every poll, whatever it waits for, starts a group's next one once its predecessor is done.
        self._queues: dict[int, collections.deque] = {}

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
            if self._abort_req.Test():
                self._abort_reason = pickle.loads(bytes(self._abort_buf)) if self._abort_reason is None \
                    else self._abort_reason
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
        data = pickle.dumps(reason[:60000])
        reqs = [self._world.Isend([data, self._MPI.BYTE], dest=r, tag=_ABORT_TAG)
                for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + grace
        acks = [self._world.Irecv(bytearray(8), source=r, tag=_ACK_TAG)
                for r in range(self.world_size) if r != self.rank]
        while time.monotonic() < deadline and not all(a.Test() for a in acks):
            time.sleep(0.01)
        del reqs

    def failure_reason(self, timeout: float = 2.0) -> str | None:
        if self._abort_reason is not None:
            return self._abort_reason
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._abort_req.Test():
                self._abort_reason = pickle.loads(bytes(self._abort_buf))
                return self._abort_reason
            time.sleep(0.01)
        return None

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


MAX_TENSORS_PER_MESSAGE = 16


def p2p_tag(kind: str, stage: int, micro: int, tensor: int = 0) -> int:
    """A tag unique per (kind, stage, micro-batch, tensor) so receives can be posted in any order.

    Below 2**29 for stage < 512, micro < 32768, tensor < 16.
    """
    if not (0 <= stage < 512 and 0 <= micro < 32768 and 0 <= tensor < MAX_TENSORS_PER_MESSAGE):
        raise ValueError(f"p2p tag out of range: stage {stage}, micro-batch {micro}, tensor {tensor}")
    return (((0 if kind == "act" else 1) * 512 + stage) * 32768 + micro) * MAX_TENSORS_PER_MESSAGE + tensor


def local_threads_hint() -> None:
    """Keep intra-op threads to one per rank process unless OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

