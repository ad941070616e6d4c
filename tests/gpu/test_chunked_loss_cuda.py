"""runtime/execute/chunked_loss.py on CUDA: agreement with F.cross_entropy over the whole logits (fp32, and bf16
autocast with fp32 master weights; tolerances as tests/unit/test_chunked_loss.py states them) and the
peak of allocated memory during forward + backward, which stays far below the whole fp32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.execute.chunked_loss import auto_chunk_tokens, chunked_cross_entropy


def _inputs(tokens, vocab, c, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(tokens, c, generator=g, device="cuda").requires_grad_()
    w = (torch.randn(vocab, c, generator=g, device="cuda") / c ** 0.5).requires_grad_()
    b = (torch.randn(vocab, generator=g, device="cuda") * 0.1).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g, device="cuda")
    t[:17] = -100
    return h, w, b, t


def _close(got, want, rel):
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * want.double().abs().max().item(), err


@pytest.mark.parametrize("autocast,rel", [(False, 1e-5), (True, 2e-2)])
def test_cuda_agrees_with_cross_entropy(autocast, rel):
    h, w, b, t = _inputs(1000, 50257, 128)
    # TF32 off: the fp32 comparison is of fp32 GEMMs on both sides
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            want = F.cross_entropy((h @ w.T + b).float(), t)
            got = chunked_cross_entropy(h, w, t, bias=b, chunk_tokens=300)
        _close(got, want, rel / 2)
        for g, r in zip(torch.autograd.grad(got * 3, (h, w, b)), torch.autograd.grad(want * 3, (h, w, b))):
            assert g.dtype == r.dtype
            _close(g, r, rel)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_cuda_peak_memory_stays_far_below_the_whole_logits():
    tokens, vocab, c = 8192, 50304, 256
    h, w, _, t = _inputs(tokens, vocab, c)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", torch.bfloat16):
        loss = chunked_cross_entropy(h, w, t)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    rows = auto_chunk_tokens(tokens, vocab)
    # a chunk (fp32 logits + a bf16 copy: 6 bytes a logit), the fp32 weight gradient, its bf16 product
    # and the weight's bf16 cast, hidden's gradient; never tokens x vocabulary
    bound = rows * vocab * 6 + vocab * c * (4 + 2 + 2 + 4) + tokens * c * 4 * 2
    assert peak <= bound < tokens * vocab * 4 // 2, (peak, bound)
