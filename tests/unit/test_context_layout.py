"""The causal load-balanced context layout by hand and the refusals of context-parallel attention
(tests/unit/test_ring_attention.py: the ring's blocks; tests/distributed/test_context_attention.py:
both modes on real ranks)."""

import pytest
import torch
import torch.nn.functional as F

from runtime.comm import SoloGroup
from runtime.parallel.context.attention import ContextAttentionError, context_attention
from runtime.parallel.context.layout import ContextLayoutError, chunk_layout, sequence_order, whole_sequence
from runtime.parallel.tensor.layers import ShapeGroup


def test_sixteen_tokens_over_two_ranks():
    # chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_layout(16, 2, 0).positions().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_layout(16, 2, 1).positions().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert chunk_layout(16, 2, 0).chunks == (0, 3)
    assert chunk_layout(16, 2, 1).ranges() == ((4, 8), (8, 12))


def test_sixteen_tokens_over_four_ranks():
    # chunks of 2: rank r holds chunks r and 7 - r
    assert [chunk_layout(16, 4, r).positions().tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sequence_order(16, 4).tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]


def test_degree_one_holds_the_sequence_in_order():
    layout = chunk_layout(6, 1, 0)
    assert layout.positions().tolist() == [0, 1, 2, 3, 4, 5]
    assert (layout.chunk_len, layout.local_len) == (3, 6)


def test_take_put_and_assemble():
    x = torch.arange(2 * 16).reshape(2, 16) * 10
    parts = [chunk_layout(16, 2, r).take(x, 1) for r in range(2)]
    assert parts[0][1].tolist() == [160, 170, 180, 190, 280, 290, 300, 310]
    assert parts[1][0].tolist() == [40, 50, 60, 70, 80, 90, 100, 110]
    assert torch.equal(whole_sequence(parts, 1), x)
    full = torch.zeros_like(x)
    chunk_layout(16, 2, 1).put(full, parts[1], 1)
    assert full[0].tolist() == [0] * 4 + [40, 50, 60, 70, 80, 90, 100, 110] + [0] * 4


@pytest.mark.parametrize("seq_len, degree", [(18, 2), (12, 4), (0, 2)])
def test_a_sequence_the_split_cannot_cut_is_refused_naming_both_numbers(seq_len, degree):
    with pytest.raises(ContextLayoutError, match=rf"sequence length {seq_len} .* degree {degree}"):
        chunk_layout(seq_len, degree, 0)
    assert issubclass(ContextLayoutError, ValueError)


def test_bad_rank_degree_and_tensor_length_are_refused():
    with pytest.raises(ContextLayoutError, match="rank 2 is outside 0..1"):
        chunk_layout(16, 2, 2)
    with pytest.raises(ContextLayoutError, match="degree 0"):
        chunk_layout(16, 0, 0)
    with pytest.raises(ContextLayoutError, match="has 15 tokens along dim 1; this layout splits 16"):
        chunk_layout(16, 2, 0).take(torch.zeros(2, 15), 1)


def _qkv(heads=4, kv_heads=4, tokens=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, tokens, 8, generator=g), torch.randn(2, kv_heads, tokens, 8, generator=g),
            torch.randn(2, kv_heads, tokens, 8, generator=g))


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="zigzag"), "unknown context attention mode 'zigzag'; known: ring, ulysses"),
    (dict(mode="ring", attn_mask=torch.ones(8, 8, dtype=torch.bool)), "takes no explicit attn_mask"),
    (dict(mode="ring", dropout_p=0.1), r"no attention dropout \(dropout_p=0.1\)"),
])
def test_unsupported_options_are_refused(kwargs, message):
    q, k, v = _qkv()
    with pytest.raises(ContextAttentionError, match=message):
        context_attention(q, k, v, SoloGroup(0), chunk_layout(8, 1, 0), causal=True, **kwargs)


def test_mismatched_layout_and_shapes_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ContextAttentionError, match="layout is rank 0 of 2 but this process is member 0 of a "
                                                    "context group of 1"):
        context_attention(q, k, v, SoloGroup(0), chunk_layout(16, 2, 0), causal=True, mode="ring")
    with pytest.raises(ContextAttentionError, match="q holds 8 tokens but rank 0 of the context layout holds 16"):
        context_attention(q, k, v, ShapeGroup(2), chunk_layout(32, 2, 0), causal=True, mode="ring")
    q3, k3, v3 = _qkv(heads=3, kv_heads=2)
    with pytest.raises(ContextAttentionError, match="3 query heads are not a multiple of 2 key/value heads"):
        context_attention(q3, k3, v3, ShapeGroup(2), chunk_layout(16, 2, 0), causal=True, mode="ring")


def test_ulysses_needs_heads_divisible_by_the_degree():
    q, k, v = _qkv(heads=3, kv_heads=3)
    with pytest.raises(ContextAttentionError, match="splits the 3 heads over 2 context ranks.*use context_attention "
                                                    "'ring'"):
        context_attention(q, k, v, ShapeGroup(2), chunk_layout(16, 2, 0), causal=True, mode="ulysses")


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_degree_one_is_plain_attention(mode):
    q, k, v = _qkv(kv_heads=2)
    got = context_attention(q, k, v, SoloGroup(0), chunk_layout(8, 1, 0), causal=True, mode=mode)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def test_solo_group_exchanges_are_copies():
    g = SoloGroup(3)
    out = torch.zeros(4)
    g.all_to_all(out, torch.arange(4.0))
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    recv = torch.zeros(2)
    g.send_recv(torch.tensor([5.0, 6.0]), 0, recv, 0, tag=7).wait()
    assert recv.tolist() == [5.0, 6.0]
    with pytest.raises(ValueError, match="names members 1 and 0; the only member is 0"):
        g.send_recv(recv, 1, recv, 0, tag=7)


def test_meta_tensors_give_the_local_shape_without_communication():
    q, k, v = (x.to("meta").requires_grad_() for x in _qkv(tokens=8))
    out = context_attention(q, k, v, ShapeGroup(2), chunk_layout(16, 2, 0), causal=True, mode="ring")
    assert (out.device.type, tuple(out.shape), out.requires_grad) == ("meta", (2, 4, 8, 8), True)
