"""Fused, chunked cross-entropy: the loss of `hidden @ weight.T + bias` against integer targets,
computed over chunks of tokens, never holding the whole (tokens x vocabulary) logits.

    loss = chunked_cross_entropy(hidden, weight, targets, bias=..., group=..., vocab_start=..., vocab_valid=...)

equals, within the compute dtype's rounding,

    F.cross_entropy((hidden @ weight.T + bias).float().flatten(0, -2), targets.flatten(), ignore_index=...)

(the mean over the tokens whose target is not ignore_index; nan when every token is ignored, with zero
gradients, as F.cross_entropy), with gradients for hidden, weight and bias. `chunked_eval` gives the
held-out evaluation's (loss, correct argmax predictions, targets counted) the same way, without gradients.

Shapes and dtypes. hidden (..., C) float; weight (V_local, C); bias (V_local,) or None; targets (...)
integer class ids (global ids under vocabulary parallelism) or ignore_index. The compute dtype is the
autocast dtype when torch.autocast is on for hidden's device (fp64 inputs stay fp64, as autocast leaves
them), else the promoted dtype of hidden and weight; the weight is cast to it once per call and each
chunk of hidden once. A chunk's logits come from one GEMM in the compute dtype (tensor cores), are
upcast to fp32 (fp64 for fp64 inputs: the "statistics dtype"), the bias added there, and the
log-sum-exp and the softmax run in that dtype. The loss is a 0-dim tensor of the statistics dtype.
Targets must lie in [0, vocabulary) or equal ignore_index; other values (or a target that names a
padding row) give an undefined loss: checking them would cost a host sync per call.

Chunks. `chunk_tokens` tokens per chunk; 0 picks `auto_chunk_tokens(tokens, V_local)`: the most rows
whose logits take at most CHUNK_LOGITS_BYTES (256 MiB) at 4 bytes per logit, i.e.
rows_max = max(1, 256 MiB // (4 * V_local)) (1334 rows at V_local = 50304), then balanced: the
chunk count n = ceil(tokens / rows_max) and rows = ceil(tokens / n), rounded up to a multiple of 64
while that stays <= rows_max (aligned GEMMs). A chunk holds at most one fp32 logits buffer
(rows x V_local x 4 bytes), plus, when the compute dtype is 16-bit, the GEMM's output and the
gradient of the logits in that dtype (rows x V_local x 2 bytes each, never both at once: the peak of
a chunk is rows x V_local x 6 bytes).

Padding rows. Rows [vocab_valid, V_local) of the weight pad the vocabulary (for alignment, or a
vocabulary the tensor degree does not divide): their logits are set to -inf before any reduction, so
they never win the max nor add to the sum, and their gradient rows are exactly zero.

Vocabulary parallelism (group of t > 1 ranks, the tensor group): this rank holds the classes
[vocab_start, vocab_start + V_local), of which the first vocab_valid are real; hidden and targets are
the same on every rank of the group. Per token each rank computes its local log-sum-exp and its
target logit (0 when another rank holds the target); ONE all_gather per call of a (2, tokens) fp32
tensor gives every rank all of them, from which the global log-sum-exp (logsumexp over the ranks)
and the target logit (sum over the ranks) follow. The gradient of hidden is the sum over the ranks'
partial gradients: this function all-reduces it in backward (one all_reduce of tokens x C in
hidden's dtype), so the caller must NOT also route hidden through copy_to_group; under sequence
parallelism it gathers hidden with `tensor_parallel.gather_whole` (every rank then holds the whole
gradient and keeps its block).

Gradients: two strategies, chosen by the group. Let U = 2 * tokens * V_local * C FLOPs (one GEMM over
this rank's vocabulary shard).

* No group, or a group of one (`grads_in_forward(group)` is True): the gradients are formed in forward,
  chunk by chunk (as Liger-Kernel's fused linear cross-entropy): after a chunk's log-sum-exp its logits
  buffer becomes (softmax - onehot) / count in place, and the chunk's gradient of hidden
  (grad_logits @ W), of the weight (grad_logits^T @ hidden, accumulated) and of the bias are formed.
  GEMM work: forward 3U (U logits + U grad hidden + U grad weight; a grad not needed is skipped, U
  each), backward 0 (it multiplies the kept gradients by grad_output in place: tokens*C + V_local*C +
  V_local elements). Memory kept from forward until backward (freed by it): grad hidden
  tokens x C in hidden's dtype, grad weight V_local x C in fp32 (the accumulator; cast to the
  weight's dtype in backward when that is 16-bit), grad bias V_local in fp32. Nothing else is saved:
  neither hidden nor the weight is kept for backward by this op. Transient during forward: one chunk
  (above), the weight cast to the compute dtype (V_local x C x 2 bytes, when a cast is needed), and
  when the compute dtype is 16-bit, one V_local x C product in it before it is added to the fp32
  accumulator. The backward of one call runs once: a second backward through the same graph
  (retain_graph) raises ChunkedLossError. The kept gradients live per call in flight: a pipeline
  schedule that runs several forwards of the last stage before their backwards (GPipe) keeps one set
  per micro-batch (1F1B: one), and a stage recomputed in backward (activation checkpointing) runs
  this forward, its 3U included, twice.
* A group of t > 1 ranks: the chunk logits are recomputed in backward, so that forward needs the
  global statistics only once, for all chunks (the gradient of a chunk needs the global
  log-sum-exp; forming it in forward would cost one collective per chunk, or a second logits pass).
  GEMM work: forward U, backward 3U (U logits again + U grad hidden + U grad weight), 4U in all.
  Memory saved for backward: the per-token global log-sum-exp (tokens x 4 bytes), the weight cast to
  the compute dtype when a cast is needed (V_local x C x 2 bytes; else the weight itself), hidden
  and targets (references to the caller's tensors). Transient during backward: one chunk, grad hidden
  (tokens x C, hidden's dtype), the fp32 grad weight accumulator (V_local x C x 4), grad bias.
  Communication: forward one all_gather (2 x tokens fp32 sent per rank, 2 x tokens x t received),
  backward one all_reduce of grad hidden (tokens x C, hidden's dtype).

For comparison, F.cross_entropy over materialized logits costs 3U (forward U, backward 2U) and holds
the logits (tokens x V_local, compute dtype), their fp32 copy and fp32 log-softmax (saved), and in
backward their fp32 gradient and its cast.

Elementwise memory traffic, bytes moved per logit by the eager passes over a chunk (counted from the
op sequence; the GEMMs' own reads and writes excluded). A gradient-forming pass: the upcast with the
bias (16-bit compute only: read 2, write 4), max (read 4), subtract and exp in place (8 + 8), row sum
(read 4), the bias gradient's GEMV (read 4, with a bias only), the per-row scaling with the cast
(read 4, write 2; fp32: 8 in place); the onehot scatter and the target gather touch one logit a row.
These are CUDA's figures, where a 16-bit + fp32 op casts inside the kernel; on CPU TensorIterator would
cast through a chunk-sized temporary, so there the upcast and the bias, and the scaling and the cast,
are two passes each (16-bit: +8 and +8 bytes), with no temporary.
    grads in forward:  36 bytes (16-bit compute) or 32 (fp32), +4 with a bias
    recompute:         forward 30 (16-bit) or 24 (fp32); backward 28 or 24, +4 with a bias
    chunked_eval:      30 (16-bit) or 24 (fp32)
F.cross_entropy over upcast logits moves about 48 (upcast 6, log-softmax ~16, the gradient's zeros
and scatter 4, log-softmax backward ~16, the cast back 6). A compiled or hand-written kernel of the
chunk body (one read for max and sum, one read and one write for the gradient) would move ~8.

The loss scaled before backward ((loss * s).backward()), one backward per micro-batch and a weight
used elsewhere too (tied with an embedding: autograd adds the two gradients) are all plain autograd:
the gradients returned are those of the returned loss times grad_output.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from runtime.comm import Group

CHUNK_LOGITS_BYTES = 256 * 2 ** 20   # the most bytes one chunk's fp32 logits take when chunk_tokens = 0
_ALIGN_ROWS = 64                     # chunk rows are rounded up to a multiple of this where the budget allows


class ChunkedLossError(ValueError):
    """Arguments the chunked cross-entropy cannot use; the message names the argument."""


def auto_chunk_tokens(tokens: int, vocab_local: int, budget_bytes: int = CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk when chunk_tokens = 0: the chunks' fp32 logits (rows x vocab_local x 4 bytes)
    stay within `budget_bytes`, the chunks are as equal as may be, rounded up to a multiple of 64
    rows where that stays within the budget (module docstring)."""
    rows_max = max(1, int(budget_bytes) // (4 * max(int(vocab_local), 1)))
    if tokens <= rows_max:
        return max(int(tokens), 1)
    n = -(-tokens // rows_max)
    rows = -(-tokens // n)
    aligned = -(-rows // _ALIGN_ROWS) * _ALIGN_ROWS
    return aligned if aligned <= rows_max else rows


def grads_in_forward(group: Group | None) -> bool:
    """Whether chunked_cross_entropy forms its gradients in forward (3U of GEMM, the gradients kept
    until backward) rather than recomputing the logits in backward (4U, a group of several ranks)."""
    return group is None or group.size == 1


@dataclass(frozen=True, eq=False)
class _Setup:
    """One call's checked arguments (hidden's rows flattened to (tokens, C))."""

    tokens: int
    rows: int                  # tokens per chunk
    vocab_start: int
    vocab_valid: int
    ignore_index: int
    compute: torch.dtype       # the GEMMs' dtype
    stats: torch.dtype         # the logits' reductions' dtype (fp32, or fp64 for fp64 inputs)
    group: Group | None        # None: no communication (no group, or a group of one rank)


def _setup(hidden, weight, targets, bias, chunk_tokens, ignore_index, vocab_start, vocab_valid, group) -> _Setup:
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ChunkedLossError(f"hidden must be a floating-point tensor (..., C), got "
                               f"{getattr(hidden, 'dtype', type(hidden).__name__)} {tuple(getattr(hidden, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2 \
            or weight.shape[1] != hidden.shape[-1]:
        raise ChunkedLossError(f"weight must be a floating-point (V_local, C) tensor with C = {hidden.shape[-1]} "
                               f"(hidden's last dimension), got {tuple(getattr(weight, 'shape', ()))}")
    v_local = weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (v_local,)):
        raise ChunkedLossError(f"bias must be None or a ({v_local},) tensor (one per weight row), "
                               f"got {tuple(getattr(bias, 'shape', ()))}")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex() \
            or targets.dtype == torch.bool:
        raise ChunkedLossError(f"targets must be an integer tensor of class ids, got "
                               f"{getattr(targets, 'dtype', type(targets).__name__)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ChunkedLossError(f"targets {tuple(targets.shape)} must have hidden's leading shape "
                               f"{tuple(hidden.shape[:-1])} (hidden is (..., C), targets (...))")
    devices = {t.device for t in (hidden, weight, targets, bias) if t is not None}
    if len(devices) > 1:
        raise ChunkedLossError(f"hidden, weight, bias and targets must be on one device, got {sorted(map(str, devices))}")
    for name, value in (("chunk_tokens", chunk_tokens), ("vocab_start", vocab_start), ("ignore_index", ignore_index)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ChunkedLossError(f"{name} must be a whole number, got {value!r}")
    if chunk_tokens < 0:
        raise ChunkedLossError(f"chunk_tokens must be >= 0 (0: auto_chunk_tokens' rule), got {chunk_tokens}")
    if vocab_start < 0:
        raise ChunkedLossError(f"vocab_start must be >= 0, got {vocab_start}")
    solo = group is None or group.size == 1
    valid = v_local if vocab_valid is None else vocab_valid
    if isinstance(valid, bool) or not isinstance(valid, int) or not (1 if solo else 0) <= valid <= v_local:
        raise ChunkedLossError(f"vocab_valid must be a whole number in {1 if solo else 0}..{v_local} (the real "
                               f"classes among the weight's {v_local} rows; 0 only on a rank of a vocabulary-parallel "
                               f"group that holds padding alone), got {vocab_valid!r}")
    compute = torch.promote_types(hidden.dtype, weight.dtype)
    device = hidden.device.type
    if compute != torch.float64 and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        compute = torch.get_autocast_dtype(device)
    tokens = math.prod(hidden.shape[:-1])
    rows = chunk_tokens or auto_chunk_tokens(tokens, v_local)
    return _Setup(tokens=tokens, rows=max(1, min(rows, tokens)), vocab_start=vocab_start, vocab_valid=valid,
                  ignore_index=ignore_index, compute=compute,
                  stats=torch.float64 if compute == torch.float64 else torch.float32,
                  group=None if solo else group)


def _no_autocast(device: torch.device):
    """The dtypes here are chosen explicitly: autocast off inside (where the device has one)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


@dataclass(frozen=True, eq=False)
class _Targets:
    """Per token (tokens,): keep (not ignored), inside (the target is a real class held here), local
    (the target's row here; 0 where not inside)."""

    keep: torch.Tensor
    inside: torch.Tensor
    local: torch.Tensor

    @classmethod
    def of(cls, targets: torch.Tensor, s: _Setup) -> "_Targets":
        t = targets.reshape(-1).long()
        keep = t != s.ignore_index
        local = t - s.vocab_start
        inside = keep & (local >= 0) & (local < s.vocab_valid)
        return cls(keep, inside, local.masked_fill(~inside, 0))


def _chunks(s: _Setup):
    return ((a, min(a + s.rows, s.tokens)) for a in range(0, s.tokens, s.rows))


def _logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, s: _Setup) -> torch.Tensor:
    """(rows, V_local) logits in the statistics dtype from a chunk of hidden and the weight (both in
    the compute dtype; bias in the statistics dtype, added after the upcast); padding rows -inf."""
    if s.compute == s.stats:
        z = torch.mm(h, w.t()) if bias is None else torch.addmm(bias, h, w.t())
    else:
        product = torch.mm(h, w.t())
        if bias is not None and product.is_cuda:
            # the upcast and the bias in one pass (16-bit + fp32 promotes to fp32, as the reference's
            # sum); on CPU TensorIterator would upcast the product into a temporary first
            z = torch.add(product, bias)
        else:
            z = product.to(s.stats)
            if bias is not None:
                z.add_(bias)
        del product
    if s.vocab_valid < z.shape[1]:
        z[:, s.vocab_valid:] = -math.inf
    return z


def _grad_logits(e, norm, tg: _Targets, scale, s: _Setup, gb, a: int, b: int) -> torch.Tensor:
    """The gradient of a chunk's logits in the compute dtype, (softmax - onehot) scaled per row by
    `scale` (rows,), from e = exp(logits - shift) (rows, V_local; consumed: a 16-bit gradient is a new
    tensor, the caller drops e before the GEMMs) whose row sums are `norm` (rows,; None: 1, e is the
    softmax); adds its sum over the rows to the grad bias accumulator gb (V_local,) unless None. The
    softmax's division folds into the per-row factor: (e - norm * onehot) * scale / norm."""
    inside = tg.inside[a:b].to(e.dtype)
    e.scatter_add_(1, tg.local[a:b].unsqueeze(1), -(inside if norm is None else inside * norm).unsqueeze(1))
    factor = scale if norm is None else scale / norm
    if gb is not None:
        gb.addmv_(e.t(), factor)
    if s.compute == s.stats or not e.is_cuda:
        # on CPU a mul into a 16-bit out= would compute into an fp32 temporary of the chunk, then cast
        return e.mul_(factor.unsqueeze(1)).to(s.compute)
    g = torch.empty(e.shape, dtype=s.compute, device=e.device)
    return torch.mul(e, factor.unsqueeze(1), out=g)                   # scaled and cast in one pass


def _grad_matmuls(g, h, w, s: _Setup, gh, gw, a: int, b: int) -> None:
    """Add a chunk's part (rows a..b; g its logits' gradient, h its hidden, both in the compute dtype)
    to grad hidden gh (tokens, C) and the grad weight accumulator gw (V_local, C), each unless None."""
    if gh is not None:
        if gh.dtype == s.compute:
            torch.mm(g, w, out=gh[a:b])
        else:
            gh[a:b] = torch.mm(g, w)
    if gw is not None:
        if gw.dtype == s.compute:
            gw.addmm_(g.t(), h)
        else:
            gw.add_(torch.mm(g.t(), h))


def _statistics(h2, w, bias, tg: _Targets, s: _Setup, *, argmax: bool = False, grads=None, scale=None):
    """Per token (tokens,) in the statistics dtype, over this rank's classes: log-sum-exp, the target
    logit (0 where not inside), and with argmax the best logit and whether its class is the target.
    With `grads` (no group only: the log-sum-exp is then global) the chunks' gradients are formed too."""
    lse = torch.empty(s.tokens, dtype=s.stats, device=h2.device)
    picked = torch.empty_like(lse)
    best = torch.empty_like(lse) if argmax else None
    hit = torch.empty(s.tokens, dtype=torch.bool, device=h2.device) if argmax else None
    for a, b in _chunks(s):
        h = h2[a:b].to(s.compute)
        z = _logits(h, w, bias, s)
        picked[a:b] = z.gather(1, tg.local[a:b].unsqueeze(1)).squeeze(1).masked_fill(~tg.inside[a:b], 0.0)
        if argmax:
            top, idx = z.max(1)   # the first of equal maxima: the lowest class index, as torch.argmax
            best[a:b] = top
            hit[a:b] = (idx == tg.local[a:b]) & tg.inside[a:b]
        else:
            top = z.amax(1)
        # log-sum-exp in place (torch.logsumexp would allocate two chunk-sized temporaries); a row of
        # padding alone (a rank of a group) has max -inf: shift by 0, its log-sum-exp is -inf
        shift = top.masked_fill(top == -math.inf, 0.0)
        z.sub_(shift.unsqueeze(1)).exp_()
        total = z.sum(1)
        torch.add(shift, total.log(), out=lse[a:b])
        if grads is not None:
            g = _grad_logits(z, total, tg, scale[a:b], s, grads[2], a, b)
            del z                      # a 16-bit gradient is a copy: the fp32 chunk goes before the GEMMs
            _grad_matmuls(g, h, w, s, grads[0], grads[1], a, b)
            del g
        else:
            del z
    return lse, picked, best, hit


def _gathered(group: Group, rows: list[torch.Tensor]) -> torch.Tensor:
    """(t, len(rows), tokens): every rank's per-token rows, in group order; one all_gather."""
    mine = torch.stack(rows)
    out = mine.new_empty((group.size, *mine.shape))
    group.all_gather(out.view(-1), mine.view(-1))
    return out


def _loss(lse, picked, keep, count):
    return torch.where(keep, lse - picked, 0.0).sum() / count


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, s: _Setup):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with _no_autocast(hidden.device):
            h2 = hidden.reshape(-1, hidden.shape[-1])
            w = weight.to(s.compute)   # once per call
            b32 = None if bias is None else bias.to(s.stats)
            tg = _Targets.of(targets, s)
            count = tg.keep.sum()
            inv = 1.0 / count.clamp(min=1).to(s.stats)   # every token ignored: loss nan, gradients zero
            ctx.setup, ctx.shapes = s, (hidden.shape, hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
            if s.group is None:
                grads = [torch.empty_like(h2) if need_h else None,
                         torch.zeros(weight.shape, dtype=s.stats, device=weight.device) if need_w else None,
                         torch.zeros(weight.shape[0], dtype=s.stats, device=weight.device) if need_b else None]
                lse, picked, _, _ = _statistics(h2, w, b32, tg, s, grads=grads, scale=tg.keep.to(s.stats) * inv)
                ctx.grads = grads
                return _loss(lse, picked, tg.keep, count)
            lse, picked, _, _ = _statistics(h2, w, b32, tg, s)
            every = _gathered(s.group, [lse, picked])
            lse, picked = torch.logsumexp(every[:, 0], 0), every[:, 1].sum(0)
            ctx.save_for_backward(hidden, weight if w is weight else w, bias, targets, lse, inv)
            ctx.grads = None
            return _loss(lse, picked, tg.keep, count)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        s = ctx.setup
        shape, h_dtype, w_dtype, b_dtype = ctx.shapes
        with _no_autocast(grad_out.device):
            if s.group is None:
                if ctx.grads is None:
                    raise ChunkedLossError("chunked_cross_entropy's backward ran twice through one graph "
                                           "(retain_graph): its gradients are formed in forward and handed out "
                                           "once; call chunked_cross_entropy again for a second backward")
                gh, gw, gb = ctx.grads
                ctx.grads = None
            else:
                hidden, w, bias, targets, lse, inv = ctx.saved_tensors
                need_h, need_w, need_b = ctx.needs_input_grad[:3]
                h2 = hidden.reshape(-1, hidden.shape[-1])
                gh = torch.empty_like(h2) if need_h else None
                gw = torch.zeros(w.shape, dtype=s.stats, device=w.device) if need_w else None
                gb = torch.zeros(w.shape[0], dtype=s.stats, device=w.device) if need_b else None
                tg = _Targets.of(targets, s)
                scale = tg.keep.to(s.stats) * (inv * grad_out.to(s.stats))
                b32 = None if bias is None else bias.to(s.stats)
                for a, b in _chunks(s):
                    h = h2[a:b].to(s.compute)
                    p = _logits(h, w, b32, s).sub_(lse[a:b].unsqueeze(1)).exp_()   # softmax from the global lse
                    g = _grad_logits(p, None, tg, scale[a:b], s, gb, a, b)
                    del p
                    _grad_matmuls(g, h, w, s, gh, gw, a, b)
                    del g
                if gh is not None:
                    s.group.all_reduce(gh)   # every rank's classes add to hidden's gradient
                grad_out = None              # already applied through scale
            out = []
            for g, dtype in ((gh, h_dtype), (gw, w_dtype), (gb, b_dtype)):
                if g is not None:
                    if grad_out is not None:
                        g.mul_(grad_out.to(g.dtype))
                    g = g.to(dtype)
                out.append(g)
        return out[0] if out[0] is None else out[0].view(shape), out[1], out[2], None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, chunk_tokens: int = 0, ignore_index: int = -100,
                          vocab_start: int = 0, vocab_valid: int | None = None,
                          group: Group | None = None) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose target is not ignore_index of the logits
    hidden @ weight.T + bias (never materialized: chunks of `chunk_tokens` tokens, 0 for
    auto_chunk_tokens' rule), a 0-dim fp32 tensor (fp64 for fp64 inputs), with gradients for
    hidden, weight and bias. Vocabulary-parallel with `group`: this rank holds classes
    [vocab_start, vocab_start + weight.shape[0]), the first `vocab_valid` of them real (all if None).
    Shapes, dtypes, gradients, FLOPs and memory: the module docstring."""
    s = _setup(hidden, weight, targets, bias, chunk_tokens, ignore_index, vocab_start, vocab_valid, group)
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if wants_grad:
        return _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, s)
    loss, _, _ = _evaluate(hidden, weight, targets, bias, s, argmax=False)
    return loss


def _evaluate(hidden, weight, targets, bias, s: _Setup, argmax: bool):
    with torch.no_grad(), _no_autocast(hidden.device):
        h2 = hidden.reshape(-1, hidden.shape[-1])
        b32 = None if bias is None else bias.to(s.stats)
        tg = _Targets.of(targets, s)
        lse, picked, best, hit = _statistics(h2, weight.to(s.compute), b32, tg, s, argmax=argmax)
        if s.group is not None:
            every = _gathered(s.group, [lse, picked] + ([best, hit.to(s.stats)] if argmax else []))
            lse, picked = torch.logsumexp(every[:, 0], 0), every[:, 1].sum(0)
            if argmax:
                # the first rank with the highest logit holds the lowest class index among ties
                winner = every[:, 2].argmax(0)
                hit = every[:, 3].gather(0, winner.unsqueeze(0)).squeeze(0) > 0
        count = tg.keep.sum()
        return _loss(lse, picked, tg.keep, count), (hit & tg.keep) if argmax else None, count


def chunked_eval(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                 bias: torch.Tensor | None = None, chunk_tokens: int = 0, ignore_index: int = -100,
                 vocab_start: int = 0, vocab_valid: int | None = None,
                 group: Group | None = None) -> tuple[torch.Tensor, int, int]:
    """Without gradients: (the mean loss as chunked_cross_entropy's, the number of counted targets
    whose argmax class over the real vocabulary equals the target, the number of counted targets).

    Counted targets are those not equal to ignore_index (runtime.execute.evaluation.count_correct counts every
    element; the two agree when no target is ignored). The argmax is taken over the fp32 logits, the
    lowest class index among equal maxima, across the ranks of `group` (as count_correct's). One
    all_gather per call with a group; the two counts are read back to the host (a sync)."""
    s = _setup(hidden, weight, targets, bias, chunk_tokens, ignore_index, vocab_start, vocab_valid, group)
    loss, correct, count = _evaluate(hidden, weight, targets, bias, s, argmax=True)
    return loss, int(correct.sum()), int(count)
