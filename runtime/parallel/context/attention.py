"""Attention over a sequence split across context-parallel ranks (runtime/parallel/context/layout.py).

Each rank holds q, k, v (B, H, T_local, D) for its tokens, in its layout order, and gets the
rows of full-sequence attention for those tokens.

RING: key/value blocks pass around the group's ring and the blocks' attention is merged by its
log-sum-exp; the causal mask is applied by chunk pairs, skipping the hidden ones
(runtime/parallel/context/ring.py).

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
from runtime.parallel.context.layout import ContextLayout, chunk_layout, sequence_order
from runtime.parallel.context.ring import RingAttention
from runtime.vocab import ContextAttention

__all__ = ["ContextAttentionError", "ContextLayout", "chunk_layout", "context_attention"]

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
    scaled_dot_product_attention(is_causal=causal) for this rank's tokens. On meta tensors (a
    shape-only run, e.g. with runtime.parallel.tensor.layers.ShapeGroup) nothing is exchanged: the
    local attention gives the output's shape and autograd graph.
    """
    mode = _check(q, k, v, group, layout, mode, attn_mask, dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if group.size == 1 or q.device.type == "meta":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if mode == ContextAttention.RING:
        return RingAttention.apply(q, k, v, group, layout, causal, scale)
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
