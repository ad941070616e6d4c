"""Context-parallel attention on CPU ranks (gloo): forward + backward time of ring, Ulysses and
all-gather-KV attention against full-sequence attention, at one moderate size.

Each degree runs in its own set of processes (one thread each). Every round times each method
once, in turn (the order rotates per round, so the machine's drifting load hits all alike); a
method's time is the slowest rank's, the figure is the median over rounds. "full" is
scaled_dot_product_attention over the whole sequence on every rank at once (what one rank does
without context parallelism); "allgather" gathers every rank's keys and values and attends to
them with a positional causal mask (its backward reduce-scatters their gradients). The last
column is each method's time over full's.

    python benchmarks/context_attention.py [--seq 2048] [--heads 8] [--head-dim 64] [--batch 1]
                                           [--rounds 7] [--degrees 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("full", "ring", "ulysses", "allgather")


class _AllGatherSeq(torch.autograd.Function):
    """(B, H, T_local, D) -> (B, H, degree * T_local, D): every member's tokens, members in order;
    the backward reduce-scatters the gradient back to each member's tokens."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty((group.size, *x.shape), dtype=x.dtype)
        group.all_gather(out.view(-1), x.contiguous().view(-1))
        return out.permute(1, 2, 0, 3, 4).flatten(2, 3)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        b, h, t, d = grad.shape
        parts = grad.reshape(b, h, group.size, t // group.size, d).permute(2, 0, 1, 3, 4).contiguous()
        out = torch.empty(parts.shape[1:], dtype=grad.dtype)
        group.reduce_scatter(out.view(-1), parts.view(-1))
        return out, None


def allgather_attention(q, k, v, group, layout):
    """Causal attention of this rank's queries over all keys, gathered to every rank."""
    from runtime.parallel.context.layout import sequence_order

    to_positions = torch.argsort(sequence_order(layout.seq_len, layout.degree))
    kf, vf = (_AllGatherSeq.apply(x, group).index_select(2, to_positions) for x in (k, v))
    mask = layout.positions()[:, None] >= torch.arange(layout.seq_len)[None, :]
    return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask)


def _worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from runtime.comm.torch_dist import TorchCommunicator
    from runtime.parallel.context.attention import chunk_layout, context_attention

    comm = TorchCommunicator("gloo", rank, world, "127.0.0.1", port, timeout=300)
    try:
        group = comm.group(range(world))
        layout = chunk_layout(args.seq, world, rank)
        g = torch.Generator().manual_seed(rank)
        full_shape = (args.batch, args.heads, args.seq, args.head_dim)
        local_shape = (args.batch, args.heads, layout.local_len, args.head_dim)

        def run(method: str) -> float:
            shape = full_shape if method == "full" else local_shape
            q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
            dout = torch.randn(shape, generator=g)
            comm.barrier()
            t0 = time.perf_counter()
            if method == "full":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif method == "allgather":
                out = allgather_attention(q, k, v, group, layout)
            else:
                out = context_attention(q, k, v, group, layout, causal=True, mode=method)
            out.backward(dout)
            took = torch.tensor([time.perf_counter() - t0])
            group.all_reduce(took, "max")
            return float(took)

        for method in METHODS:  # warm-up
            run(method)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for r in range(args.rounds):
            for method in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
                times[method].append(run(method))
        if rank == 0:
            results.update({m: statistics.median(ts) for m, ts in times.items()})
    finally:
        comm.shutdown()


def measure(world: int, args) -> dict[str, float]:
    """Median seconds per method (forward + backward, slowest rank) on `world` processes."""
    import torch.multiprocessing as mp

    from runtime.launch.launcher import free_port

    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(world, free_port(), args, results), nprocs=world, join=True,
                           start_method="spawn")
        return dict(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    print(f"causal attention, B={args.batch} H={args.heads} T={args.seq} D={args.head_dim}, fp32, "
          f"forward + backward, median of {args.rounds} rounds (slowest rank)")
    print(f"{'degree':>6} " + " ".join(f"{m + ' ms':>13}" for m in METHODS) + "   "
          + " ".join(f"{m + '/full':>14}" for m in METHODS[1:]))
    for world in args.degrees:
        t = measure(world, args)
        print(f"{world:>6} " + " ".join(f"{t[m] * 1e3:>13.1f}" for m in METHODS) + "   "
              + " ".join(f"{t[m] / t['full']:>14.2f}" for m in METHODS[1:]), flush=True)


if __name__ == "__main__":
    main()
