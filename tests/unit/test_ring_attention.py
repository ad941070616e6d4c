"""Ring attention's pieces: the blocks a step computes (causal skipping by chunk pairs), their
cutting along query rows, the two block kernels against autograd, and a ring of two gloo ranks
(threads) on the matmul kernel with small tiles."""

import pytest
import torch
import torch.nn.functional as F

from runtime.parallel.context import ring as ring_attention
from runtime.parallel.context.attention import context_attention
from runtime.parallel.context.layout import chunk_layout, whole_sequence
from runtime.parallel.context.ring import CpuFlashBlocks, MatmulBlocks, _tasks, _tiles
from tests.tp_threads import run_ranks


def test_ring_blocks_skip_what_the_causal_mask_hides():
    c = 4
    # rank 0 of 2 (chunks 0, 3). Its own keys: chunk 0 attends to itself (triangle); chunk 3 sees
    # chunk 0 in full and itself with the triangle.
    assert _tasks((0, 3), (0, 3), c, causal=True) == [
        (slice(0, 4), slice(0, 4), True), (slice(4, 8), slice(0, 4), False), (slice(4, 8), slice(4, 8), True)]
    # rank 1's keys (chunks 1, 2): chunk 0 sees neither; chunk 3 sees both in full
    assert _tasks((0, 3), (1, 2), c, causal=True) == [(slice(4, 8), slice(0, 8), False)]
    # rank 1 (chunks 1, 2) with rank 0's keys (0, 3): both query chunks see chunk 0 only, one block
    assert _tasks((1, 2), (0, 3), c, causal=True) == [(slice(0, 8), slice(0, 4), False)]
    assert _tasks((1, 2), (0, 3), c, causal=False) == [(slice(0, 8), slice(0, 8), False)]


def test_blocks_are_cut_along_query_rows_to_bound_the_scores():
    # chunks of 8: the second query chunk sees the first key chunk in full and its own with the
    # triangle; batch x heads 2 and at most 48 scores leave 3 rows of 8 keys per tile
    tasks = [(slice(8, 16), slice(0, 8), False), (slice(8, 16), slice(8, 16), True)]
    assert _tiles(tasks, 2, 2 * 8 * 3) == [
        (slice(8, 11), slice(0, 8), None), (slice(11, 14), slice(0, 8), None), (slice(14, 16), slice(0, 8), None),
        (slice(8, 11), slice(8, 16), 0), (slice(11, 14), slice(8, 16), 3), (slice(14, 16), slice(8, 16), 6)]
    assert _tiles(tasks, 2, None) == [(slice(8, 16), slice(0, 8), None), (slice(8, 16), slice(8, 16), 0)]


@pytest.mark.parametrize("kernels", [MatmulBlocks, CpuFlashBlocks])
@pytest.mark.parametrize("causal", [False, True])
def test_block_kernels_match_autograd(kernels, causal):
    # a block's forward is its own attention; its backward, handed the block's own output and
    # log-sum-exp (a ring of one block), is attention's gradient
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(4))
    out, lse = kernels.forward(q, k, v, 0.4, 0 if causal else None)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=causal, scale=0.4)
    want.backward(dout)
    scores = (q @ k.transpose(-1, -2)) * 0.4
    if causal:
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-6)
    grads = kernels.backward(dout, q, k, v, out, lse, 0.4, 0 if causal else None)
    for got, x in zip(grads, full):
        torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-6)


def test_matmul_tile_with_diagonal_offset_masks_relative_to_its_chunk():
    # rows 3-5 of a causal chunk of 6: row i of the tile sees keys 0 .. i + 3
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    out, _ = MatmulBlocks.forward(q[:, :, 3:], k, v, 0.5, 3)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)[:, :, 3:]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


class _SmallTiles(MatmulBlocks):
    @staticmethod
    def score_limit():
        return 2 * 4 * 4 * 3  # batch x heads 8: tiles of 3 query rows against a chunk of 4 keys


def test_ring_on_the_matmul_kernel_with_small_tiles_equals_full_attention(monkeypatch):
    # 2 gloo ranks (threads), 16 tokens in chunks of 4; causal tiles of 3 query rows cut every
    # chunk unevenly (rows 0-2 and 3), so a wrong diagonal offset shows in some row
    monkeypatch.setattr(ring_attention, "block_kernels", lambda device: _SmallTiles)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    want.backward(dout)

    def rank(r, group):
        layout = chunk_layout(16, 2, r)
        mine = [layout.take(x, 2).requires_grad_() for x in (q, k, v)]
        out = context_attention(*mine, group, layout, causal=True, mode="ring")
        out.backward(layout.take(dout, 2))
        return [out.detach()] + [x.grad for x in mine]

    got = run_ranks(2, rank)
    for i, expected in enumerate([want.detach()] + [x.grad for x in full]):
        torch.testing.assert_close(whole_sequence([r[i] for r in got], 2), expected, rtol=1e-5, atol=1e-5)
