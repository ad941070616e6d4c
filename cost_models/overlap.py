"""What a training stack overlaps, and the seconds of communication that stay exposed.

`Overlap` describes a stack (meshplan's own runtime, Megatron-LM, DeepSpeed, torchtitan) as
switches the Evaluator reads: tensor-parallel communication hidden behind the GEMMs of its
layer, the data-parallel gradient sync hidden behind each stage's last backward passes,
ZeRO parameter all-gathers prefetched, pipeline sends hidden behind the next compute, and a
contention fraction that hidden traffic still costs. `Overlap.preset(name)` gives the named
stacks, each with its source.

The functions below are the exposure formulas, pure functions of seconds:

- ``tp_exposed(comm, gemm, fraction, contention)``: a layer's tensor-parallel communication
  ``comm`` of which ``fraction`` can run under its GEMMs (``gemm`` s); the hidden part is
  ``min(comm * fraction, gemm)``.
- ``bucketed_exposed(comm, bucket, window, contention)``: a collective split in buckets that
  start as a compute of ``window`` s produces (or, for gathers, consumes) them; at least one
  bucket's time is exposed: ``max(bucket, comm - window)``.
- ``chunked_sync_exposed(chunks, later_passes, contention)``: the gradient sync of an
  interleaved pipeline device, chunk by chunk, on one communication stream.
- ``prefetched_exposed(gathers, computes, contention)``: per-layer gathers each prefetched
  behind the previous layer's compute; the first is exposed.
- ``p2p_exposed(send, compute, contention)``: one send hidden behind the next compute.

Contention model (every function): traffic that runs under compute is not free; its kernels
take streaming multiprocessors and memory bandwidth from the compute it hides behind. A
hidden second costs ``contention`` seconds of the critical path, so the exposed time is
``unhidden + contention * hidden``. Collectives that share a link take turns instead: the
data-parallel traffic hides behind the tensor-parallel collectives' time only where the two
axes run on different link levels (planner/strategies/pipeline/strategy.py builds the `DeviceWork`
that way). Units: seconds throughout.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Sequence

from cost_models.activations import SelectivePolicy
from runtime.documents import refuse_unknown_fields
from runtime.vocab import DType

# Share of the GPU an overlapped collective's kernels take from the compute they run under.
# Transformer Engine's userbuffers caps a tensor-parallel overlap at UB_MAX_SM = 32 SMs
# (TransformerEngine transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp) and
# NVIDIA's published H100 overlap configurations give it 1 to 24 SMs per GEMM (NeMo/Megatron
# userbuffers configs, e.g. qkv_wgrad num_sm 24, fc1_dgrad num_sm 2). ASSUMPTION: an
# overlapped collective takes about 16 SMs; 16 of an A100's 108 is 0.15. Drawn from these SM
# counts, not a measured slowdown; a calibrated cluster's simulator measures its own
# (fit.comm.overlap_hidden).
GPU_CONTENTION = 0.15


class OverlapPreset(StrEnum):
    """A training stack whose overlap `Overlap.preset` knows."""

    MESHPLAN = "meshplan"
    MEGATRON_2021 = "megatron-2021"
    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"
    TORCHTITAN = "torchtitan"
    TORCH = "torch"          # meshplan's torch target: PyTorch's stack as torchtitan runs it, under autocast


@dataclass(frozen=True)
class Overlap:
    """The communication a training stack hides behind compute.

    Attributes:
        tp_comm: fraction (0..1) of a layer's tensor-parallel communication that can run under
            the GEMMs it feeds; the hidden part is bounded by those GEMMs' time.
        grad_reduce: the data-parallel gradient sync (all-reduce, or ZeRO's reduce-scatter)
            is issued bucket by bucket during each stage's last backward pass; False: after
            the pipeline flush, all of it exposed.
        param_gather: ZeRO parameter all-gathers are prefetched: under ZeRO-3 each layer's
            gather runs under the previous layer's compute (the first is exposed); under
            ZeRO-1/2 the updated weights are gathered under the next step's forward.
        p2p: a pipeline send runs under the next compute of its device (exposed:
            max(0, send - compute) per send), the fill and drain hops stay exposed.
        contention: seconds of critical path each hidden second of traffic still costs (0..1).
        grad_reduce_dtype: the dtype gradients are reduced in (None: the compute dtype);
            fp32 where a stack reduces fp32 main gradients.
        prefetch_params: the most parameters (elements) ZeRO-3 gathers ahead of their use; a layer
            holding more gathers the rest when it starts, exposed (None: the whole next layer, as
            FSDP's one unit per layer prefetches).
        autocast: the stack runs mixed precision through torch.autocast over fp32 parameters (meshplan's
            runtime and the torch target): values run in the dtype autocast gives each op, with its
            casts (cost_models/autocast.py), and a rank holds fp32 weights and gradients; False: 16-bit
            weights and activations, fp32 master weights in the optimizer (Megatron-LM, DeepSpeed,
            FSDP2 with a bf16 param_dtype).
    """

    tp_comm: float = 0.0
    grad_reduce: bool = True
    param_gather: bool = False
    p2p: bool = False
    contention: float = 0.0
    grad_reduce_dtype: DType | None = None
    prefetch_params: float | None = None
    autocast: bool = True

    def __post_init__(self) -> None:
        if self.prefetch_params is not None:
            v = self.prefetch_params
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v > 0:
                raise ValueError(f"Overlap.prefetch_params must be a positive parameter count or None "
                                 f"(the whole next layer), got {v!r}")
            object.__setattr__(self, "prefetch_params", float(v))
        for name in ("tp_comm", "contention"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:
                raise ValueError(f"Overlap.{name} must be a number in [0, 1], got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("grad_reduce", "param_gather", "p2p", "autocast"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Overlap.{name} must be true or false, got {getattr(self, name)!r}")
        if self.grad_reduce_dtype is not None:
            try:
                object.__setattr__(self, "grad_reduce_dtype", DType(self.grad_reduce_dtype))
            except ValueError:
                raise ValueError(f"Overlap.grad_reduce_dtype {self.grad_reduce_dtype!r} is not one of "
                                 f"{', '.join(DType)}; leave it out for the compute dtype") from None

    @classmethod
    def preset(cls, name: str) -> Overlap:
        """The overlap of the stack `name` (an `OverlapPreset` value); ValueError naming the known ones."""
        try:
            return _PRESETS[OverlapPreset(name)]
        except ValueError:
            raise ValueError(f"unknown overlap preset {name!r}; known: {', '.join(OverlapPreset)}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (the dtype as its string)."""
        d = asdict(self)
        d["grad_reduce_dtype"] = None if self.grad_reduce_dtype is None else self.grad_reduce_dtype.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Overlap:
        """The Overlap `to_dict` wrote; ValueError naming an unknown key."""
        refuse_unknown_fields(d, cls, "Overlap", ValueError)
        return cls(**d)


_PRESETS: dict[OverlapPreset, Overlap] = {
    # meshplan's runtime: tensor-parallel all-reduces are synchronous (runtime/parallel/tensor/layers.py);
    # gradient buckets are reduced from hooks inside each stage's last backward (runtime/execute/grads.py);
    # ZeRO-3 gathers a stage's parameters right before each forward and backward and ZeRO-1/2
    # gather after the step, both waited at once (codegen/strategies/data.py). Its sends are
    # asynchronous, but the planner prices them synchronously: that keeps its analytic step the
    # upper bound of the simulated Programs (cost_models/simulate.py). Contention: not charged
    # here; a calibrated cluster's simulator measures it (fit.comm.overlap_hidden).
    OverlapPreset.MESHPLAN: Overlap(),
    # Megatron-LM SC'21 (Narayanan et al., section 4 and its released scripts): no tensor-parallel
    # overlap, fp32 main gradients all-reduced after the pipeline flush, blocking p2p.
    OverlapPreset.MEGATRON_2021: Overlap(grad_reduce=False, grad_reduce_dtype=DType.FP32, autocast=False),
    # Megatron-Core (Megatron-LM arguments.py): --tp-comm-overlap (Transformer Engine userbuffers,
    # the all-gather/reduce-scatter of a layer split under its GEMMs), --overlap-grad-reduce,
    # --overlap-param-gather (distributed optimizer), --overlap-p2p-comm (interleaved 1F1B).
    OverlapPreset.MEGATRON: Overlap(tp_comm=1.0, grad_reduce=True, param_gather=True, p2p=True,
                                    contention=GPU_CONTENTION, autocast=False),
    # DeepSpeed ZeRO (docs "ZeRO optimizations": overlap_comm, stage3_prefetch_bucket_size):
    # gradient reduction overlapped with backward, ZeRO-3 parameters prefetched; no
    # tensor-parallel overlap, blocking pipeline p2p.
    # Its prefetch is bounded: stage3_prefetch_bucket_size, "maximum number of parameter elements to
    # fetch ahead of use", defaults to 5e7 (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig).
    OverlapPreset.DEEPSPEED: Overlap(grad_reduce=True, param_gather=True, contention=GPU_CONTENTION,
                                     prefetch_params=5e7, autocast=False),
    # torchtitan (docs/fsdp.md, FSDP2): each layer's all-gather prefetched one layer ahead and the
    # reduce-scatter overlapped with backward; async tensor parallelism is optional
    # (--parallelism.enable_async_tensor_parallel, off by default); torch.distributed.pipelining
    # waits its batched sends and receives around each action.
    OverlapPreset.TORCHTITAN: Overlap(grad_reduce=True, param_gather=True, contention=GPU_CONTENTION,
                                      autocast=False),
    # meshplan's torch target (planner.parallelize, codegen --target torch): the same overlap, but its loop
    # trains fp32 parameters under torch.autocast (codegen/torch_target/script_parallel.py), FSDP2 without a
    # 16-bit param_dtype
    OverlapPreset.TORCH: Overlap(grad_reduce=True, param_gather=True, contention=GPU_CONTENTION, autocast=True),
}


def stack_selective(name: str) -> SelectivePolicy:
    """What selective recomputation keeps under the stack `name` (an `OverlapPreset` value): torchtitan's
    per-op policy for torchtitan, Megatron's attention core for the others (meshplan's runtime included)."""
    stack = OverlapPreset(name)
    return SelectivePolicy.ALTERNATE_MATMULS if stack is OverlapPreset.TORCHTITAN else SelectivePolicy.ATTENTION_CORE


@dataclass(frozen=True)
class DeviceWork:
    """One pipeline device's compute for one micro-batch: what its gradient and weight traffic can
    hide behind.

    Attributes:
        layers: (parameters held, forward s, backward s with recompute) per layer the device runs,
            in forward order (its model chunks one after another, chunk 0 first): the compute, and
            the in-layer collectives where they run on another link than the traffic hidden.
        chunk_sizes: layers per model chunk, in the same order (one entry without interleaving).
        later_passes: backward passes of each chunk in the last group of the schedule (the
            chunks' last passes are this many passes apart; min(p, m) under interleaved 1F1B).
    """

    layers: tuple[tuple[float, float, float], ...]
    chunk_sizes: tuple[int, ...]
    later_passes: int = 1

    @property
    def forward(self) -> float:
        """Seconds of one micro-batch's forward on the device."""
        return math.fsum(f for _, f, _ in self.layers)

    def chunks(self, params: float) -> list[tuple[float, float]]:
        """(backward s of one pass, share of `params`) per chunk, in the order the chunks' last backward
        passes run (the highest chunk first); `params` is split in proportion to the chunks' own."""
        out, lo = [], 0
        for size in self.chunk_sizes:
            part = self.layers[lo:lo + size]
            out.append((math.fsum(b for _, _, b in part), math.fsum(n for n, _, _ in part)))
            lo += size
        held = math.fsum(n for _, n in out)
        return [(b, params * n / held if held else params / len(out)) for b, n in reversed(out)]


# --- exposure formulas (seconds) ------------------------------------------------------------


def _charge(comm: float, hidden: float, contention: float) -> float:
    """What `comm` s of traffic of which `hidden` s ran under compute costs the critical path."""
    return comm - hidden + contention * hidden


def tp_exposed(comm: float, gemm: float, fraction: float, contention: float) -> float:
    """Exposed seconds of one layer's tensor-parallel communication (`comm` s) of which `fraction`
    can run under the `gemm` s of GEMMs it feeds: hidden = min(comm * fraction, gemm)."""
    return _charge(comm, min(comm * fraction, gemm), contention)


def bucketed_exposed(comm: float, bucket: float, window: float, contention: float) -> float:
    """Exposed seconds of a bucketed collective (`comm` s in all, one bucket `bucket` s) that runs
    while a compute of `window` s produces or consumes its buckets: max(bucket, comm - window)
    (the last bucket produced, or the first one consumed, has no compute to hide behind)."""
    exposed = min(comm, max(bucket, comm - window))
    return _charge(comm, comm - exposed, contention)


def chunked_sync_exposed(chunks: Sequence[tuple[float, float, float]], later_passes: int,
                         contention: float) -> float:
    """Exposed seconds of an interleaved pipeline device's gradient sync.

    `chunks`: (backward s of one pass, sync s, one bucket's sync s) per model chunk of the
    device, in the order their last backward passes run (the highest chunk first). After a
    chunk's last pass the device runs `later_passes` more passes of each following chunk
    (in 1F1B interleaving, the p micro-batches of a group; min(p, m)). A chunk's buckets
    start as its last pass produces them; its last bucket starts at that pass's end; the
    chunks' syncs share one communication stream. Exposed = max(0, stream end - compute end).
    With one chunk it is `bucketed_exposed`.
    """
    now = comm_end = 0.0
    total = 0.0
    for k, (backward, sync, bucket) in enumerate(chunks):
        if k:
            now += (later_passes - 1) * backward    # the chunk's other passes of the last group
        start = max(now, comm_end)
        now += backward                              # its last pass
        comm_end = max(start + sync, now + min(bucket, sync))
        total += sync
    exposed = max(0.0, comm_end - now)
    return _charge(total, total - exposed, contention)


def prefetched_exposed(gathers: Sequence[float], computes: Sequence[float], contention: float) -> float:
    """Exposed seconds of per-layer gathers prefetched one layer ahead: layer k's gather runs under
    layer k-1's compute, the first layer's is exposed: g0 + sum max(0, g_k - c_{k-1}).
    `gathers` and `computes` (s) are in the order the layers run."""
    if not gathers:
        return 0.0
    exposed = gathers[0] + sum(max(0.0, g - c) for g, c in zip(gathers[1:], computes))
    total = math.fsum(gathers)
    return _charge(total, total - exposed, contention)


def p2p_exposed(send: float, compute: float, contention: float) -> float:
    """Exposed seconds of one pipeline send (`send` s) under the next compute (`compute` s)."""
    return _charge(send, min(send, compute), contention)


__all__ = [
    "GPU_CONTENTION",
    "DeviceWork",
    "Overlap",
    "OverlapPreset",
    "bucketed_exposed",
    "chunked_sync_exposed",
    "p2p_exposed",
    "prefetched_exposed",
    "tp_exposed",
]
