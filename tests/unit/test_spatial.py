"""Spatial tiles: halo geometry, and tile ops equal to the whole-image op (forward and every gradient,
input-gradient borders included), with ranks as threads over an in-memory communicator."""

from __future__ import annotations

import copy
import queue
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.parallel.spatial.halo import TileExchange, _AxisExchange
from runtime.parallel.spatial.geometry import SpatialError, TileLayout, Window, axis_halos, bounds, halo_widths, tile_shape
from runtime.parallel.spatial.tile_ops import SpatialBatchNorm2d, SpatialConv2d, SpatialPool2d, conv_windows, pool_windows


# ---- geometry -------------------------------------------------------------

def test_halo_widths_from_kernel_stride_dilation_padding():
    assert halo_widths(3) == (1, 1)
    assert halo_widths(5) == (2, 2)
    assert halo_widths(1) == (0, 0)
    assert halo_widths(3, stride=2) == (1, 0)
    assert halo_widths(3, dilation=2) == (2, 2)
    assert halo_widths(7, stride=2, padding=3) == (3, 2)
    assert halo_widths(2, stride=2, padding=0) == (0, 0)   # 2x2 max pool


def test_tile_shapes_and_bounds():
    assert tile_shape("strips_h", 4) == (4, 1)
    assert tile_shape("strips_v", 2) == (1, 2)
    assert tile_shape("grid", 4) == (2, 2)
    assert tile_shape("grid", 8) == (2, 4)
    assert bounds(60, 4) == [0, 15, 30, 45, 60]
    assert bounds(15, 2) == [0, 7, 15]
    with pytest.raises(SpatialError, match="not one of"):
        tile_shape("diagonal", 2)


def test_axis_halos_interior_tile_of_a_3x3_conv():
    plans = axis_halos(64, 64, 4, Window(3, 1, 1, 1))
    assert (plans[0].pad_lo, plans[0].recv_lo, plans[0].recv_hi, plans[0].send_hi) == (1, 0, 1, 1)
    mid = plans[1]
    assert (mid.recv_lo, mid.recv_hi, mid.send_lo, mid.send_hi, mid.pad_lo) == (1, 1, 1, 1, 0)
    assert plans[3].pad_hi == 1 and plans[3].recv_hi == 0


def test_axis_halos_stride_two_one_by_one_drops_rows():
    plans = axis_halos(32, 16, 2, Window(1, 2, 1, 0))
    assert all(p.recv_lo == p.recv_hi == 0 for p in plans)
    assert plans[0].crop_hi == 1  # the tile's last row is never read by a stride-2 1x1 conv


def test_tiles_thinner_than_the_halo_are_refused_naming_the_layer():
    with pytest.raises(SpatialError, match="features.0.conv.*neighbour holds only"):
        axis_halos(8, 8, 8, Window(5, 1, 1, 2), layer="features.0.conv")
    with pytest.raises(SpatialError, match="pool.*fewer than the 4 tiles"):
        axis_halos(3, 1, 4, Window(2, 2, 1, 0), layer="pool")


def test_ceil_mode_and_reflect_padding_are_refused_naming_the_layer():
    with pytest.raises(SpatialError, match="my.pool.*ceil_mode"):
        pool_windows(nn.MaxPool2d(2, ceil_mode=True), "my.pool")
    with pytest.raises(SpatialError, match="c1.*padding_mode"):
        conv_windows(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"), "c1")


# ---- ranks as threads -----------------------------------------------------

class _Done:
    def wait(self):
        return None


class _Recv:
    def __init__(self, q, buf):
        self.q, self.buf = q, buf

    def wait(self):
        self.buf.copy_(self.q.get(timeout=20))


class ThreadWorld:
    """isend/irecv between threads by (src, dst, tag) queues; a group all-reduce by a barrier."""

    def __init__(self, n):
        self.n = n
        self.queues: dict = {}
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n

    def q(self, key):
        with self.lock:
            return self.queues.setdefault(key, queue.Queue())

    def comm(self, rank):
        world = self

        class Comm:
            def isend(self, t, peer, tag):
                world.q((rank, peer, tag)).put(t.clone())
                return _Done()

            def irecv(self, t, peer, tag):
                return _Recv(world.q((peer, rank, tag)), t)

        class Group:
            ranks = tuple(range(world.n))
            size = world.n

            def all_reduce(self, t, op="sum"):
                world.slots[rank] = t.clone()
                world.barrier.wait()
                total = sum(world.slots)
                world.barrier.wait()
                t.copy_(total)

            def __init__(self):
                self.rank = rank

        return Comm(), Group()


def run_threads(n, fn):
    world = ThreadWorld(n)
    out, errors = [None] * n, []

    def body(r):
        try:
            out[r] = fn(r, *world.comm(r))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _tile_op_grads(op_full, make_tile_op, split, n, x, fill_check=True):
    """Output and input gradient of a tiled op, assembled from every tile, vs the whole-image op."""
    x = x.detach()
    xf = x.clone().requires_grad_(True)
    yf = op_full(xf)
    gy = torch.randn_like(yf)
    yf.backward(gy)
    H, W = x.shape[-2:]
    Ho, Wo = yf.shape[-2:]

    def body(r, comm, group):
        layout = TileLayout.for_group(split, group)
        rows, cols = layout.tile_of(H, W)
        orows, ocols = layout.tile_of(Ho, Wo)
        xt = x[..., rows, cols].clone().requires_grad_(True)
        op = make_tile_op(comm, group, layout, (H, W), (Ho, Wo))
        yt = op(xt)
        yt.backward(gy[..., orows, ocols])
        return rows, cols, orows, ocols, yt.detach(), xt.grad, op

    res = run_threads(n, body)
    y = torch.empty_like(yf)
    gx = torch.empty_like(x)
    for rows, cols, orows, ocols, yt, gt, _ in res:
        y[..., orows, ocols] = yt
        gx[..., rows, cols] = gt
    return (y, gx, res), (yf.detach(), xf.grad)


CONVS = [(1, 1, 1), (3, 1, 1), (5, 1, 1), (3, 2, 1), (1, 2, 1), (5, 2, 1), (3, 1, 2)]  # (kernel, stride, dilation)


@pytest.mark.parametrize("split,n", [("strips_h", 2), ("strips_v", 4), ("grid", 4)])
@pytest.mark.parametrize("k,s,d", CONVS)
def test_tile_conv_equals_whole_image_conv_with_border_gradients(split, n, k, s, d):
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, k, stride=s, dilation=d, padding=d * (k - 1) // 2)
    x = torch.randn(2, 2, 23, 22)

    def make(comm, group, layout, hw, ohw):
        ex = TileExchange.plan(comm, layout, hw, ohw, *conv_windows(conv, "c"), 0, "c")
        return SpatialConv2d(conv, ex)

    conv.zero_grad()
    (y, gx, res), (yf, gxf) = _tile_op_grads(conv, make, split, n, x)
    torch.testing.assert_close(y, yf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gxf, rtol=1e-5, atol=1e-5)


def test_dropping_the_halo_gradients_breaks_the_border_rows(monkeypatch):
    """The equality above is sensitive: without the neighbours' halo gradients the borders differ."""
    monkeypatch.setattr(_AxisExchange, "add_borrowed", staticmethod(lambda gx, got, dim: None))
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 16, 16)

    def make(comm, group, layout, hw, ohw):
        return SpatialConv2d(conv, TileExchange.plan(comm, layout, hw, ohw, *conv_windows(conv, "c"), 0, "c"))

    (y, gx, _), (yf, gxf) = _tile_op_grads(conv, make, "strips_h", 2, x)
    torch.testing.assert_close(y, yf, rtol=1e-5, atol=1e-5)
    wrong = (gx - gxf).abs().amax(dim=(0, 1, 3)) > 1e-4     # per row
    assert wrong[7] and wrong[8] and not wrong[:7].any() and not wrong[9:].any()


@pytest.mark.parametrize("pool", [nn.MaxPool2d(2), nn.MaxPool2d(3, stride=2, padding=1),
                                  nn.AvgPool2d(3, stride=1, padding=1), nn.AvgPool2d(2)])
def test_tile_pooling_equals_whole_image_pooling(pool):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 21, 20)

    def make(comm, group, layout, hw, ohw):
        ex = TileExchange.plan(comm, layout, hw, ohw, *pool_windows(pool, "p"), 0, "p")
        return SpatialPool2d(pool, ex)

    (y, gx, _), (yf, gxf) = _tile_op_grads(pool, make, "grid", 4, x)
    torch.testing.assert_close(y, yf)
    torch.testing.assert_close(gx, gxf)


def test_synchronized_batchnorm_equals_whole_image_batchnorm():
    torch.manual_seed(2)
    bn = nn.BatchNorm2d(3)
    nn.init.uniform_(bn.weight)
    x = torch.randn(2, 3, 12, 10) * 3 + 1

    tiles = []

    def make(comm, group, layout, hw, ohw):
        # each tile its own running statistics (the tiles run as threads: shared buffers would race),
        # the same weight and bias
        own = copy.copy(bn)
        own._buffers = {k: v.clone() for k, v in bn._buffers.items()}
        tiles.append(SpatialBatchNorm2d(own, group, "sync"))
        return tiles[-1]

    ref = nn.BatchNorm2d(3)
    ref.load_state_dict(bn.state_dict())
    (y, gx, res), (yf, gxf) = _tile_op_grads(ref, make, "grid", 4, x)
    torch.testing.assert_close(y, yf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gxf, rtol=1e-5, atol=1e-5)
    # weight gradients: per-tile partial sums that add up to the whole-image gradient
    assert bn.weight.grad is not None
    torch.testing.assert_close(bn.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    # every tile's running statistics updated once, by the whole image's statistics
    assert len(tiles) == 4
    for t in tiles:
        assert int(t.num_batches_tracked) == 1
        torch.testing.assert_close(t.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t.running_var, ref.running_var, rtol=1e-5, atol=1e-6)


def test_local_batchnorm_uses_the_tile_statistics():
    bn = nn.BatchNorm2d(2)
    x = torch.randn(1, 2, 8, 8)

    def body(r, comm, group):
        layout = TileLayout.for_group("strips_h", group)
        rows, cols = layout.tile_of(8, 8)
        return SpatialBatchNorm2d(bn, group, "local")(x[..., rows, cols]).detach(), rows

    for y, rows in run_threads(2, body):
        torch.testing.assert_close(y, F.batch_norm(x[..., rows, :], None, None, training=True))


def test_a_tile_conv_keeps_only_its_tile_for_backward():
    """The halo-extended copy is rebuilt in backward, not saved: activation memory per tile is the
    tile's share (benchmarks/spatial_memory.py measures the whole network)."""
    conv = nn.Conv2d(2, 3, 5, padding=2)
    x = torch.randn(1, 2, 32, 32)

    def body(r, comm, group):
        layout = TileLayout.for_group("grid", group)
        rows, cols = layout.tile_of(32, 32)
        tile = x[..., rows, cols].clone().requires_grad_(True)
        op = SpatialConv2d(conv, TileExchange.plan(comm, layout, (32, 32), (32, 32), *conv_windows(conv, "c"), 0, "c"))
        saved = []

        def pack(t):
            if not isinstance(t, nn.Parameter):
                saved.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            op(tile)
        return sum(saved), tile.numel() * 4

    for got, tile_bytes in run_threads(4, body):
        assert got == tile_bytes
