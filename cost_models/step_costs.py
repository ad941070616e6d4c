"""The parts of a training step outside the captured graph, priced as the runtime runs them on a GPU.

* The loss on the last stage: F.cross_entropy over the logits upcast to fp32 (the runtime's full loss,
  runtime/losses.py, `full_loss_cost`), the same through torch.compile (`compiled_loss_cost`), or the
  fused chunked loss (runtime/execute/chunked_loss.py), which
  computes the output layer's GEMMs itself chunk by chunk and never holds the whole logits.
* The optimizer phase (`optimizer_cost`): the optimizer's step by implementation (fused / foreach
  multi-tensor kernels: a cost per tensor and per byte, cost_models/gpu_fit.adam_seconds), the global
  gradient norm where the step clips (or checks for fp16 overflow), and zeroing the gradients.
* Host-to-device copies of a micro-batch (`h2d_seconds`).
* The host side (`host_op_seconds`): the seconds the host spends dispatching an op, which bounds a
  step when the device finishes its kernels sooner (cost_models/gpu_fit.queue_seconds).

Each returns `Work`: device and host seconds, so callers build the step's two timelines. Units:
seconds and bytes. The constants are the device's GpuCosts (cost_models/gpu_costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.gemm import GemmShape
from cost_models.gpu_fit import adam_seconds, compiled_loss_passes, loss_passes
from cost_models.kernels import Gpu
from runtime.execute.chunked_loss import auto_chunk_tokens
from runtime.vocab import OpKind

@dataclass(frozen=True)
class StepSetup:
    """What the training step runs besides the model, as the build's TrainSpec will say (runtime/spec.py).

    optimizer: "adamw" or "sgd" (momentum); optimizer_impl: "auto" (fused AdamW, foreach SGD on a GPU:
    runtime/execute/optim.py), "fused", "foreach" or "for-loop"; clip_grad: the step clips the global gradient
    norm; loss_scaling: fp16 loss scaling, whose overflow check reads the norm on the host (a second sync
    in the step); loss: the loss the last stage computes (runtime/losses.py: "cross_entropy" or "mse");
    grad_norm: the step computes the global gradient norm (meshplan's runtime does every step, for its
    metrics, unless the build says not to and nothing clips or scales the loss: runtime/execute/grad_step.py).

    How the runtime handles gradients and batches follows from the plan (runtime/executor.py): gradients
    that are views of data-parallel buckets are zeroed in place and every backward adds into them, others
    are freed at ZERO_GRAD; on a GPU each step's batch is copied from pinned memory on a side stream while
    the previous step runs; the host waits for the device once a step (its loss and norm read together)."""

    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    clip_grad: bool = False
    loss_scaling: bool = False
    loss: str = "cross_entropy"
    grad_norm: bool = True

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"StepSetup.optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.optimizer_impl not in ("auto", "fused", "foreach", "for-loop"):
            raise ValueError(f"StepSetup.optimizer_impl must be auto, fused, foreach or for-loop, got "
                             f"{self.optimizer_impl!r}")

    def impl_on_gpu(self) -> str:
        """The implementation `auto` stands for on a GPU (runtime/execute/optim.py resolve_impl)."""
        if self.optimizer_impl != "auto":
            return self.optimizer_impl
        return "fused" if self.optimizer == "adamw" else "foreach"

    @property
    def state_bytes(self) -> int:
        """fp32 optimizer state per parameter: AdamW's m and v (8), SGD's momentum (4)."""
        return 8 if self.optimizer == "adamw" else 4


@dataclass(frozen=True)
class Work:
    """Device seconds (kernels and the gaps between them) and host seconds (dispatching them)."""

    device: float = 0.0
    host: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.device + other.device, self.host + other.host)

    def scaled(self, k: float) -> "Work":
        return Work(self.device * k, self.host * k)


@dataclass(frozen=True)
class LossCost:
    """The loss of one micro-batch on one rank: forward and backward Work, the bytes it holds at its peak
    (`peak_bytes`, during its backward) and the part of them kept from its forward to its backward
    (`kept_bytes`)."""

    forward: Work
    backward: Work
    peak_bytes: float
    kept_bytes: float


def _sum(ops) -> Work:
    return Work(sum(o.device for o in ops), sum(o.host for o in ops))


def full_loss_cost(gpu: Gpu, tokens: float, vocab: float, *, logits_bytes: int, vocab_parallel: int = 1,
                   allreduce=None) -> LossCost:
    """F.cross_entropy over (tokens x vocab) logits of `logits_bytes` bytes an element, upcast to fp32 when
    they are 16-bit (runtime/losses.py), forward and backward (cost_models/gpu_fit.loss_ops). With
    `vocab_parallel` = t > 1 the logits are split by class and the loss is the vocabulary-parallel one:
    `allreduce(nbytes)` prices each of its three all-reduces of one fp32 value per token.

    Memory, per logit element: the log-probabilities (4 bytes) are kept from the forward; the backward
    holds them, the gradient nll_loss fills (4) and log_softmax's input gradient (4) at once: 12 bytes."""
    n, v = max(int(round(tokens)), 1), max(int(round(vocab)), 1)
    f_ops, b_ops = loss_passes(gpu, n, v, upcast=logits_bytes < 4)
    fwd, bwd = _sum(f_ops), _sum(b_ops)
    if vocab_parallel > 1 and allreduce is not None:
        fwd = fwd + Work(3 * allreduce(4.0 * n), 3 * gpu.costs.host_op)
    e = float(n) * v
    return LossCost(forward=fwd, backward=bwd, peak_bytes=12.0 * e, kept_bytes=4.0 * e)


def compiled_loss_cost(gpu: Gpu, tokens: float, vocab: float, *, logits_bytes: int,
                       held_vocab: float | None = None) -> LossCost:
    """The same F.cross_entropy through torch.compile (runtime/losses.compiled_loss) over (tokens x vocab) logits
    of `logits_bytes` bytes an element, whole on this rank, forward and backward: the fused kernels of
    cost_models/gpu_fit.compiled_loss_passes, 8 bytes moved a 16-bit logit (the eager loss: 48).

    Memory: kept from forward to backward, the logits themselves (`held_vocab` columns of them, the padded
    width where the output layer is padded; default `vocab`) and two fp32 values a row (the max and the
    log-sum-exp); the backward adds the logits' gradient in their dtype."""
    n, v = max(int(round(tokens)), 1), max(int(round(vocab)), 1)
    f_ops, b_ops = compiled_loss_passes(gpu, n, v, logits_bytes=logits_bytes)
    w, e = float(logits_bytes), float(n) * v
    kept = w * n * max(float(held_vocab or v), v) + 8.0 * n
    return LossCost(forward=_sum(f_ops), backward=_sum(b_ops), peak_bytes=kept + w * e, kept_bytes=kept)


def chunked_loss_cost(gpu: Gpu, tokens: float, vocab: float, hidden: int, *, chunk_tokens: int = 0,
                      vocab_parallel: int = 1, allreduce=None, gather=None) -> LossCost:
    """The fused chunked loss (runtime/execute/chunked_loss.py) over `tokens` hidden states of width `hidden` and
    `vocab` output rows on this rank, the output layer's GEMMs included, as that module states its work
    (U = one GEMM pass over tokens x vocab x hidden; per logit, the elementwise bytes of its chunk body):

    * one rank (no vocabulary split): the gradients are formed in forward chunk by chunk: forward 3U and 36
      bytes a logit; backward scales the kept gradients (of the hidden states, 2 bytes each, and of the
      weight, 4 bytes each); kept from forward to backward: those gradients;
    * a vocabulary split over t > 1 ranks: forward U and 30 bytes a logit with one all-gather of 2 fp32
      values a token (`gather(nbytes)`), backward recomputes the logits: 3U and 28 bytes a logit, and one
      all-reduce of the hidden states' gradient (`allreduce(nbytes)`); kept: a log-sum-exp a token.

    Transient at its peak: one chunk's logits (6 bytes each in 16-bit compute), the weight's 16-bit cast and
    a 16-bit weight-sized product before it joins its fp32 accumulator (4 bytes each)."""
    n, v = max(int(round(tokens)), 1), max(int(round(vocab)), 1)
    chunk = min(chunk_tokens or auto_chunk_tokens(n, v), n)   # the runtime's own rule when the build leaves it
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    c = gpu.costs
    e = gpu.elem_bytes

    def passes(k: int, backward: bool) -> Work:
        """k GEMM passes over every chunk (the logits, the input gradient, the weight gradient, in order)."""
        dev = 0.0
        for size in sizes:
            nbytes = (size * hidden + v * hidden + size * v) * e
            shapes = [GemmShape(size, v, hidden), GemmShape(size, hidden, v), GemmShape(v, hidden, size)]
            dev += sum(gpu.gemm(shapes[(j if k == 3 else 0) % 3], nbytes, backward) for j in range(k))
        return Work(dev, k * len(sizes) * c.host_gemm * (c.host_backward_share if backward else 1.0))

    def body(bytes_per_logit: float, backward: bool) -> Work:
        ops = 8 * len(sizes)   # the chunk body's ops: cast, max, exp, sum, log, gather, subtract, cast back
        return Work(gpu.stream(OpKind.SOFTMAX, bytes_per_logit * n * v, backward, kernels=ops),
                    ops * c.host_op * (c.host_backward_share if backward else 1.0))

    transient = 6.0 * chunk * v + (2 + 4) * v * hidden
    if vocab_parallel <= 1:
        fwd = passes(3, False) + body(36, False)
        kept = 2.0 * n * hidden + 4.0 * v * hidden
        bwd = Work(gpu.stream(OpKind.ELEMENTWISE, 2 * kept, True, kernels=2), 2 * c.host_op * c.host_backward_share)
        return LossCost(forward=fwd, backward=bwd, peak_bytes=kept + transient, kept_bytes=kept)
    fwd = passes(1, False) + body(30, False)
    bwd = passes(3, True) + body(28, True)
    if gather is not None:
        fwd = fwd + Work(gather(8.0 * n), c.host_op)
    if allreduce is not None:
        bwd = bwd + Work(allreduce(2.0 * n * hidden), c.host_op)
    kept = 4.0 * n
    return LossCost(forward=fwd, backward=bwd, peak_bytes=kept + transient + 2.0 * n * hidden + 4.0 * v * hidden,
                    kept_bytes=kept)


# The runtime's global gradient norm (runtime/execute/grad_norm.py) is a foreach norm per dtype of the gradients,
# stacked, squared and summed: a few kernels reading every gradient once.
NORM_KERNELS = 4


def optimizer_cost(gpu: Gpu, params: float, tensors: int, *, impl: str, clip: bool, zero_in_place: bool,
                   norm: bool = True, groups: int = 1, buckets: int = 1) -> Work:
    """One optimizer phase on one rank holding `params` parameters in `tensors` tensors: the global gradient
    norm (`norm`: meshplan's runtime computes it every step for its metrics, unless built with --no-grad-norm,
    and for clipping and loss scaling, as foreach kernels
    reading each gradient once, runtime/execute/grad_norm.py), clipping (`clip`: a foreach multiply reading and
    writing each gradient), the AdamW step by implementation, and zeroing the gradients in place where they
    are views of `buckets` gradient buckets (`zero_in_place`: a kernel per bucket, 4 bytes written each;
    without buckets the runtime frees them instead, which costs nothing)."""
    c = gpu.costs
    dev = adam_seconds(gpu, params, tensors, impl)
    host = groups * c.host_op * (4 if impl in ("fused", "foreach") else tensors)
    if norm:
        dev += gpu.stream(OpKind.ELEMENTWISE, 4.0 * params, kernels=NORM_KERNELS)
        host += NORM_KERNELS * c.host_op
    if clip:
        dev += gpu.stream(OpKind.ELEMENTWISE, 8.0 * params, kernels=2)
        host += 2 * c.host_op
    if zero_in_place:
        dev += gpu.stream(OpKind.ELEMENTWISE, 4.0 * params, kernels=max(buckets, 1))
        host += max(buckets, 1) * c.host_op
    return Work(dev, host)


def accumulate_grads(gpu: Gpu, params: float, tensors: int) -> Work:
    """Backward adding new gradients into gradients that exist (zeroed in place, or a second micro-batch):
    an add_ per tensor reading both and writing one (12 bytes a parameter, fp32)."""
    return Work(gpu.stream(OpKind.ELEMENTWISE, 12.0 * params, True, kernels=tensors),
                tensors * gpu.costs.host_op * gpu.costs.host_backward_share)


def h2d_seconds(gpu: Gpu, nbytes: float, pinned: bool) -> Work:
    """A host-to-device copy of `nbytes` (a micro-batch's inputs or targets), on the step's stream."""
    c = gpu.costs
    return Work(nbytes / (c.h2d_pinned if pinned else c.h2d_pageable) + gpu.kernel_gap, c.host_op)


def prefetched_batch(gpu: Gpu) -> Work:
    """A micro-batch prefetched as meshplan's runtime does on a GPU (runtime/executor.py prefetch): made,
    pinned and copied on a side stream while the previous step runs, so the step's own stream only waits
    for a copy long done; the host pins and dispatches it (two ops)."""
    return Work(0.0, 2 * gpu.costs.host_op)
