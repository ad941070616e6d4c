"""Data-parallel gradient buckets, reduced while backward is still running (overlap).

Each bucket owns one flat gradient buffer; its parameters' `.grad` are views
into it, so autograd accumulates micro-batch gradients straight into the
buffer and the reduction needs no copy (PyTorch DDP's gradient_as_bucket_view).
During the last micro-batch's backward of a stage, a post-accumulate-grad
hook counts the bucket's parameters; when the last one is done the bucket's
collective is issued asynchronously (gloo runs it on its own threads; on
GPU it is issued on a separate CUDA stream), and backward carries on.

ZeRO (`zero` >= 1): parameters are also views into one flat buffer per
bucket; gradients are reduce-scattered, so each data rank receives the sum
of its 1/d shard; the optimizer holds state for that shard only; after the
step the updated shards are all-gathered back into every rank's parameters.
Stages 1 and 2 communicate alike here (gradient memory is not released
between micro-batches). Stage 3 keeps only the shard between uses and
all-gathers the parameters before every forward and backward of the stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from runtime.comm import Group, Handle
from runtime.program import Bucket


@dataclass
class _BucketState:
    index: int
    bucket: Bucket
    params: list[nn.Parameter]
    grad_flat: torch.Tensor                     # (padded numel,)
    param_flat: torch.Tensor | None = None      # ZeRO: (padded numel,) storage of the parameters
    shard: nn.Parameter | None = None           # ZeRO: this rank's slice, stepped by the optimizer
    shard_grad: torch.Tensor | None = None      # ZeRO: reduce-scattered gradient of the shard
    pending: int = 0
    armed: bool = False
    ready: bool = False                          # armed and its gradients complete
    launched: Handle | None = None
    on_launch: Callable[[Handle], None] | None = None
    gathered: bool = True                       # ZeRO-3: full parameters present


class GradSync:
    """All of a rank's gradient buckets (for every stage it runs).

    Args:
        buckets: the Program's buckets (parameter names are the stage module's).
        modules: stage index -> stage module.
        group: the data-axis group; zero: ZeRO stage.
        device: where buffers live; comm_stream: CUDA stream collectives are issued on (GPU).
    """

    def __init__(self, buckets: tuple[Bucket, ...], modules: dict[int, nn.Module], group: Group, zero: int = 0,
                 device: torch.device | str = "cpu"):
        self.group = group
        self.zero = zero
        self.device = torch.device(device)
        self.comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.states: list[_BucketState] = []
        self._queue: list[_BucketState] = []    # armed buckets, in the order they must be issued
        self.dropped: set[int] = set()           # testing (--sabotage drop-bucket): reduced, result discarded
        d = group.size
        seen: set[int] = set()
        for i, b in enumerate(buckets):
            named = dict(modules[b.stage].named_parameters(remove_duplicate=False))  # a tied weight: any name
            params = []
            for name in b.params:
                if name not in named:
                    raise ValueError(f"bucket {i} names parameter {name!r}, which stage {b.stage}'s module lacks; "
                                     "generate the build again")
                p = named[name]
                if id(p) in seen:
                    raise ValueError(f"parameter {name!r} is in two buckets")
                seen.add(id(p))
                params.append(p)
            numel = sum(p.numel() for p in params)
            padded = -(-numel // d) * d
            dtype = params[0].dtype if params else torch.float32
            st = _BucketState(i, b, params, torch.zeros(padded, dtype=dtype, device=self.device))
            off = 0
            if zero >= 1:
                st.param_flat = torch.zeros(padded, dtype=dtype, device=self.device)
            for p in params:
                n = p.numel()
                if st.param_flat is not None:
                    st.param_flat[off:off + n].copy_(p.detach().reshape(-1))
                    p.data = st.param_flat[off:off + n].view_as(p)
                p.grad = st.grad_flat[off:off + n].view_as(p)
                off += n
            if zero >= 1:
                k = padded // d
                lo = group.rank * k
                # ZeRO-1/2: the shard is a view of the parameters (stepped in place, then gathered);
                # ZeRO-3: it has its own storage, since the full parameters are freed between uses.
                view = st.param_flat[lo:lo + k]
                st.shard = nn.Parameter(view if zero <= 2 else view.clone())
                st.shard_grad = torch.zeros(k, dtype=dtype, device=self.device)
                st.shard.grad = st.shard_grad
            self.states.append(st)
            for p in params:
                p.register_post_accumulate_grad_hook(self._make_hook(st))
        self._full_storage_bytes = {st.index: st.param_flat.untyped_storage().nbytes()
                                    for st in self.states if st.param_flat is not None}
        for s in {b.stage for b in buckets}:
            for name, p in modules[s].named_parameters():
                if p.requires_grad and id(p) not in seen:
                    raise ValueError(f"trainable parameter {name!r} of stage {s} is in no gradient bucket; "
                                     "generate the build again")

    @property
    def shards(self) -> bool:
        """ZeRO >= 1: gradients are reduce-scattered and the optimizer steps (and keeps state for) this
        rank's 1/d flat shard of each bucket, not the whole parameters."""
        return self.zero >= 1

    @property
    def frees_params(self) -> bool:
        """ZeRO-3: between uses a rank keeps only its shard; the full parameters exist only while
        gathered (gather_params / gather_all), so reading them needs a gather first."""
        return self.zero >= 3

    # ---- optimizer view ---------------------------------------------------
    def optimizer_params(self, modules: dict[int, nn.Module]) -> list[nn.Parameter]:
        """What the optimizer steps: whole parameters (ZeRO-0) or this rank's flat shards."""
        if self.shards:
            return [st.shard for st in self.states]
        out, seen = [], set()
        for s in sorted(modules):
            for p in modules[s].parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    # ---- gradients ----------------------------------------------------------
    def zero_grad(self) -> None:
        for st in self.states:
            st.grad_flat.zero_()
            if st.shard_grad is not None:
                st.shard_grad.zero_()

    def arm(self, bucket_indices: list[int], on_launch: dict[int, Callable[[Handle], None]]) -> None:
        """The next backward is the last one of these buckets' stage: reduce each bucket as
        soon as its gradients are complete, calling on_launch[index](handle).

        Buckets are issued in the order given (the Program's), each once it and all before
        it are complete: every member of the group issues its collectives in one order, even
        where autograd finishes the buckets in another (a collective issued out of order
        would be matched with another bucket's on a peer)."""
        for i in bucket_indices:
            st = self.states[i]
            st.pending = len(st.params)
            st.armed = True
            st.ready = False
            st.launched = None
            st.on_launch = on_launch.get(i)
            self._queue.append(st)

    def _make_hook(self, st: _BucketState):
        def hook(_p: torch.Tensor) -> None:
            if not st.armed:
                return
            st.pending -= 1
            if st.pending == 0:
                st.ready = True
                while self._queue and self._queue[0].ready:
                    self._launch(self._queue.pop(0))
        return hook

    def _stream(self):
        if self.comm_stream is None:
            return contextlib.nullcontext()
        self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.comm_stream)

    def _launch(self, st: _BucketState) -> Handle:
        st.armed = st.ready = False
        dropped = st.index in self.dropped
        with self._stream():
            if self.shards:
                out = st.shard_grad.clone() if dropped else st.shard_grad
                h = self.group.reduce_scatter(out, st.grad_flat.clone() if dropped else st.grad_flat, async_op=True)
                if dropped:   # the shard keeps this rank's own (unreduced) part
                    k = st.shard_grad.numel()
                    st.shard_grad.copy_(st.grad_flat[self.group.rank * k:(self.group.rank + 1) * k])
            else:
                h = self.group.all_reduce(st.grad_flat.clone() if dropped else st.grad_flat, async_op=True)
        st.launched = h
        if st.on_launch is not None:
            st.on_launch(h)
        return h

    def launch(self, index: int) -> tuple[Handle, bool]:
        """The bucket's reduction: (handle, True) if backward already issued it, else issue it now."""
        st = self.states[index]
        if st.launched is not None:
            h, st.launched = st.launched, None
            return h, True
        # armed, but a backward left it incomplete (unused parameters): issued here, in order
        self._queue = [q for q in self._queue if q is not st]
        h = self._launch(st)
        st.launched = None   # handed to the caller now, not left for the next step
        return h, False

    def finish(self) -> None:
        """After the reductions completed: make the GPU's compute stream wait for them."""
        if self.comm_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.comm_stream)

    # ---- ZeRO parameters -------------------------------------------------------
    def gather_params(self, index: int) -> Handle:
        """All-gather the bucket's shards into every rank's parameters (async).

        ZeRO-1/2: after the step; ZeRO-3: before each forward and backward of the stage.
        """
        st = self.states[index]
        if not st.gathered:
            st.param_flat.untyped_storage().resize_(self._full_storage_bytes[index])
            st.gathered = True
        src = st.shard.detach() if self.frees_params else st.shard.detach().clone()
        with self._stream():
            return self.group.all_gather(st.param_flat, src, async_op=True)

    def gather_all(self) -> None:
        """ZeRO-3: gather every bucket's full parameters (to read or save them); below ZeRO-3
        every rank holds them after the step already."""
        if not self.frees_params:
            return
        for st in self.states:
            self.gather_params(st.index).wait()

    def release_params(self, stage: int | None = None) -> None:
        """ZeRO-3: free the full parameters of `stage`'s buckets (all stages if None); the
        shard stays. Autograd's saved references stay valid: the storage is refilled by
        the next gather before backward reads it."""
        if not self.frees_params:
            return
        for st in self.states:
            if (stage is None or st.bucket.stage == stage) and st.gathered:
                st.param_flat.untyped_storage().resize_(0)
                st.gathered = False

    def shard_grad_of(self, p: nn.Parameter) -> torch.Tensor:
        """ZeRO: the reduce-scattered gradient shard of the bucket that holds `p` alone (a copy
        of a tied weight, runtime/execute/ties.py)."""
        for st in self.states:
            if any(q is p for q in st.params):
                if len(st.params) != 1:
                    raise ValueError(f"a tied weight shares gradient bucket {st.index} with other parameters; "
                                     "generate the build again")
                return st.shard_grad
        raise ValueError("a tied weight is in no gradient bucket; generate the build again")
