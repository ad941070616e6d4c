"""Attention over a sequence split across context-parallel ranks (runtime/context_layout.py).

Each rank holds q, k, v (B, H, T_local, D) for its tokens, in its layout order, and gets the
rows of full-sequence attention for those tokens.

RING (ring attention, Liu et al. 2023; the causal load-balanced order of Megatron-LM's context
parallelism): key/value blocks pass around the group's ring, one step per rank; each step's
attention is computed blockwise while the next block is in flight, and the blocks are merged by
their log-sum-exp (the online softmax of flash attention). Under a causal mask the work is cut by
chunk pairs: a query chunk attends to an earlier key chunk in full, to its own chunk with the
causal triangle, and skips later ones. The backward recomputes each block's probabilities from
the saved log-sum-exp and passes the key/value gradients around the ring with their blocks.

ULYSSES (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns the sequence split into a
head split (every rank then holds the whole sequence for H / degree heads), ordinary attention
runs on it in position order, and the inverse all-to-all brings the output back.

Grouped-query attention (k, v with H_kv heads, H % H_kv == 0, query head h using key head
h // (H / H_kv)): the ring sends the H_kv-head blocks and widens them per block; Ulysses splits
the key heads over the ranks when H_kv % degree == 0, and otherwise repeats them to H heads first.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runtime.comm import Group
from runtime.context_layout import ContextLayout, chunk_layout, sequence_order
from runtime.vocab import ContextAttention

__all__ = ["ContextAttentionError", "ContextLayout", "chunk_layout", "context_attention"]

# Point-to-point tags of the ring's messages: above every pipeline tag (runtime.comm.p2p_tag
# stays below 2**29) and below the MPI communicator's abort tags.
RING_TAG = 1 << 29
_FWD_KV, _BWD_KV, _BWD_DKV = RING_TAG, RING_TAG + 1, RING_TAG + 2


class ContextAttentionError(ValueError):
    """Context-parallel attention cannot run with the inputs or options given."""


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, layout: ContextLayout, *,
                      causal: bool, mode: str, scale: float | None = None, attn_mask=None,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of this rank's queries over every rank's keys and values.

    q: (B, H, T_local, D); k, v: (B, H_kv, T_local, D) with H % H_kv == 0; T_local =
    layout.local_len, tokens in layout order. `group`: the context-parallel ranks (member i is
    layout rank i). `mode`: "ring" or "ulysses" (runtime.vocab.ContextAttention). `scale`:
    1 / sqrt(D) when None. Returns (B, H, T_local, D): the rows of full-sequence
    scaled_dot_product_attention(is_causal=causal) for this rank's tokens.
    """
    mode = _check(q, k, v, group, layout, mode, attn_mask, dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if group.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if mode == ContextAttention.RING:
        return _RingAttention.apply(q, k, v, group, layout, causal, scale)
    return _ulysses(q, k, v, group, layout, causal, scale)


def _check(q, k, v, group: Group, layout: ContextLayout, mode: str, attn_mask, dropout_p: float) -> ContextAttention:
    try:
        mode = ContextAttention(mode)
    except ValueError:
        raise ContextAttentionError(f"unknown context attention mode {mode!r}; known: "
                                    f"{', '.join(m.value for m in ContextAttention)}") from None
    if attn_mask is not None:
        raise ContextAttentionError("context-parallel attention takes no explicit attn_mask; pass causal=True for "
                                    "a causal mask, or run without context parallelism for other masks")
    if dropout_p:
        raise ContextAttentionError(f"context-parallel attention has no attention dropout (dropout_p={dropout_p}); "
                                    f"set the model's attention dropout to 0")
    if (layout.degree, layout.rank) != (group.size, group.rank):
        raise ContextAttentionError(f"the layout is rank {layout.rank} of {layout.degree} but this process is member "
                                    f"{group.rank} of a context group of {group.size}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ContextAttentionError(f"q, k, v must be (batch, heads, tokens, head_dim); got shapes "
                                    f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, t, _ = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != t or k.shape[3] != q.shape[3]:
        raise ContextAttentionError(f"k and v of shapes {tuple(k.shape)}, {tuple(v.shape)} do not match q "
                                    f"{tuple(q.shape)} (same batch, tokens and head_dim; heads may be fewer)")
    if h % k.shape[1]:
        raise ContextAttentionError(f"{h} query heads are not a multiple of {k.shape[1]} key/value heads")
    if t != layout.local_len:
        raise ContextAttentionError(f"q holds {t} tokens but rank {layout.rank} of the context layout holds "
                                    f"{layout.local_len} ({layout.seq_len} over {layout.degree} ranks)")
    if mode == ContextAttention.ULYSSES and h % layout.degree:
        raise ContextAttentionError(f"Ulysses attention splits the {h} heads over {layout.degree} context ranks, "
                                    f"which needs heads divisible by the degree; use context_attention 'ring'")
    return mode


# ---------------------------------------------------------------------------
# Ulysses


def _ulysses(q, k, v, group: Group, layout: ContextLayout, causal: bool, scale: float) -> torch.Tensor:
    degree = group.size
    if k.shape[1] % degree:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    order = sequence_order(layout.seq_len, degree).to(q.device)
    to_positions = torch.argsort(order)
    qh, kh, vh = (_AllToAll.apply(x, group, 1, 2).index_select(2, to_positions) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale,
                                         enable_gqa=kh.shape[1] != qh.shape[1])
    return _AllToAll.apply(out.index_select(2, order), group, 2, 1)


def _all_to_all(x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """x cut into group.size equal pieces along scatter_dim, piece j sent to member j; the pieces
    received (from members 0, 1, ...) joined along gather_dim."""
    send = torch.stack(x.chunk(group.size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    group.all_to_all(recv.view(-1), send.view(-1))
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """_all_to_all with its inverse (scatter and gather dims swapped) as the backward."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


# ---------------------------------------------------------------------------
# Ring


def _tasks(q_chunks: tuple[int, int], kv_chunks: tuple[int, int], chunk: int,
           causal: bool) -> list[tuple[slice, slice, bool]]:
    """The blocks one ring step computes: (query rows, key rows, causal triangle?) in local
    offsets, for this rank's query chunks against the key/value chunks it holds (chunk ids in
    0 .. 2 * degree - 1). Fully masked pairs are left out; neighbouring query chunks that see
    the same keys in full are one block."""
    if not causal:
        return [(slice(0, 2 * chunk), slice(0, 2 * chunk), False)]
    tasks: list[tuple[slice, slice, bool]] = []
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


def _widen(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to `heads` query heads (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _narrow_heads(g: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of _widen: the query-head gradient summed over each key head's group."""
    if g.shape[1] == heads:
        return g
    b, h, t, d = g.shape
    return g.view(b, heads, h // heads, t, d).sum(2)


def _scores(q, k, scale: float, triangle: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if triangle:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    """Ring attention over the context group (see the module docstring); fp32 accumulation."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, scale):
        degree, me, chunk = group.size, group.rank, layout.chunk_len
        heads = q.shape[1]
        qf = q.float()
        out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qf.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(degree):
            if step < degree - 1:
                incoming = torch.empty_like(kv)
                handle = group.send_recv(kv, (me + 1) % degree, incoming, (me - 1) % degree, _FWD_KV)
            src = chunk_layout(layout.seq_len, degree, (me - step) % degree)
            kf, vf = _widen(kv[0].float(), heads), _widen(kv[1].float(), heads)
            for rows, keys, triangle in _tasks(layout.chunks, src.chunks, chunk, causal):
                s = _scores(qf[:, :, rows], kf[:, :, keys], scale, triangle)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.matmul(torch.exp(s - block_lse.unsqueeze(-1)), vf[:, :, keys])
                new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new_lse).unsqueeze(-1)
                                   + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
                lse[:, :, rows] = new_lse
            if step < degree - 1:
                handle.wait()
                kv = incoming
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.scale = group, layout, causal, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal, scale = ctx.group, ctx.layout, ctx.causal, ctx.scale
        degree, me, chunk = group.size, group.rank, layout.chunk_len
        heads = q.shape[1]
        qf, do = q.float(), dout.float()
        delta = (do * out.float()).sum(-1)  # (B, H, T_local): rowsum(dO * O) of the softmax backward
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).contiguous()
        arriving = None  # the key/value gradient of this step's block, accumulated by the ranks before
        for step in range(degree):
            if step < degree - 1:
                incoming = torch.empty_like(kv)
                kv_handle = group.send_recv(kv, (me + 1) % degree, incoming, (me - 1) % degree, _BWD_KV)
            src = chunk_layout(layout.seq_len, degree, (me - step) % degree)
            kf, vf = _widen(kv[0].float(), heads), _widen(kv[1].float(), heads)
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for rows, keys, triangle in _tasks(layout.chunks, src.chunks, chunk, causal):
                s = _scores(qf[:, :, rows], kf[:, :, keys], scale, triangle)
                p = torch.exp(s - lse[:, :, rows].unsqueeze(-1))
                dv[:, :, keys] += torch.matmul(p.transpose(-1, -2), do[:, :, rows])
                ds = p * (torch.matmul(do[:, :, rows], vf[:, :, keys].transpose(-1, -2))
                          - delta[:, :, rows].unsqueeze(-1))
                dq[:, :, rows] += torch.matmul(ds, kf[:, :, keys]) * scale
                dk[:, :, keys] += torch.matmul(ds.transpose(-1, -2), qf[:, :, rows]) * scale
            dkv = torch.stack([_narrow_heads(dk, k.shape[1]), _narrow_heads(dv, v.shape[1])])
            if arriving is not None:
                dkv_handle.wait()
                dkv += arriving
            arriving = torch.empty_like(dkv)
            # to the next rank, which holds this block next; the last send returns it to its owner
            dkv_handle = group.send_recv(dkv, (me + 1) % degree, arriving, (me - 1) % degree, _BWD_DKV)
            if step < degree - 1:
                kv_handle.wait()
                kv = incoming
        dkv_handle.wait()
        return (dq.to(q.dtype), arriving[0].to(k.dtype), arriving[1].to(v.dtype), None, None, None, None)
