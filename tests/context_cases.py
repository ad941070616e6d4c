"""Context-parallel attention cases on real processes, and their single-process reference.

A case is random q, k, v and an output gradient of full sequences (fixed seed); every rank takes its
layout's tokens, runs runtime.parallel.context.attention forward and backward, and saves its output and the
gradients of its q, k, v. The reference is full-sequence scaled_dot_product_attention on one process;
its rows in each rank's layout order are what that rank must hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

BATCH, HEADS, HEAD_DIM = 2, 4, 8


@dataclass(frozen=True)
class Case:
    mode: str
    causal: bool
    seq_len: int
    kv_heads: int = HEADS

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.mode}_{mask}_t{self.seq_len}_kv{self.kv_heads}"


def inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """q (B, H, T, D), k, v (B, H_kv, T, D) and the output gradient (B, H, T, D), full sequences."""
    g = torch.Generator().manual_seed(case.seq_len * 100 + case.kv_heads)
    shape, kv_shape = (BATCH, HEADS, case.seq_len, HEAD_DIM), (BATCH, case.kv_heads, case.seq_len, HEAD_DIM)
    return (torch.randn(shape, generator=g), torch.randn(kv_shape, generator=g),
            torch.randn(kv_shape, generator=g), torch.randn(shape, generator=g))


def reference(case: Case) -> dict[str, torch.Tensor]:
    """Full-sequence attention on one process: output and gradients of q, k, v (full sequences)."""
    q, k, v, dout = inputs(case)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=case.kv_heads != HEADS)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_rank(rank: int, world: int, port: int, cases: list[Case], out: str) -> None:
    """One rank: every case in turn; writes out/<case>_rank<r>.pt (its output and q, k, v gradients)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from runtime.comm.torch_dist import TorchCommunicator
    from runtime.parallel.context.attention import chunk_layout, context_attention

    comm = TorchCommunicator("gloo", rank, world, "127.0.0.1", port, timeout=60)
    try:
        group = comm.group(range(world))
        for case in cases:
            layout = chunk_layout(case.seq_len, world, rank)
            q, k, v, dout = (layout.take(x, 2) for x in inputs(case))
            q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
            got = context_attention(q, k, v, group, layout, causal=case.causal, mode=case.mode)
            got.backward(dout)
            torch.save({"out": got.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
                       Path(out) / f"{case.name}_rank{rank}.pt")
    finally:
        comm.shutdown()


def run_cases(cases: list[Case], world: int, out: Path) -> dict[str, list[dict]]:
    """Run `cases` on `world` spawned processes; per case, every rank's saved result."""
    import torch.multiprocessing as mp

    from runtime.launch.launcher import free_port

    mp.start_processes(run_rank, args=(world, free_port(), cases, str(out)), nprocs=world, join=True,
                       start_method="spawn")
    return {c.name: [torch.load(out / f"{c.name}_rank{r}.pt") for r in range(world)] for c in cases}
