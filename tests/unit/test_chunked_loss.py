"""runtime/execute/chunked_loss.py on one process: the chunked cross-entropy and evaluation against
F.cross_entropy over the whole logits (fp64, fp32, bf16 autocast), ignore_index, odd and padded
vocabularies, bias, chunk sizes, the gradients (scaled loss, micro-batches, a tied weight), the
largest tensor created (never the whole logits), and the errors. The vocabulary-parallel path runs
over gloo in tests/distributed/test_chunked_loss_ranks.py.

Tolerances: fp64 agrees to 1e-10 relative (only the summation order differs). fp32 to 1e-5 of the
largest value compared (the chunked sums and GEMMs add in another order: a few fp32 ulps of the
largest terms, 2^-23 ~ 1.2e-7 each, over sums of up to a few hundred terms). bf16 autocast to 2e-2
of the largest value (1e-2 for the loss): both sides round the logits and the gradient of the logits
to bf16 (8 significant bits, unit roundoff 2^-9 ~ 2e-3) before their GEMMs, but at different points
(the weight's gradient here is a sum of per-chunk bf16 products added in fp32, the reference one bf16
product), so elements may differ by a few bf16 ulps of the largest terms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.execute.chunked_loss import (CHUNK_LOGITS_BYTES, ChunkedLossError, auto_chunk_tokens, chunked_cross_entropy,
                                  chunked_eval, grads_in_forward)
from runtime.comm import SoloGroup
from runtime.parallel.tensor.layers import ShapeGroup


def _inputs(shape, vocab, c, dtype, *, bias=True, seed=0, valid=None, ignored=0):
    """hidden (*shape, c), weight (vocab, c), bias (vocab,) or None, targets (*shape) in [0, valid)
    with the first `ignored` tokens set to -100; leaf tensors that require grad."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, c, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, c, generator=g, dtype=dtype) / c ** 0.5).requires_grad_()
    b = (torch.randn(vocab, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, valid or vocab, shape, generator=g)
    t.view(-1)[:ignored] = -100
    return h, w, b, t


def _reference(h, w, b, t, valid=None):
    """F.cross_entropy over the whole logits in fp32 (fp64 for fp64), padding rows dropped."""
    logits = h @ w.T + b if b is not None else h @ w.T
    logits = logits[..., :valid] if valid is not None else logits
    wide = logits.double() if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(wide.flatten(0, -2), t.flatten(), ignore_index=-100)


def _grads(loss, tensors, scale=1.0):
    tensors = [x for x in tensors if x is not None]
    return torch.autograd.grad(loss * scale, tensors)


def _close(got, want, rel):
    """|got - want| <= rel * max|want| elementwise (one scale per tensor: the tolerance is relative
    to the tensor's magnitude, not to each element's, which may be near zero)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * max(want.double().abs().max().item(), 1e-30), (err, want.abs().max().item())


# ---- agreement with F.cross_entropy ----------------------------------------------------------------


@pytest.mark.parametrize("vocab,valid,bias,chunk,shape", [
    (7, None, True, 4, (3, 5)),          # 15 tokens, chunks of 4: the last chunk is short
    (7, None, False, 5, (15,)),          # chunks divide the tokens
    (50257, None, True, 3, (2, 3)),      # GPT-2's vocabulary
    (64, 50, True, 6, (4, 3)),           # padded rows: 14 rows of alignment padding
    (9, 7, False, 1, (5,)),              # one token per chunk
    (11, None, True, 0, (2, 4)),         # chunk_tokens = 0: auto_chunk_tokens (one chunk here)
])
def test_fp64_loss_and_gradients_equal_cross_entropy(vocab, valid, bias, chunk, shape):
    h, w, b, t = _inputs(shape, vocab, 8, torch.float64, bias=bias, valid=valid, ignored=2)
    want = _reference(h, w, b, t, valid)
    got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=chunk, vocab_valid=valid)
    assert got.dtype == torch.float64 and got.dim() == 0
    _close(got, want, 1e-10)
    for g, r in zip(_grads(got, (h, w, b), 3.5), _grads(want, (h, w, b), 3.5)):
        _close(g, r, 1e-10)


def test_padding_rows_never_win_the_max_nor_add_to_the_sum():
    # huge padding rows: were they read, the loss would be about 1e4 and the argmax theirs
    h, w, b, t = _inputs((6,), 12, 4, torch.float64, valid=5)
    with torch.no_grad():
        w[5:] = 1e3 * h[0].sign()
        b[5:] = 1e4
    want = _reference(h, w, b, t, 5)
    got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=4, vocab_valid=5)
    _close(got, want, 1e-10)
    gh, gw, gb = _grads(got, (h, w, b))
    assert torch.equal(gw[5:], torch.zeros_like(gw[5:])) and torch.equal(gb[5:], torch.zeros_like(gb[5:]))
    _close(gh, _grads(want, (h,))[0], 1e-10)
    loss, correct, counted = chunked_eval(h, w, t, bias=b, chunk_tokens=4, vocab_valid=5)
    logits = (h @ w.T + b)[:, :5]
    assert correct == int((logits.argmax(-1) == t).sum()) and counted == 6


def test_fp32_agrees_within_fp32_rounding():
    h, w, b, t = _inputs((4, 24), 1000, 32, torch.float32, ignored=5)
    want = _reference(h, w, b, t)
    got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=17)
    assert got.dtype == torch.float32
    _close(got, want, 1e-5)
    for g, r in zip(_grads(got, (h, w, b), 2.0), _grads(want, (h, w, b), 2.0)):
        _close(g, r, 1e-5)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_bf16_autocast_agrees_within_bf16_rounding(param_dtype):
    # fp32 master weights (cast once per call) or bf16 weights; hidden fp32 as a LayerNorm leaves it
    h, w, b, t = _inputs((3, 40), 500, 64, torch.float32, ignored=7)
    w = w.detach().to(param_dtype).requires_grad_()
    b = b.detach().to(param_dtype).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        want = F.cross_entropy((h @ w.T + b).float().flatten(0, -2), t.flatten())
        got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=50)
    assert got.dtype == torch.float32
    _close(got, want, 1e-2)
    grads = _grads(got, (h, w, b), 4.0)
    assert [g.dtype for g in grads] == [torch.float32, param_dtype, param_dtype]
    for g, r in zip(grads, _grads(want, (h, w, b), 4.0)):
        _close(g, r, 2e-2)


@pytest.mark.parametrize("ignored", [3, 19])   # some tokens, all but one of 20
def test_ignore_index_leaves_tokens_out_of_the_mean_and_the_gradients(ignored):
    h, w, b, t = _inputs((20,), 7, 6, torch.float64, ignored=ignored)
    t = t[torch.randperm(20, generator=torch.Generator().manual_seed(1))]   # ignored tokens spread over chunks
    want = F.cross_entropy((h @ w.T + b), t)
    got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=6)
    _close(got, want, 1e-10)
    gh, gw, gb = _grads(got, (h, w, b))
    for g, r in zip((gh, gw, gb), _grads(want, (h, w, b))):
        _close(g, r, 1e-10)
    assert gh[t == -100].abs().max() == 0


def test_other_ignore_index_and_every_token_ignored():
    h, w, b, t = _inputs((8,), 7, 4, torch.float64)
    t[:3] = 0   # class 0 is the ignored one here
    _close(chunked_cross_entropy(h, w, t, bias=b, ignore_index=0, chunk_tokens=3),
           F.cross_entropy(h @ w.T + b, t, ignore_index=0), 1e-10)
    # every token ignored: nan loss and zero gradients, as F.cross_entropy
    t[:] = -100
    got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=3)
    want = F.cross_entropy(h @ w.T + b, t)
    assert torch.isnan(got) and torch.isnan(want)
    assert all(g.abs().max() == 0 for g in _grads(got, (h, w, b)))


# ---- gradients through autograd ------------------------------------------------------------------


def test_micro_batches_accumulate_and_a_tied_weight_adds_both_uses():
    # GPT-2's tying: the embedding and the output layer share one weight; two micro-batches, each
    # with its own forward and backward (scaled by 1/2), gradients accumulated in .grad
    vocab, c = 13, 8
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(vocab, c, generator=g, dtype=torch.float64)
    norm = torch.nn.LayerNorm(c, dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, 3, 5), generator=g)
    targets = torch.randint(0, vocab, (2, 3, 5), generator=g)

    def run(loss_fn):
        w = w0.clone().requires_grad_()
        norm.zero_grad()
        for m in range(2):
            hidden = norm(F.embedding(ids[m], w) * 1.5)
            (loss_fn(hidden, w, targets[m]) / 2).backward()
        return w.grad, norm.weight.grad

    want = run(lambda h, w, t: F.cross_entropy((h @ w.T).flatten(0, -2), t.flatten()))
    got = run(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_tokens=4))
    for a, b in zip(got, want):
        _close(a, b, 1e-10)


def test_frozen_weight_and_hidden_only_gradients():
    h, w, b, t = _inputs((10,), 9, 4, torch.float64)
    w.requires_grad_(False)
    got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=3)
    want = _reference(h, w, b, t)
    for g, r in zip(_grads(got, (h, b)), _grads(want, (h, b))):
        _close(g, r, 1e-10)


def test_a_second_backward_through_one_graph_is_refused_by_name():
    h, w, b, t = _inputs((6,), 7, 4, torch.float32)
    loss = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=4)
    loss.backward(retain_graph=True)
    with pytest.raises(ChunkedLossError, match="backward ran twice"):
        loss.backward()


def test_without_grad_no_graph_is_built_and_the_loss_is_the_same():
    h, w, b, t = _inputs((2, 9), 7, 4, torch.float64)
    with torch.no_grad():
        got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=4)
        want = _reference(h, w, b, t)
    assert got.grad_fn is None
    _close(got, want, 1e-10)


def test_a_group_of_one_communicates_nothing_and_forms_gradients_in_forward():
    h, w, b, t = _inputs((3, 4), 7, 4, torch.float64)
    assert grads_in_forward(None) and grads_in_forward(SoloGroup(0)) and not grads_in_forward(ShapeGroup(2))
    got = chunked_cross_entropy(h, w, t, bias=b, group=SoloGroup(0), chunk_tokens=5)
    _close(got, _reference(h, w, b, t), 1e-10)
    for g, r in zip(_grads(got, (h, w, b)), _grads(_reference(h, w, b, t), (h, w, b))):
        _close(g, r, 1e-10)


# ---- evaluation -----------------------------------------------------------------------------------


def test_eval_counts_argmax_hits_with_the_lowest_index_among_ties():
    h, w, b, t = _inputs((24,), 10, 5, torch.float64, bias=False, ignored=4)
    with torch.no_grad():
        w[7] = w[3]     # classes 3 and 7 tie everywhere: argmax says 3
    logits = h @ w.T
    pred = logits.argmax(-1)
    t[4:8] = torch.where(pred[4:8] == 3, 7, pred[4:8])    # a target of 7 where 3 wins is a miss
    t[8:12] = pred[8:12]                                   # hits
    keep = t != -100
    loss, correct, counted = chunked_eval(h, w, t, chunk_tokens=7)
    _close(loss, F.cross_entropy(logits, t), 1e-10)
    assert (correct, counted) == (int(((pred == t) & keep).sum()), int(keep.sum()))
    assert correct >= 4 and counted == 20


# ---- memory ----------------------------------------------------------------------------------------


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op creates while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_no_tensor_of_the_whole_logits_is_ever_created(autocast):
    tokens, vocab, c, chunk = 96, 1000, 16, 24
    h, w, b, t = _inputs((tokens,), vocab, c, torch.float32, ignored=5)
    with _Largest() as seen, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=chunk)
    with seen:
        loss.backward()
    # the largest: a chunk's logits, or the weight (its gradient, its cast); never tokens x vocab
    assert seen.largest == max(chunk * vocab, vocab * c) <= tokens * vocab // 4
    with _Largest() as ref:
        (h @ w.T + b).float().sum().backward()
    assert ref.largest == tokens * vocab   # the counter does see a whole-logits tensor when there is one


def test_auto_chunk_keeps_a_chunks_fp32_logits_within_the_budget():
    assert CHUNK_LOGITS_BYTES == 256 * 2 ** 20
    assert auto_chunk_tokens(1000, 50304) == 1000                  # fits in one chunk
    assert auto_chunk_tokens(16384, 50304) == 1280                 # 13 chunks of <= 1334 rows, aligned to 64
    assert auto_chunk_tokens(2048, 50304) == 1024                  # two equal chunks
    assert auto_chunk_tokens(100, 10, budget_bytes=400) == 10      # budget of 10 rows: no alignment below 64
    for tokens, vocab in [(16384, 50304), (2048, 50257), (8192, 128256), (10**6, 7), (5, 10**9)]:
        rows = auto_chunk_tokens(tokens, vocab)
        assert 1 <= rows <= tokens and (rows * vocab * 4 <= CHUNK_LOGITS_BYTES or rows == 1)


# ---- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("change,match", [
    (dict(targets=torch.zeros(4, dtype=torch.long)), "targets"),
    (dict(targets=torch.zeros(2, 3)), "integer"),
    (dict(weight=torch.randn(7, 5)), "weight"),
    (dict(bias=torch.randn(6)), "bias"),
    (dict(chunk_tokens=-1), "chunk_tokens"),
    (dict(vocab_valid=8), "vocab_valid"),
    (dict(vocab_valid=0), "vocab_valid"),
    (dict(vocab_start=-1), "vocab_start"),
])
def test_bad_arguments_are_refused_by_name(change, match):
    args = dict(hidden=torch.randn(2, 3, 4), weight=torch.randn(7, 4), targets=torch.zeros(2, 3, dtype=torch.long),
                bias=None, chunk_tokens=0, vocab_valid=None, vocab_start=0)
    args.update(change)
    with pytest.raises(ChunkedLossError, match=match):
        chunked_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)
    assert issubclass(ChunkedLossError, ValueError)
