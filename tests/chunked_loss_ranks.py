"""One rank of the vocabulary-parallel chunked cross-entropy test (tests/distributed/test_chunked_loss_ranks.py
launches `world` of them): every rank builds the same whole-vocabulary inputs from one seed, holds its
block of the vocabulary rows (padded as tensor parallelism pads them), and checks
runtime.execute.chunked_loss against F.cross_entropy over the whole logits computed on the rank itself:
the loss, hidden's whole gradient, its block of the weight's and bias's gradients (zero on padding
rows), the evaluation's counts, and how many collectives each call issues.

    python -m tests.chunked_loss_ranks     (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from runtime.execute.chunked_loss import chunked_cross_entropy, chunked_eval
from runtime.comm.torch_dist import TorchCommunicator
from runtime.parallel.tensor.layers import vocab_parallel_embedding

FP64, BF16 = 1e-10, 2e-2   # tolerances relative to the largest value (tests/unit/test_chunked_loss.py says why)


class Counting:
    """A group that counts the collectives issued through it."""

    def __init__(self, group):
        self.group, self.calls = group, []

    @property
    def size(self):
        return self.group.size

    @property
    def rank(self):
        return self.group.rank

    def all_gather(self, output, tensor, async_op=False):
        self.calls.append("all_gather")
        return self.group.all_gather(output, tensor, async_op)

    def all_reduce(self, tensor, op="sum", async_op=False):
        self.calls.append("all_reduce")
        return self.group.all_reduce(tensor, op, async_op)

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def close(got, want, rel, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if want.numel() == 0:
        return
    err = (got.double() - want.double()).abs().max().item()
    scale = max(want.double().abs().max().item(), 1e-30)
    assert err <= rel * scale, f"{what}: error {err:.3g} of scale {scale:.3g}"


def block(vocab: int, padded: int, rank: int, world: int) -> tuple[int, int, int]:
    """(first class, rows held, real classes among them) of `rank`: the vocabulary padded to `padded`
    rows, split in equal contiguous blocks."""
    rows = padded // world
    start = rank * rows
    return start, rows, max(0, min(vocab - start, rows))


def whole(vocab, padded, c, tokens, dtype, seed, ignored):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*tokens, c, generator=g, dtype=torch.float64)
    w = torch.randn(padded, c, generator=g, dtype=torch.float64) / c ** 0.5
    w[vocab:] = 1e3   # padding rows that would dominate were they read
    b = torch.randn(padded, generator=g, dtype=torch.float64) * 0.1
    t = torch.randint(0, vocab, tokens, generator=g)
    t.view(-1)[torch.randperm(t.numel(), generator=g)[:ignored]] = -100
    return h.to(dtype), w.to(dtype), b.to(dtype), t


def check_loss(group: Counting, rank, world, *, vocab, padded, c=6, tokens=(3, 5), dtype=torch.float64,
               autocast=False, chunk=4, ignored=3, scale=2.5):
    h, w, b, t = whole(vocab, padded, c, tokens, dtype, seed=vocab + padded, ignored=ignored)
    start, rows, valid = block(vocab, padded, rank, world)
    hr, wr, br = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    mine = [w[start:start + rows].clone().requires_grad_(), b[start:start + rows].clone().requires_grad_()]
    hm = h.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = hr @ wr[:vocab].T + br[:vocab]
        want = F.cross_entropy((logits if dtype == torch.float64 else logits.float()).flatten(0, -2), t.flatten())
        got = chunked_cross_entropy(hm, mine[0], t, bias=mine[1], chunk_tokens=chunk, vocab_start=start,
                                    vocab_valid=valid, group=group)
    assert group.take() == ["all_gather"], "forward: one all_gather per call"
    rel = BF16 if autocast else FP64
    close(got, want, rel / 2, "loss")
    (got * scale).backward()
    assert group.take() == ["all_reduce"], "backward: one all_reduce (hidden's gradient) per call"
    (want * scale).backward()
    close(hm.grad, hr.grad, rel, "grad hidden")
    close(mine[0].grad[:valid], wr.grad[start:start + valid], rel, "grad weight")
    close(mine[1].grad[:valid], br.grad[start:start + valid], rel, "grad bias")
    assert not mine[0].grad[valid:].any() and not mine[1].grad[valid:].any(), "padding rows' gradient is zero"

    loss, correct, counted = chunked_eval(h, w[start:start + rows], t, bias=b[start:start + rows], chunk_tokens=chunk,
                                          vocab_start=start, vocab_valid=valid, group=group)
    assert group.take() == ["all_gather"], "evaluation: one all_gather per call"
    logits = (h @ w[:vocab].T + b[:vocab]).double()
    keep = t != -100
    close(loss, F.cross_entropy(logits.flatten(0, -2), t.flatten()).to(loss.dtype), rel, "eval loss")
    if not autocast:
        assert (correct, counted) == (int(((logits.argmax(-1) == t) & keep).sum()), int(keep.sum()))


def check_eval_ties_across_ranks(group: Counting, rank, world):
    # class 5 (rank 1's) copies class 1 (rank 0's): the argmax is 1, the lowest index, as torch.argmax
    h, w, b, t = whole(8, 8, 4, (30,), torch.float64, seed=3, ignored=0)
    w[5], b[5] = w[1], b[1]
    logits = h @ w.T + b
    pred = logits.argmax(-1)
    t[2:12] = torch.where(pred[2:12] == 1, 5, pred[2:12])   # misses where class 1 wins, else hits
    t[:2] = -100
    start, rows, valid = block(8, 8, rank, world)
    _, correct, counted = chunked_eval(h, w[start:start + rows], t, bias=b[start:start + rows], chunk_tokens=7,
                                       vocab_start=start, vocab_valid=valid, group=group)
    group.take()
    assert int((pred[2:12] == 1).sum()) > 0, "the case needs tokens where the tied classes win"
    assert (correct, counted) == (int(((pred == t) & (t != -100)).sum()), 28), (correct, counted)


def check_tied_embedding(group: Counting, rank, world):
    # GPT-2's tying under vocabulary parallelism: one weight block serves the embedding (its lookups
    # all-reduced) and the loss; two micro-batches, each backward scaled by 1/2, accumulate
    vocab, c = 11, 8
    _, w, _, _ = whole(vocab, 12, c, (1,), torch.float64, seed=5, ignored=0)
    w[vocab:] = 0
    g = torch.Generator().manual_seed(6)
    ids, targets = torch.randint(0, vocab, (2, 3, 4), generator=g), torch.randint(0, vocab, (2, 3, 4), generator=g)
    start, rows, valid = block(vocab, 12, rank, world)

    def run(loss_fn, weight):
        weight = weight.clone().requires_grad_()
        norm = torch.nn.LayerNorm(c, dtype=torch.float64)
        for m in range(2):
            (loss_fn(norm(loss_fn.embed(ids[m], weight) * 2.0), weight, targets[m]) / 2).backward()
        return weight.grad, norm.weight.grad

    def reference(hh, ww, tt):
        return F.cross_entropy((hh @ ww[:vocab].T).flatten(0, -2), tt.flatten())
    reference.embed = lambda i, ww: F.embedding(i, ww)

    def chunked(hh, ww, tt):
        return chunked_cross_entropy(hh, ww, tt, chunk_tokens=5, vocab_start=start, vocab_valid=valid, group=group)
    chunked.embed = lambda i, ww: vocab_parallel_embedding(i, ww, group.group)

    gw_ref, gn_ref = run(reference, w)
    gw, gn = run(chunked, w[start:start + rows])
    close(gw[:valid], gw_ref[start:start + valid], FP64, "tied weight's gradient")
    close(gn, gn_ref, FP64, "norm's gradient (through hidden's)")


def main() -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm = TorchCommunicator("gloo", rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=60)
    try:
        group = Counting(comm.group(tuple(range(world))))
        check_loss(group, rank, world, vocab=7, padded=8)                    # vocabulary the ranks do not divide
        check_loss(group, rank, world, vocab=7, padded=16, chunk=15)         # aligned: the last rank holds padding alone
        check_loss(group, rank, world, vocab=50, padded=64, c=32, tokens=(2, 20), dtype=torch.float32,
                   autocast=True, chunk=9, ignored=6)                       # bf16 autocast, fp32 master weights
        check_eval_ties_across_ranks(group, rank, world)
        check_tied_embedding(group, rank, world)
        comm.barrier()
    finally:
        comm.shutdown()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
