"""Costs of spatial parallelism: halo messages, the gather after the spatial part, memory saved.

A spatially split layer runs on one of s = rows x cols tiles of each image
(runtime/parallel/spatial/tile_ops.py). Per window op (conv or pool) with input (B, C, H, W),
an interior tile of h = H/rows by w = W/cols pixels exchanges, forward:

    rows phase:    halo_rows x w x C x B x bytes        with each of 2 row neighbours
    columns phase: halo_cols x (h + 2 halo_rows) x C x B x bytes   with each of 2 column neighbours
                   (the extended rows carry the corner pixels of the 4 diagonal neighbours)

where halo_rows = max(padding, span - stride - padding) and span = dilation x (kernel - 1) + 1
(runtime.parallel.spatial.geometry.halo_widths). A tile sends to both neighbours of a phase at once (full-duplex
links), so a phase costs one p2p of its larger message. Backward returns the same bytes. The
design note's "2 x halo_rows x width x channels x bytes per neighbour exchange" is the rows phase
counted in both directions.

After the spatial part the tiles are all-gathered (an all-gather whose output is the full
activation), and the spatial part's weight gradients are summed over the tiles once per step.
Compute and activation memory of the spatial layers are divided by s; the halo rows add
(h + halo) x (w + halo) / (h x w) - 1 of extra compute, charged here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.parallel.spatial.geometry import halo_widths, tile_shape


@dataclass(frozen=True)
class HaloBytes:
    """Bytes one interior tile sends to ONE neighbour per phase, forward (backward sends the same)."""

    rows_phase: float    # to the tile above / below (0 when there is one tile row)
    cols_phase: float    # to the tile left / right (0 when there is one tile column)
    compute_factor: float  # (tile + halo area) / tile area: the extra work of the halo rows

    @property
    def per_step_exchange(self) -> float:
        """Bytes one tile sends per forward pass of this op (to all its neighbours)."""
        return 2 * self.rows_phase + 2 * self.cols_phase


def window_halo_bytes(shape: tuple[int, ...], kernel, stride, dilation, padding, split: str, degree: int,
                      elem_bytes: float) -> HaloBytes:
    """Halo bytes of one conv/pool with input `shape` (B, C, H, W) split `split` over `degree` tiles.

    kernel/stride/dilation/padding: ints or (h, w) pairs as torch modules store them.
    """
    b, c, h_full, w_full = shape[-4:] if len(shape) >= 4 else (1, *shape[-3:])
    rows, cols = tile_shape(split, degree)
    k, s, d, p = (_pair(v) for v in (kernel, stride, dilation, padding))
    halo_r = max(halo_widths(k[0], s[0], d[0], p[0]))
    halo_c = max(halo_widths(k[1], s[1], d[1], p[1]))
    h, w = h_full / rows, w_full / cols
    rows_phase = halo_r * w * c * b * elem_bytes if rows > 1 else 0.0
    ext_h = h + (2 * halo_r if rows > 1 else 0)
    cols_phase = halo_c * ext_h * c * b * elem_bytes if cols > 1 else 0.0
    ext_w = w + (2 * halo_c if cols > 1 else 0)
    return HaloBytes(rows_phase, cols_phase, (ext_h * ext_w) / max(h * w, 1e-30))


def halo_seconds(halo: HaloBytes, p2p) -> float:
    """Seconds of one direction (forward or backward) of a halo exchange; p2p(n) -> seconds."""
    return (p2p(halo.rows_phase) if halo.rows_phase else 0.0) + (p2p(halo.cols_phase) if halo.cols_phase else 0.0)


def memory_saved_per_device(activation_bytes: float, degree: int) -> float:
    """Activation bytes a device no longer holds when a layer's activations are split over `degree` tiles."""
    return activation_bytes * (1 - 1 / degree)


def batchnorm_sync_bytes(channels: int, elem_bytes: float = 4.0) -> tuple[float, float]:
    """(forward, backward) all-reduce payloads of one synchronized BatchNorm (runtime.parallel.spatial.tile_ops): forward
    the per-channel sums with the element count, then the sums of squared deviations (two
    all-reduces); backward the per-channel sums of g and g * xhat (one all-reduce)."""
    return (2 * channels + 1) * elem_bytes, (2 * channels + 1) * elem_bytes


def _pair(v) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        return int(v[0]), int(v[-1])
    return int(v), int(v)
