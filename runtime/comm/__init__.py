"""`Communicator`: point-to-point and collective communication, behind one protocol.

Two implementations:

* `TorchCommunicator` over torch.distributed process groups (runtime/comm/torch_dist.py: gloo
  on CPU, NCCL on GPU). Process groups are constructed directly from a TCPStore and
  kept in that object: nothing is registered in torch.distributed's global
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

import os
import sys
import threading
from typing import Callable, Protocol, Sequence

import torch

from runtime.comm.jobauth import SECRET_ENV, Signer, shown

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

