"""runtime/losses.compiled_loss on CUDA (inductor, Triton kernels): agreement with the eager loss over bf16
logits (the loss in fp32, the gradient in bf16), the memory its forward keeps and its backward holds as
cost_models/step_costs.compiled_loss_cost prices them (the logits themselves, two fp32 values a row, the
bf16 gradient; no fp32 copy). Its time against the eager loss's: benchmarks/chunked_loss.py."""

from __future__ import annotations

import torch

from runtime.losses import compiled_loss, compute_loss

TOKENS, VOCAB = 8192, 50304


def _logits(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = (torch.randn(TOKENS, VOCAB, generator=g, device="cuda") * 3).bfloat16().requires_grad_()
    t = torch.randint(0, VOCAB, (TOKENS,), generator=g, device="cuda")
    t[:17] = -100
    return z, t


def _eager(z, t):
    return compute_loss("cross_entropy", z, t)


def _run(fn, z, t):
    """(loss, gradient, bytes kept from forward to backward, peak bytes over both) beyond the logits."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", torch.bfloat16):
        loss = fn(z, t)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    (grad,) = torch.autograd.grad(loss, (z,))
    torch.cuda.synchronize()
    return loss.detach(), grad, kept, torch.cuda.max_memory_allocated() - base


def test_compiled_loss_agrees_and_holds_no_fp32_copy_of_the_logits():
    z, t = _logits()
    fn = compiled_loss("cross_entropy", "inductor")
    _run(fn, z, t)   # compiles
    loss, grad, kept, peak = _run(fn, z, t)
    want, want_grad, eager_kept, eager_peak = _run(_eager, z, t)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert (grad.float() - want_grad.float()).abs().max().item() <= 1e-2 * want_grad.float().abs().max().item()
    e = TOKENS * VOCAB
    # forward keeps a few fp32 values a row (the logits are the caller's); the eager loss fp32 log-probabilities
    assert kept <= 64 * TOKENS + 2**20 and eager_kept >= 4 * e
    # backward holds the bf16 gradient beside them; the eager one two fp32 tensors of the logits' size more
    assert peak <= 2 * e + 64 * TOKENS + 2**21 < eager_peak / 3, (peak, eager_peak)
