"""Ring attention over a context-parallel group (runtime/parallel/context/attention.py is the entry point).

Key/value blocks pass around the group's ring, one step per member (Liu, Zaharia and Abbeel,
"Ring Attention with Blockwise Transformers", 2023); each step's attention is computed blockwise
while the next block is in flight, and the blocks' results are merged by their log-sum-exp (the
online softmax of flash attention, Dao et al. 2022). The tokens are in the causal load-balanced
order (runtime/parallel/context/layout.py), and the work is cut by chunk pairs: a query chunk attends to
an earlier key chunk in full, to its own chunk with the causal triangle, and skips later ones.

The backward recomputes each block's probabilities from the saved log-sum-exp of the whole row
and passes the key/value gradients around the ring behind their blocks, so that after the last
step each block's gradient, summed over every rank's queries, is back with its owner.

A block is computed by a fused kernel where torch has one that returns the log-sum-exp on the
device (CPU: the flash attention kernel of scaled_dot_product_attention), otherwise by plain
matmul and softmax in fp32, cut along the query rows so that its scores stay within
SCORE_ELEMENTS. Results accumulate in fp32.
"""

from __future__ import annotations

import torch

from runtime.comm import Group
from runtime.parallel.context.layout import ContextLayout, chunk_layout

# Point-to-point tags of the ring's messages: above every pipeline tag (runtime.comm.p2p_tag
# stays below 2**29) and below the MPI communicator's abort tags.
RING_TAG = 1 << 29
_FWD_KV, _BWD_KV, _BWD_DKV = RING_TAG, RING_TAG + 1, RING_TAG + 2
# The most attention scores (fp32 elements: batch x heads x query rows x keys) one block of the
# matmul kernel holds at once (64 MiB); longer blocks are cut along their query rows.
SCORE_ELEMENTS = 1 << 24

Task = tuple[slice, slice, bool]          # (query rows, key rows, causal triangle?)
Tile = tuple[slice, slice, "int | None"]  # (query rows, key rows, causal diagonal offset or None)


def _tasks(q_chunks: tuple[int, int], kv_chunks: tuple[int, int], chunk: int, causal: bool) -> list[Task]:
    """The blocks one ring step computes, in local offsets, for this rank's query chunks against
    the key/value chunks it holds (chunk ids in 0 .. 2 * degree - 1). Fully masked pairs are left
    out; neighbouring query chunks that see the same keys in full are one block."""
    if not causal:
        return [(slice(0, 2 * chunk), slice(0, 2 * chunk), False)]
    tasks: list[Task] = []
    for i, a in enumerate(q_chunks):
        rows = slice(i * chunk, (i + 1) * chunk)
        full = [j for j, b in enumerate(kv_chunks) if b < a]
        if full:
            keys = slice(full[0] * chunk, (full[-1] + 1) * chunk)
            last = tasks[-1] if tasks else None
            if last is not None and not last[2] and last[1] == keys and last[0].stop == rows.start:
                tasks[-1] = (slice(last[0].start, rows.stop), keys, False)
            else:
                tasks.append((rows, keys, False))
        tasks += [(rows, slice(j * chunk, (j + 1) * chunk), True) for j, b in enumerate(kv_chunks) if b == a]
    return tasks


def _tiles(tasks: list[Task], batch_heads: int, limit: int | None) -> list[Tile]:
    """The tasks cut along their query rows so that a block's scores (batch_heads x rows x keys)
    stay within `limit` elements (None: not cut). For a causal block, query row i of a tile sees
    keys up to i + offset (the tile starts `offset` rows into the chunk its keys are)."""
    out: list[Tile] = []
    for rows, keys, triangle in tasks:
        step = rows.stop - rows.start if limit is None else max(1, limit // (batch_heads * (keys.stop - keys.start)))
        for start in range(rows.start, rows.stop, step):
            out.append((slice(start, min(start + step, rows.stop)), keys, start - rows.start if triangle else None))
    return out


def _widen(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to `heads` query heads (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _narrow_heads(g: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of _widen: the query-head gradient summed over each key head's group."""
    if g.shape[1] == heads:
        return g
    b, h, t, d = g.shape
    return g.view(b, heads, h // heads, t, d).sum(2)


# ---------------------------------------------------------------------------
# block kernels: q (B, H, rows, D), k, v (B, H, keys, D) -> out (B, H, rows, D) fp32 and lse
# (B, H, rows) fp32; backward from the whole row's output and lse -> dq, dk, dv fp32.


class MatmulBlocks:
    """Any device: scores, softmax and products in fp32 (tiles of at most SCORE_ELEMENTS scores)."""

    @staticmethod
    def score_limit() -> int | None:
        return SCORE_ELEMENTS

    @staticmethod
    def _scores(q, k, scale: float, diagonal: int | None) -> torch.Tensor:
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if diagonal is not None:
            hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + diagonal)
            s = s.masked_fill(hidden, float("-inf"))
        return s

    @classmethod
    def forward(cls, q, k, v, scale: float, diagonal: int | None):
        s = cls._scores(q, k, scale, diagonal)
        lse = torch.logsumexp(s, dim=-1)
        return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, scale: float, diagonal: int | None):
        do = dout.float()
        p = torch.exp(cls._scores(q, k, scale, diagonal) - lse.unsqueeze(-1))
        delta = (do * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O) of the softmax backward
        ds = p * (torch.matmul(do, v.float().transpose(-1, -2)) - delta)
        return (torch.matmul(ds, k.float()) * scale, torch.matmul(ds.transpose(-1, -2), q.float()) * scale,
                torch.matmul(p.transpose(-1, -2), do))


class CpuFlashBlocks:
    """CPU: scaled_dot_product_attention's flash kernel, which returns the log-sum-exp and takes
    the whole row's output and log-sum-exp in its backward. Blocks are never cut (the kernel
    does not hold the scores), so a causal block is always a whole chunk against itself."""

    @staticmethod
    def score_limit() -> int | None:
        return None

    @staticmethod
    def forward(q, k, v, scale: float, diagonal: int | None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, diagonal is not None, scale=scale)
        return out.float(), lse.float()

    @staticmethod
    def backward(dout, q, k, v, out, lse, scale: float, diagonal: int | None):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
            0.0, diagonal is not None, scale=scale)
        return tuple(g.float() for g in grads)


def block_kernels(device: torch.device):
    """The block kernels for tensors on `device`."""
    return CpuFlashBlocks if device.type == "cpu" else MatmulBlocks


# ---------------------------------------------------------------------------


def _ring(kv: torch.Tensor, group: Group, layout: ContextLayout, causal: bool, heads: int, tag: int,
          limit: int | None):
    """Per ring step: the key/value block this rank holds (from member rank - step), widened to
    `heads` heads, and the tiles of it to compute (_tiles). The next step's block is in flight to
    this rank while the caller computes; it passes the block on after the caller's work of the step."""
    degree, me = group.size, group.rank
    batch_heads = kv.shape[1] * heads
    for step in range(degree):
        if step < degree - 1:
            incoming = torch.empty_like(kv)
            handle = group.send_recv(kv, (me + 1) % degree, incoming, (me - 1) % degree, tag)
        src = chunk_layout(layout.seq_len, degree, (me - step) % degree)
        tiles = _tiles(_tasks(layout.chunks, src.chunks, layout.chunk_len, causal), batch_heads, limit)
        yield _widen(kv[0], heads), _widen(kv[1], heads), tiles
        if step < degree - 1:
            handle.wait()
            kv = incoming


class RingAttention(torch.autograd.Function):
    """RingAttention.apply(q, k, v, group, layout, causal, scale) -> (B, H, T_local, D): q (B, H,
    T_local, D), k, v (B, H_kv, T_local, D), this rank's tokens in layout order."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, scale):
        kernels = block_kernels(q.device)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for kb, vb, tiles in _ring(torch.stack([k, v]).contiguous(), group, layout, causal, q.shape[1], _FWD_KV,
                                   kernels.score_limit()):
            for rows, keys, diagonal in tiles:
                block_out, block_lse = kernels.forward(q[:, :, rows], kb[:, :, keys], vb[:, :, keys], scale, diagonal)
                new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new_lse).unsqueeze(-1)
                                   + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
                lse[:, :, rows] = new_lse
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.scale = group, layout, causal, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        degree, me = group.size, group.rank
        kernels = block_kernels(q.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        arriving = None  # the key/value gradient of this step's block, accumulated by the ranks before
        dkv_handle = None  # the send/receive of `arriving`, in flight while the next block computes
        for kb, vb, tiles in _ring(torch.stack([k, v]).contiguous(), group, ctx.layout, ctx.causal, q.shape[1],
                                   _BWD_KV, kernels.score_limit()):
            dk = torch.zeros(kb.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros_like(dk)
            for rows, keys, diagonal in tiles:
                dq_b, dk_b, dv_b = kernels.backward(dout[:, :, rows], q[:, :, rows], kb[:, :, keys], vb[:, :, keys],
                                                    out[:, :, rows], lse[:, :, rows], scale, diagonal)
                dq[:, :, rows] += dq_b
                dk[:, :, keys] += dk_b
                dv[:, :, keys] += dv_b
            dkv = torch.stack([_narrow_heads(dk, k.shape[1]), _narrow_heads(dv, v.shape[1])])
            if arriving is not None:
                dkv_handle.wait()
                dkv += arriving
            arriving = torch.empty_like(dkv)
            # to the next rank, which holds this block next; the last send returns it to its owner
            dkv_handle = group.send_recv(dkv, (me + 1) % degree, arriving, (me - 1) % degree, _BWD_DKV)
        dkv_handle.wait()
        return dq.to(q.dtype), arriving[0].to(k.dtype), arriving[1].to(v.dtype), None, None, None, None
