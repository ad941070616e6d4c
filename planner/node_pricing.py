"""How the Evaluator prices one node (an fx op) on one device for one micro-batch: its kernels (on a GPU,
by shape: cost_models/kernels.py; elsewhere the calibrated curves or the roofline), what autocast and
eager autograd add on a GPU, the collectives the active strategies run inside it (per mesh axis),
and its parameters, saved activations and largest temporary; and how far a split node is spread (the
ranks, their collectives, what its split dimension is divided by).

`NodePricing` is the part of planner/evaluator.py's Evaluator that does this, kept apart so each file
holds one concern; it reads the Evaluator's tables (cluster, gpu_costs, gpu_graph, eff, curves,
curve_mix, in_run, overlap, execution, fused_attention, saved, sharding, splitter, and its caches) and calls its
`active`, `axis_seconds`, `grad_replicas` and `_token_share`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.compute import op_time, wave_efficiency
from cost_models.kernels import gpu_for, node_seconds
from cost_models.op_curves import node_curve_times
from planner.config import ParallelConfig
from planner.graph.model import OpInfo
from planner.layer_cost import AxisComm, comm_on
from runtime.vocab import DType, OpKind, ShardRole, element_bytes


@dataclass(frozen=True)
class NodeCost:
    """One node on one device for one micro-batch: seconds, bytes and parameter counts."""


    fwd: float
    bwd: float
    saved: float    # activation bytes this op alone keeps (planner/saved.py node_bytes)
    params: float
    temp: float
    host_fwd: float = 0.0       # GPU: host s dispatching its forward / backward ops
    host_bwd: float = 0.0
    weight_copies: float = 0.0  # GPU: bytes of the 16-bit weight copies autocast keeps
    tensors: int = 0            # parameter tensors it holds
    comm: tuple[AxisComm, ...] = ()   # seconds of the collectives inside it, per mesh axis

    def on(self, axis: str) -> AxisComm:
        return comm_on(self.comm, axis)


class NodePricing:
    """The Evaluator's node pricing (see module docstring)."""

    def node_cost(self, n: OpInfo, role: str, config: ParallelConfig, *, fused_head: bool = False,
                  compiled: bool = False) -> NodeCost:
        """One node on one device for one micro-batch, with `role` (ShardRole.REPLICATE or its split role, a ShardRole).
        `fused_head`: the node is the output layer the fused chunked loss computes itself (its GEMMs are the
        loss's; its casts and its gradient's accumulation stay here). `compiled`: its layer runs compiled
        (runtime/execution.py; the layers compile_layers names)."""
        dev = self.cluster.device
        t = self.split_ranks(config)
        sharded = role != ShardRole.REPLICATE and t > 1
        # a padded split (a vocabulary t does not divide) leaves each rank ceil(size / t) of it
        div = self.split_divisor(n.name, role, config)
        active = self.active(config)
        # e.g. a replicated op between regions runs on T/t tokens under sequence parallelism (its weights whole)
        seq = self._token_share(n.name, role, config, active)
        work = div * seq
        scale = config.micro_batch_size / self.graph.batch_size
        ds = _dtype_scale(n, config.dtype)
        peak, bw = dev.peak(config.dtype), dev.memory_bandwidth
        act_in = sum(mm.nbytes for mm in n.input_meta)
        param_read = max(n.bytes_read - act_in, 0)
        nbytes = ((act_in + n.bytes_written) * scale / seq + param_read) * ds / div
        f_bytes, b_bytes = nbytes, 2 * nbytes
        if n.kind == OpKind.ATTENTION and not self.fused_attention:
            # Unfused attention materializes the scores: Q@K^T writes them, softmax
            # reads and writes them, P@V reads them (4 passes; backward 6). Dropout
            # on the probabilities adds a read, a write and a 1-byte mask each way.
            scores = _score_bytes(n) * scale * ds / div
            drop = 2.5 if (n.attr("dropout_p") or 0) > 0 else 0.0
            f_bytes += (4 + drop) * scores
            b_bytes += (6 + drop) * scores
        measured = self._curve_times(n, scale / work, config.dtype, n.param_count / div)
        if measured is not None:
            f, b = measured[0], measured[1] if n.requires_grad else 0.0
        elif (priced := self._kernel_times(n, role if sharded else ShardRole.REPLICATE, scale / seq, div, config)) is not None:
            f, b = priced[0], priced[1] if n.requires_grad else 0.0
        else:
            waves = self._wave_efficiency(n, role if sharded else ShardRole.REPLICATE, scale, t)
            f = op_time(n.kind, n.fwd_flops * scale / work, f_bytes, peak, bw, self.eff, shape_efficiency=waves)
            b = op_time(n.kind, n.bwd_flops * scale / work, b_bytes, peak, bw, self.eff,
                        kernels=2 if n.param_count or param_read else 1,
                        shape_efficiency=waves, backward=True) if n.requires_grad else 0.0
        f, b = f * self.in_run[0], b * self.in_run[1]
        if fused_head:
            f = b = 0.0
        hf = hb = copies = 0.0
        if self.gpu_graph is not None:
            f, b, hf, hb, copies = self._gpu_extras(n, config, f, b, scale / seq, div, compiled)
        comm: dict[str, AxisComm] = {}   # the collectives inside the node, from every active strategy, by axis
        for s in active:
            f_c, b_c = s.node_comm(self, n, role if sharded else ShardRole.REPLICATE, config, scale, ds)
            if f_c or b_c:
                was = comm.get(s.comm_axis, AxisComm(s.comm_axis, 0.0, 0.0))
                comm[s.comm_axis] = AxisComm(s.comm_axis, was.forward + f_c, was.backward + b_c)
        params = _params_per_rank(n, role if sharded else ShardRole.REPLICATE, div) if n.param_count else 0.0
        saved = self.saved.node_bytes(n, config, fused_attention=self.fused_attention, divisor=div)
        # its output and that output's gradient; a weight read through get_attr is a parameter, counted
        # once as such and not once per sample
        # (the output layer the fused loss computes itself never holds its whole output)
        temp = 0.0 if n.kind == OpKind.PARAM or fused_head else 2 * n.output_bytes * scale * ds / div
        return NodeCost(fwd=f, bwd=b, comm=tuple(comm.values()), saved=saved, params=params, temp=temp,
                         host_fwd=hf, host_bwd=hb, weight_copies=copies,
                         tensors=len(n.param_names) if n.param_count else 0)

    def _gpu_extras(self, n: OpInfo, config: ParallelConfig, f: float, b: float, share: float,
                    div: float, compiled: bool) -> tuple[float, float, float, float, float]:
        """(forward s, backward s, host forward s, host backward s, weight-copy bytes) of `n` on a GPU: its
        kernels `f`, `b` plus autocast's casts and eager autograd's extra work (cost_models/gpu_node.py),
        and, where the runtime's gradients are views of data-parallel buckets (zeroed in place), adding its
        weights' gradients into them (without buckets the first micro-batch's backward writes them fresh;
        later micro-batches' adds are left out)."""
        gpu = self.gpu(config.dtype)
        mixed = config.dtype != DType.FP32
        x = self.gpu_graph.extras(n, gpu, share=share, div=div, low_bytes=DType(config.dtype).bytes if mixed else 0,
                                  compiled=compiled)
        f, b = f + x.forward, b + (x.backward if n.requires_grad else 0.0)
        hf, hb = x.host_forward, x.host_backward
        if n.param_count and n.requires_grad and self.adds_into_buckets(config):
            tensors = max(len(n.param_names), 1)
            b += gpu.stream(OpKind.ELEMENTWISE, 12.0 * n.param_count / div, True, kernels=tensors)
            hb += tensors * gpu.costs.host_op * gpu.costs.host_backward_share
        return f, b, hf, hb, x.weight_copies

    def split_ranks(self, config: ParallelConfig) -> int:
        """The ranks a split node (a role other than replicated: Strategy.splits_nodes) is spread over."""
        return self.splitter.split_ranks(config)

    def split_seconds(self, config: ParallelConfig, op: str, nbytes: float) -> float:
        """Seconds of collective `op` over `nbytes` among the ranks a split node is spread over (the tensor axis
        of the mesh), as the collectives around a vocabulary-split loss run."""
        return self.axis_seconds(config.mesh, self.splitter.comm_axis, op, nbytes)

    def split_divisor(self, name: str, role: str | None, config: ParallelConfig) -> float:
        """What node `name`'s split dimension is divided by on one rank under `role` (see Pricing): the split
        ranks, or fewer where a size they do not divide is padded (NodeShard.divisor); 1 where it is whole."""
        t = self.split_ranks(config)
        return self.sharding.roles[name].divisor(t) if role not in (None, ShardRole.REPLICATE) and t > 1 else 1

    def adds_into_buckets(self, config: ParallelConfig) -> bool:
        """Whether meshplan's runtime on a GPU keeps `config`'s gradients as views of gradient buckets (ranks
        that sum them: Evaluator.grad_replicas), so that every backward adds into them; node costs depend on
        it, so the Evaluator's layer caches are keyed by it."""
        return self.gpu_graph is not None and bool(self.overlap.autocast) and self.grad_replicas(config) > 1

    def _curve_times(self, n: OpInfo, share: float, dtype: str, weights: float) -> tuple[float, float] | None:
        """(forward s, backward s) of `n` off the calibrated op curves (fp32 only), or None."""
        return node_curve_times(n, self.curves, self.curve_mix, share, weights) if dtype == DType.FP32 else None

    def _kernel_times(self, n: OpInfo, role: str, scale: float, div: float,
                      config: ParallelConfig) -> tuple[float, float] | None:
        """(forward s, backward s) of `n` priced as the GPU kernels it runs (GEMMs by shape, flash or
        unfused attention, memory passes: cost_models/kernels.py); None on a CPU or for kinds priced
        by the roofline below."""
        if self.gpu_costs is None:
            return None
        mixed = config.dtype != DType.FP32
        widths = self.gpu_graph.widths(n, DType(config.dtype).bytes) if mixed and self.overlap.autocast else None
        pad = self.execution.vocab_multiple if n.name == self._logits else 1
        return node_seconds(n, self.gpu(config.dtype), role=role, share=scale, div=div,
                            fused_attention=self.fused_attention, widths=widths, pad_outputs=pad)

    def gpu(self, dtype: str):
        """The cost_models.kernels.Gpu pricing `dtype` kernels on this cluster's device (a GPU)."""
        key = ("gpu", dtype)
        hit = self._state.get(key)
        if hit is None:
            hit = self._state[key] = gpu_for(self.cluster.device, dtype, self.eff, self.gpu_costs)
        return hit

    def _wave_efficiency(self, n: OpInfo, role: str, scale: float, t: int) -> float:
        """Wave quantization of a conv's implicit GEMM on this device, for its per-rank shape."""
        units = self.cluster.device.compute_units
        if not units or n.kind != OpKind.CONV or not n.output_meta:
            return 1.0
        shape = n.output_meta[0].shape
        split = t if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT) else 1
        cols = shape[1] if len(shape) >= 3 else shape[-1]  # (B*H*W) x out_channels
        rows = n.output_meta[0].numel // max(cols, 1)
        return wave_efficiency(max(int(rows * scale), 1), max(cols // split, 1), units)


def _params_per_rank(n: OpInfo, role: str, t: float) -> float:
    """Parameters of one node held by one tensor-parallel rank.

    Split ops hold 1/t of their weights (t: the divisor, below the tensor degree where a split
    is padded); a row-parallel op's bias is added after the all-reduce and stays whole on every
    rank (Megatron's layout).
    """
    if role == ShardRole.REPLICATE or t == 1:
        return float(n.param_count)
    if role == ShardRole.ROW and any(name.endswith("bias") for name in n.param_names) and n.output_meta:
        bias = n.output_meta[0].shape[1] if n.kind == OpKind.CONV else n.output_meta[0].shape[-1]
        return (n.param_count - bias) / t + bias
    return n.param_count / t


def _score_bytes(n: OpInfo) -> int:
    """Bytes of the (B, H, Tq, Tk) attention score matrix an unfused attention materializes."""
    if len(n.input_meta) < 2 or len(n.input_meta[0].shape) != 4:
        return 0
    b, h, tq, _ = n.input_meta[0].shape
    tk = n.input_meta[1].shape[2]
    return b * h * tq * tk * element_bytes(n.input_meta[0].dtype)


def _dtype_scale(n: OpInfo, dtype: str) -> float:
    """Bytes scale from the captured dtype to the run's compute dtype (floats only)."""
    meta = n.output_meta[0] if n.output_meta else (n.input_meta[0] if n.input_meta else None)
    if meta is None or not meta.dtype.startswith(("float", "bfloat")):
        return 1.0
    return DType(dtype).bytes / element_bytes(meta.dtype)


__all__ = ["NodeCost", "NodePricing"]
