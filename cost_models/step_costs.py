"""The parts of a training step outside the captured graph, priced as the runtime runs them on a GPU.

* The loss on the last stage (`loss_cost`): F.cross_entropy over the logits upcast to fp32 (the
  runtime's full loss, runtime/losses.py), or the fused chunked loss (runtime/chunked_loss.py), which
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
from cost_models.gpu_fit import adam_seconds, loss_passes
from cost_models.kernels import Gpu

# The chunked loss's chunk when the build leaves it to the runtime: one chunk's fp32 logits stay under
# this many bytes, in whole multiples of CHUNK_ALIGN tokens so the chunk's GEMMs stay aligned
# (runtime/chunked_loss.py states the same rule).
CHUNK_LOGIT_BYTES = 256 * 2**20
CHUNK_ALIGN = 64


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the chunked loss when the build does not set them (see CHUNK_LOGIT_BYTES)."""
    return max(CHUNK_LOGIT_BYTES // (4 * max(vocab, 1)) // CHUNK_ALIGN * CHUNK_ALIGN, CHUNK_ALIGN)


@dataclass(frozen=True)
class StepSetup:
    """What the training step runs besides the model, as the build's TrainSpec will say (runtime/spec.py).

    optimizer: "adamw" or "sgd" (momentum); optimizer_impl: "auto" (fused AdamW, foreach SGD on a GPU:
    runtime/optim.py), "fused", "foreach" or "for-loop"; clip_grad: the step clips the global gradient
    norm (or checks fp16 overflow), which computes the norm over every gradient; zero_grad_in_place: the
    runtime zeroes gradients in place before each step's backward (runtime/executor.py ZERO_GRAD), so the
    backward adds into them; pinned_batches: batches are copied to the device from pinned memory; loss:
    the loss the last stage computes (runtime/losses.py: "cross_entropy" or "mse"); grad_norm: the step
    computes the global gradient norm (meshplan's runtime does every step, for its metrics: runtime/grad_step.py)."""

    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    clip_grad: bool = False
    zero_grad_in_place: bool = True
    pinned_batches: bool = False
    loss: str = "cross_entropy"
    grad_norm: bool = True

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"StepSetup.optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.optimizer_impl not in ("auto", "fused", "foreach", "for-loop"):
            raise ValueError(f"StepSetup.optimizer_impl must be auto, fused, foreach or for-loop, got "
                             f"{self.optimizer_impl!r}")

    def impl_on_gpu(self) -> str:
        """The implementation `auto` stands for on a GPU (runtime/optim.py resolve_impl)."""
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


def chunked_loss_cost(gpu: Gpu, tokens: float, vocab: float, hidden: int, *, chunk_tokens: int = 0,
                      vocab_parallel: int = 1, allreduce=None) -> LossCost:
    """The fused chunked loss (runtime/chunked_loss.py) over `tokens` hidden states of width `hidden` and
    `vocab` output rows on this rank, including the output layer's GEMMs it replaces: per chunk of c tokens
    the logits GEMM (c x vocab x hidden), their fp32 log-sum-exp and softmax gradient (passes over the chunk
    in fp32: the cast 6, the log-sum-exp 4, exp and the one-hot correction 8 and the cast of the gradient 6
    bytes a logit), and the two gradient GEMMs (input and weight); 3 GEMM passes in all, as the unfused
    head's forward and backward. Memory: one chunk's logits and gradient (12 bytes a logit) and the
    gradients of the hidden states (4 bytes each) and of the weight (4 bytes each) formed in forward."""
    n, v = max(int(round(tokens)), 1), max(int(round(vocab)), 1)
    chunk = chunk_tokens or default_chunk_tokens(v)
    chunk = min(chunk, n)
    chunks = -(-n // chunk)
    c = gpu.costs
    e = gpu.elem_bytes
    dev = host = 0.0
    for size in ([chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])):
        logits = float(size) * v
        gemm_bytes = (size * hidden + v * hidden + size * v) * e
        dev += gpu.gemm(GemmShape(size, v, hidden), gemm_bytes)                      # logits
        dev += gpu.gemm(GemmShape(size, hidden, v), gemm_bytes, True)                # d hidden
        dev += gpu.gemm(GemmShape(v, hidden, size), gemm_bytes, True)                # d weight
        dev += gpu.stream("softmax", 24 * logits, kernels=6)
        host += 3 * c.host_gemm + 6 * c.host_op
    if vocab_parallel > 1 and allreduce is not None:
        dev += 3 * allreduce(4.0 * n)
        host += 3 * c.host_op
    peak = 12.0 * min(chunk, n) * v + 4.0 * n * hidden + 4.0 * v * hidden
    # the whole computation runs in forward (gradients formed there, scaled in backward)
    return LossCost(forward=Work(dev, host), backward=Work(gpu.stream("elementwise", 8.0 * (n + v) * hidden),
                                                           2 * c.host_op * c.host_backward_share),
                    peak_bytes=peak, kept_bytes=4.0 * (n + v) * hidden) if chunks else \
        LossCost(Work(), Work(), 0.0, 0.0)


# The runtime's global gradient norm (runtime/grad_norm.py) runs per optimizer tensor: a float64
# vector_norm of its gradient, its square, and the add into the running total.
NORM_KERNELS_PER_TENSOR = 3


def optimizer_cost(gpu: Gpu, params: float, tensors: int, *, impl: str, clip: bool, zero_in_place: bool,
                   norm: bool = True, groups: int = 1) -> Work:
    """One optimizer phase on one rank holding `params` parameters in `tensors` tensors: the global gradient
    norm (`norm`: meshplan's runtime computes it every step, for its metrics and clipping: three kernels per
    tensor reading its gradient once, runtime/grad_norm.py), clipping (`clip`: a multiply per tensor, reading
    and writing each gradient), the AdamW step by implementation, and zeroing the gradients in place (4 bytes
    written each, a kernel per tensor) when the runtime zeroes rather than frees them."""
    c = gpu.costs
    dev = adam_seconds(gpu, params, tensors, impl)
    host = groups * c.host_op * (4 if impl in ("fused", "foreach") else tensors)
    if norm:
        dev += gpu.stream("elementwise", 4.0 * params, kernels=NORM_KERNELS_PER_TENSOR * tensors)
        host += NORM_KERNELS_PER_TENSOR * tensors * c.host_op
    if clip:
        dev += gpu.stream("elementwise", 8.0 * params, kernels=tensors)
        host += tensors * c.host_op
    if zero_in_place:
        dev += gpu.stream("elementwise", 4.0 * params, kernels=tensors)
        host += tensors * c.host_op
    return Work(dev, host)


def accumulate_grads(gpu: Gpu, params: float, tensors: int) -> Work:
    """Backward adding new gradients into gradients that exist (zeroed in place, or a second micro-batch):
    an add_ per tensor reading both and writing one (12 bytes a parameter, fp32)."""
    return Work(gpu.stream("elementwise", 12.0 * params, True, kernels=tensors),
                tensors * gpu.costs.host_op * gpu.costs.host_backward_share)


def h2d_seconds(gpu: Gpu, nbytes: float, pinned: bool) -> Work:
    """A host-to-device copy of `nbytes` (a micro-batch's inputs or targets)."""
    c = gpu.costs
    return Work(nbytes / (c.h2d_pinned if pinned else c.h2d_pageable) + gpu.kernel_gap, c.host_op)
