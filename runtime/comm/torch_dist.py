"""`TorchCommunicator`: runtime.comm's Communicator protocol over torch.distributed process groups
(gloo on CPU, NCCL on GPU). Process groups are constructed directly from a TCPStore and kept in the
communicator: nothing is registered in torch.distributed's global state, and a sub-group is built by
its members only. torch.distributed is imported when a communicator is made.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from typing import Callable, Sequence

import torch

from runtime.comm import (ABORT_KEY, ACK_KEY, REDUCE_OPS, CommError, Group, PeerFailure, SoloGroup, group_send_recv,
                          read_abort)
from runtime.comm.jobauth import Signer
from runtime.launch.placement import cuda_index
from runtime.comm.store_host import StoreBindError, host_store, listen_address
from runtime.vocab import Backend, Collective


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
