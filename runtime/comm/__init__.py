"""`Communicator`: point-to-point and collective communication, behind one protocol.

Two implementations:

* `TorchCommunicator` over torch.distributed process groups (gloo on CPU,
  NCCL on GPU). Process groups are constructed directly from a TCPStore and
  kept in this object: nothing is registered in torch.distributed's global
  state, and a sub-group is built by its members only.
* `MpiCommunicator` over mpi4py (runtime/comm/mpi.py: non-blocking MPI calls on NumPy
  views of CPU tensors, completed by polling with a deadline).

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

import datetime
import gc
import os
import sys
import threading
import time
from typing import Callable, Protocol, Sequence

import torch

from runtime.comm.jobauth import SECRET_ENV, Signer, shown
from runtime.launch.placement import cuda_index
from runtime.comm.store_host import StoreBindError, host_store, listen_address
from runtime.vocab import Backend, Collective

ABORT_KEY = "meshplan/abort"
ACK_KEY = "meshplan/abort_acks"
REDUCE_OPS = ("sum", "max", "min")


def read_abort(store, signer: Signer, rank: int) -> str | None:
    """The failure reason published on `store` (under ABORT_KEY), if one was signed with this
    job's secret. A value that fails verification is logged, removed (so the real reason can be
    published) and ignored."""
    if not store.check([ABORT_KEY]):
        return None
    value = store.get(ABORT_KEY)
    reason = signer.verify(value)
    if reason is None:
        print(f"meshplan rank {rank}: warning: ignored a failure message on the rendezvous store that fails "
              f"authentication ({shown(value)}): not from this job's ranks (wrong or missing {SECRET_ENV})",
              file=sys.stderr, flush=True)
        try:
            store.compare_set(ABORT_KEY, value, "")
            store.delete_key(ABORT_KEY)
        except Exception:
            pass
    return reason or None


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

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Handle | None:
        """output (size * n,): block j is member j's block `rank` of its tensor (size * n,), in group
        order (equal blocks of n elements; both flat and contiguous)."""

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int) -> Handle:
        """Send `send` to member `dst` and receive `recv` from member `src` (positions in the group,
        not global ranks) under `tag`, asynchronously; the handle completes when both are done.
        Messages between two ranks under one tag arrive in the order sent."""


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


class JointHandle:
    """Several operations in flight, completed together (a send and a receive)."""

    def __init__(self, handles: Sequence[Handle]):
        self._handles = tuple(handles)

    def wait(self) -> None:
        for h in self._handles:
            h.wait()

    def on_complete(self, fn: Callable[[], None]) -> None:
        left = [len(self._handles)]
        lock = threading.Lock()

        def one_done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn()

        for h in self._handles:
            h.on_complete(one_done)


def group_send_recv(comm: "Communicator", ranks: tuple[int, ...], send: torch.Tensor, dst: int,
                    recv: torch.Tensor, src: int, tag: int) -> Handle:
    """Group.send_recv through the communicator's point-to-point calls: `dst` and `src` are
    positions in `ranks`.

    When both are one peer (a ring of two), the lower global rank sends first and the other
    receives first: NCCL runs the two calls between a pair one after the other on one stream, so
    two ranks that both received first would wait on each other (gloo and MPI take either order)."""
    dst_rank, src_rank = ranks[dst], ranks[src]
    if dst_rank == src_rank and comm.rank < dst_rank:
        outgoing = comm.isend(send, dst_rank, tag)
        return JointHandle((outgoing, comm.irecv(recv, src_rank, tag)))
    incoming = comm.irecv(recv, src_rank, tag)
    return JointHandle((comm.isend(send, dst_rank, tag), incoming))


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

    def all_to_all(self, output, tensor, async_op=False):
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor.reshape(-1))
        return DoneHandle() if async_op else None

    def send_recv(self, send, dst, recv, src, tag):
        if (dst, src) != (0, 0):
            raise ValueError(f"send_recv on a group of one rank names members {dst} and {src}; the only member is 0")
        recv.copy_(send)
        return DoneHandle()


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

    def _run(self, start: Callable[[], object], what: str, async_op: bool):
        what = f"{what} on ranks {list(self.ranks)}"
        h = _TorchHandle(self._comm._post(start, what), self._comm, what, has_future=True)
        if async_op:
            return h
        h.wait()
        return None

    def all_reduce(self, tensor, op="sum", async_op=False):
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = _torch_op(op)
        return self._run(lambda: self._pg.allreduce([tensor], opts), f"all_reduce({op})", async_op)

    def all_gather(self, output, tensor, async_op=False):
        return self._run(lambda: self._pg._allgather_base(output, tensor), Collective.ALL_GATHER, async_op)

    def reduce_scatter(self, output, tensor, async_op=False):
        return self._run(lambda: self._pg._reduce_scatter_base(output, tensor), Collective.REDUCE_SCATTER, async_op)

    def broadcast(self, tensor, src, async_op=False):
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = self.ranks.index(src)
        opts.rootTensor = 0
        return self._run(lambda: self._pg.broadcast([tensor], opts), Collective.BROADCAST, async_op)

    def all_to_all(self, output, tensor, async_op=False):
        import torch.distributed as dist

        return self._run(lambda: self._pg.alltoall_base(output, tensor, [], [], dist.AllToAllOptions()),
                         Collective.ALL_TO_ALL,
                         async_op)

    def send_recv(self, send, dst, recv, src, tag):
        # On the communicator's point-to-point group, not this group's: gloo can match a p2p
        # message with a collective of the same process group (see TorchCommunicator.group).
        return group_send_recv(self._comm, self.ranks, send, dst, recv, src, tag)


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
        signer: signs and checks the failure reasons on the store (runtime/comm/jobauth.py).
            A store this rank hosts listens on `master_addr` only (runtime/comm/store_host.py).
        join: called with the store once it answers, before any process group is made:
            the rank's check of who came to the rendezvous (runtime/join.py); it raises to refuse.
    """

    def __init__(self, backend: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 timeout: float = 300.0, use_agent_store: bool = False, device: torch.device | None = None,
                 prefix: str = "meshplan", signer: Signer | None = None,
                 join: Callable[[object], None] | None = None):
        import torch.distributed as dist

        if backend not in (Backend.GLOO, Backend.NCCL):
            raise ValueError(f"unknown torch.distributed backend {backend!r}; use gloo or nccl")
        if backend == Backend.NCCL and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA devices; use --backend gloo on CPU")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self._td = datetime.timedelta(seconds=self.timeout)
        if device is None:
            device = torch.device("cuda", cuda_index(os.environ, torch.cuda.device_count())) \
                if backend == Backend.NCCL else torch.device("cpu")
        self.device = device
        if backend == Backend.NCCL:
            torch.cuda.set_device(device)
        self._hosts_store = rank == 0 and not use_agent_store
        self.signer = signer or Signer()
        try:
            raw = host_store(listen_address(master_addr), int(master_port), self.timeout, world_size).store \
                if self._hosts_store \
                else dist.TCPStore(master_addr, int(master_port), world_size, False, timeout=self._td,
                                   wait_for_workers=False)
        except StoreBindError:
            raise
        except Exception as e:
            raise CommError(f"rank {rank}: cannot reach the rendezvous store at {master_addr}:{master_port} "
                            f"within {self.timeout:.0f} s ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        self._raw_store = raw
        self.store = dist.PrefixStore(prefix, raw)
        if join is not None:
            join(raw)
        self._groups: dict[tuple[int, ...], Group] = {}
        self._failed = False
        # Once a store request failed its host is gone: no more requests (each makes torch log a stack trace).
        self._store_gone = False
        # Set by the rank (runtime/launch/watchdog.py): names a dead or stuck peer when nobody published a reason.
        self.diagnose: Callable[[], str | None] | None = None
        self._world_pg = self._make_pg(tuple(range(world_size)))

    def _make_pg(self, ranks: tuple[int, ...], kind: str = "g"):
        import torch.distributed as dist

        store = dist.PrefixStore(kind + "-".join(map(str, ranks)) if len(ranks) < 64 else f"{kind}{hash(ranks)}",
                                 self.store)
        rank = ranks.index(self.rank)
        try:
            if self.backend == Backend.GLOO:
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
        what = f"send to rank {peer} (tag {tag})"
        return _TorchHandle(self._post(lambda: self._world_pg.send([tensor], peer, tag), what), self, what,
                            has_future=False)

    def irecv(self, tensor, peer, tag):
        what = f"recv from rank {peer} (tag {tag})"
        return _TorchHandle(self._post(lambda: self._world_pg.recv([tensor], peer, tag), what), self, what,
                            has_future=False)

    def _post(self, start: Callable[[], object], what: str):
        """The work `start()` queues. A peer that is already gone can make the call itself raise
        (gloo: "Connection closed by peer"), not only its wait(): both are read as a peer's failure."""
        try:
            return start()
        except Exception as e:
            raise self._translate(e, what) from None

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self.group(range(self.world_size)).all_reduce(t)

    # ---- failure protocol ----------------------------------------------
    def report_failure(self, reason: str, grace: float = 10.0) -> None:
        """Publish `reason` (the first reason wins). This rank then exits, which closes its
        connections, so every peer waiting on it fails and reads the reason."""
        self._failed = True
        if self._store_gone:
            return
        try:
            self.store.compare_set(ABORT_KEY, "", self.signer.sign(reason))
        except Exception:
            self._store_gone = True
        self._linger(grace)

    def _linger(self, grace: float) -> None:
        """A rank that hosts the store stays until the others have read the reason (or `grace`)."""
        if self._store_gone:
            return
        try:
            self.store.add(ACK_KEY, 1)
            if self._hosts_store:
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and int(self.store.add(ACK_KEY, 0)) < self.world_size:
                    time.sleep(0.05)
        except Exception:
            pass

    def failure_reason(self, timeout: float = 2.0) -> str | None:
        if self._store_gone:
            return None
        deadline = time.monotonic() + timeout
        while True:
            try:
                reason = read_abort(self.store, self.signer, self.rank)
                if reason:
                    return reason
            except Exception:  # the store is gone (its host exited)
                self._store_gone = True
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
        if found and self._store_gone:
            return found
        if found:
            try:
                self.store.compare_set(ABORT_KEY, "", self.signer.sign(found))
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

