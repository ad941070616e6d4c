"""One captured node on a GPU beyond its main kernels: autocast's casts, the widths its values run in,
eager PyTorch's extra backward work, and the host's dispatch of all of it.

`GpuGraph` holds what does not change between configurations of one graph (the dtype every value
runs in under autocast, the casts each node adds, which nodes read a slice of a fused projection);
`GpuGraph.extras` gives one node's `NodeExtras` for one rank's share of a micro-batch:

* casts (cost_models/autocast.py): kernels reading one width and writing the other, forward and
  backward, at the streaming bandwidth share; the 16-bit weight copies autocast keeps for backward;
* the backward of a slice of a fused tensor (q, k and v taken from one QKV output with `x[i]`, as
  `unbind` does): eager autograd's select_backward materializes a zero tensor of the whole input for
  each slice and copies the slice's gradient into it, and the slices' gradients are then summed: per
  slice a write of the whole input and a read and write of the slice, plus the sums;
* host seconds (GpuCosts.host_op, host_gemm; backward ops at host_backward_share): one dispatch per op
  the node runs (a GEMM call, a memory pass, a cast; a view or a shape query dispatches but launches no
  kernel, VIEW_HOST of an op), so a step's host timeline can be set beside its device timeline.

Units: seconds and bytes for one rank and one micro-batch (the caller passes the share).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.autocast import FLOAT32, LOW, CastWork, cast_work, run_dtypes
from cost_models.kernels import Gpu
from runtime.vocab import OpKind, element_bytes

# A view or shape query costs the host this share of an op's dispatch (it runs the dispatcher, no kernel).
# ASSUMPTION: half; calibration's host rows can refine it.
VIEW_HOST = 0.5
_GEMM_KINDS = (OpKind.LINEAR, OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION)
_NO_HOST = (OpKind.INPUT, OpKind.OUTPUT, OpKind.PARAM)


@dataclass(frozen=True)
class NodeExtras:
    """Seconds and bytes one node adds on one rank for one micro-batch (see module docstring)."""

    forward: float = 0.0          # device s beyond the node's main kernels
    backward: float = 0.0
    host_forward: float = 0.0     # host s dispatching the node's forward ops
    host_backward: float = 0.0
    weight_copies: float = 0.0    # bytes of 16-bit weight copies kept for backward


class GpuGraph:
    """Per-graph GPU facts (see module docstring). `nodes`: the graph's OpInfo list; `autocast`: whether
    the stack runs mixed precision through torch.autocast over fp32 parameters."""

    def __init__(self, nodes, *, autocast: bool) -> None:
        self.by_name = {n.name: n for n in nodes}
        self.autocast = autocast
        self.dtypes = run_dtypes(nodes, autocast)
        self._casts: dict[tuple[str, int], CastWork] = {}
        self._slices = {n.name: self._fused_slice(n) for n in nodes}

    def width(self, name: str, low_bytes: int) -> int:
        """Bytes per element of value `name` as the run holds it."""
        d = self.dtypes.get(name, "")
        if d == FLOAT32:
            return 4
        if d == LOW:
            return low_bytes
        meta = self.by_name[name].output_meta
        return element_bytes(meta[0].dtype) if meta else 0

    def widths(self, node, low_bytes: int) -> tuple[tuple[int, ...], int] | None:
        """(bytes per element of each tensor input in input_meta order, of the output), or None when the
        node's inputs cannot be matched to its input_meta."""
        ins = [i for i in node.inputs
               if self.by_name[i].output_meta and self.by_name[i].kind not in (OpKind.PARAM, OpKind.SCALAR)]
        if len(ins) != len(node.input_meta) or not node.output_meta:
            return None
        return tuple(self.width(i, low_bytes) for i in ins), self.width(node.name, low_bytes)

    def casts(self, node, low_bytes: int) -> CastWork:
        key = (node.name, low_bytes)
        hit = self._casts.get(key)
        if hit is None:
            hit = self._casts[key] = cast_work(node, self.dtypes, self.by_name, low_bytes) \
                if self.autocast and low_bytes else CastWork()
        return hit

    def _fused_slice(self, n) -> float:
        """Elements of the whole tensor an integer index `x[i]` slices (q, k or v from a QKV output), else 0."""
        if n.kind != OpKind.VIEW or not n.target.endswith("getitem") or not n.inputs or not n.output_meta:
            return 0.0
        src = self.by_name[n.inputs[0]]
        if not src.output_meta or not isinstance(n.attr("arg1"), int):
            return 0.0
        whole = src.output_meta[0].numel
        return float(whole) if whole > n.output_meta[0].numel else 0.0

    def extras(self, node, gpu: Gpu, *, share: float, div: float, low_bytes: int, compiled: bool = False) -> NodeExtras:
        """What `node` adds for `share` of the captured batch on a rank whose split of it divides by `div`;
        `low_bytes`: bytes of the 16-bit autocast dtype, 0 for an fp32 run (no autocast, no casts)."""
        if node.kind in _NO_HOST:
            return NodeExtras()
        c = gpu.costs
        per_rank = share / div
        f = b = 0.0
        cw = self.casts(node, low_bytes)
        act_f = (cw.fwd_bytes - cw.weight_cast_bytes) * per_rank
        act_b = (cw.bwd_bytes - (cw.weight_cast_bytes if cw.bwd_bytes else 0.0)) * per_rank
        w = cw.weight_cast_bytes / div
        if not compiled:
            if cw.fwd_kernels:
                f += gpu.stream("cast", act_f + w, kernels=cw.fwd_kernels)
            if cw.bwd_kernels:
                b += gpu.stream("cast", act_b + (w if cw.bwd_bytes else 0.0), True, kernels=cw.bwd_kernels)
        else:   # casts fuse into the neighbouring kernels; the weights are still read and cast once
            if w:
                f += gpu.stream("cast", w, kernels=1)
                b += gpu.stream("cast", w, True, kernels=1) if cw.bwd_bytes else 0.0
        whole = self._slices.get(node.name, 0.0)
        if whole and node.requires_grad and not compiled:
            e = self.width(node.name, low_bytes) if low_bytes else 4
            part = node.output_meta[0].numel * per_rank
            # zero-fill the whole input, copy the slice in; then add into the running sum of the slices
            b += gpu.stream(OpKind.ELEMENTWISE, (whole * per_rank + 2 * part) * e, True, kernels=2)
            b += gpu.stream(OpKind.ELEMENTWISE, 3 * whole * per_rank * e, True)
        hf, hb = self._host(node, c, cw, compiled)
        return NodeExtras(forward=f, backward=b, host_forward=hf, host_backward=hb * (1 if node.requires_grad else 0),
                          weight_copies=cw.weight_copy_bytes / div if self.autocast else 0.0)

    def _host(self, node, c, cw: CastWork, compiled: bool) -> tuple[float, float]:
        """(forward, backward) host seconds: one dispatch per op (see module docstring)."""
        bh = c.host_op * c.host_backward_share
        if compiled:
            # a compiled region launches its GEMMs and a few fused kernels from generated code: the
            # per-op Python and dispatcher work is gone (ASSUMPTION: a fifth of an eager op per kernel)
            if node.kind in _GEMM_KINDS:
                return 0.2 * c.host_op, (0.4 if node.kind != OpKind.ATTENTION else 0.2) * c.host_op
            return (0.0, 0.0) if node.kind in (OpKind.VIEW, OpKind.SCALAR) else (0.1 * c.host_op, 0.1 * c.host_op)
        casts_f, casts_b = cw.fwd_kernels * c.host_op, cw.bwd_kernels * bh
        if node.kind in (OpKind.VIEW, OpKind.SCALAR):
            return VIEW_HOST * c.host_op, VIEW_HOST * bh
        if node.kind in _GEMM_KINDS:
            grads = 1 if node.kind == OpKind.ATTENTION else 2
            return c.host_gemm + casts_f, grads * c.host_gemm * c.host_backward_share + casts_b
        if node.kind == OpKind.EMBEDDING:
            return c.host_op, 4 * bh      # embedding_dense_backward: zero fill, sort, segment sums
        kernels = 2 if node.kind == OpKind.NORM else 1
        return c.host_op + casts_f, kernels * bh + casts_b
