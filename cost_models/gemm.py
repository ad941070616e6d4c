"""Compute time of one GEMM on a GPU from its shape: output tiles over the SMs, in waves.

A GEMM (batch x (M x K) @ (K x N)) is cut into output tiles of bm x bn elements; each tile
is one thread block that walks the K dimension and runs on one SM. With `units` SMs the
tiles run in ceil(tiles / units) waves, and every wave costs as much as a full one (NVIDIA,
"Matrix Multiplication Background User's Guide", section 3: tile quantization pads M and N
up to whole tiles, wave quantization pads the tile count up to whole waves; their example is
the A100's 108 SMs with 256 x 128 tiles). cuBLAS picks, per shape, among a few tile sizes
(guide section 2.3: 256x128, 128x256, 128x128, 256x64, 64x256, 128x64, 64x128, 64x64), and
splits K over several blocks when there are too few tiles to fill the SMs ("split-K"):
this model takes the fastest of those choices.

Costs that do not depend on the tile count:

* a small tile reuses each operand element over fewer multiply-adds, so it feeds the
  tensor cores slower than a large one (guide section 2.3: larger tiles are more
  efficient); see TILE_LOAD;
* each tile's K loop fills and drains its software pipeline (loads of the first K
  blocks, the epilogue that converts and stores the tile): K_FILL extra K elements per tile,
  so a short K cannot reach the rate of a long one.

The large-GEMM rate itself (`eff_matmul` x peak) stays the Efficiency.matmul of
cost_models/compute.py (about 0.8 of the tensor-core peak, or a calibrated figure): the
shape model only takes away from it. Memory traffic (a GEMM with a small dimension is
bound by reading its operands) is the caller's roofline (cost_models/compute.op_time).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# Thread-block output tiles cuBLAS uses for tensor-core GEMMs (guide section 2.3).
TILES: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256),
                                      (128, 64), (64, 128), (64, 64))
# K split over this many blocks when the tiles alone leave SMs idle (cuBLAS split-K).
SPLIT_K: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
# A tile's K loop spends, per K step, bm x bn multiply-adds on the tensor cores plus a cost per
# operand element it loads (bm + bn of them) that the pipeline does not hide, worth TILE_LOAD
# multiply-adds each; so a tile runs at reuse / (reuse + TILE_LOAD) with reuse = bm bn / (bm + bn),
# and smaller tiles run slower (guide section 2.3: larger tiles reuse more data and are more
# efficient). ASSUMPTION: TILE_LOAD = 16 puts 128 x 128 at 0.95, 128 x 64 at 0.86 and 64 x 64 at
# 0.79 of the 256 x 128 rate; the guide publishes the ordering, not the ratios.
TILE_LOAD = 16.0
# Extra K elements each tile spends filling and draining its K-loop pipeline. ASSUMPTION of a
# few K blocks (Ampere/Hopper kernels stage 3-4 blocks of 32-64): it keeps K >= 2048 within 3%
# of the long-K rate, as the best shapes of Stas Bekman's "Maximum Achievable Matmul FLOPS"
# table (ml-engineering, compute/accelerator: A100 SXM 267.9-271.2 TFLOP/s at K = 2048-5120,
# H100 SXM 792-795 TFLOP/s at K = 2816-13312) show.
K_FILL = 64


@dataclass(frozen=True)
class GemmShape:
    """`batch` independent (m x k) @ (k x n) products (elements)."""

    m: int
    n: int
    k: int
    batch: int = 1

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GemmShape.{name} must be a whole number >= 1, got {v!r}")

    @property
    def flops(self) -> float:
        """Multiply-adds counted as 2 FLOPs."""
        return 2.0 * self.batch * self.m * self.n * self.k


def tile_rate(bm: int, bn: int, tile_load: float = TILE_LOAD) -> float:
    """Rate of a bm x bn tile over the largest tile's (operand loads per multiply-add, `tile_load`)."""
    return _reuse_rate(bm, bn, tile_load) / max(_reuse_rate(a, b, tile_load) for a, b in TILES)


def _reuse_rate(bm: int, bn: int, tile_load: float) -> float:
    reuse = bm * bn / (bm + bn)
    return reuse / (reuse + tile_load)


@functools.lru_cache(maxsize=16384)
def shape_efficiency(shape: GemmShape, units: int, tile_load: float = TILE_LOAD, k_fill: float = K_FILL) -> float:
    """Fraction of the large-GEMM FLOP rate a GEMM of `shape` reaches on `units` SMs.

    The fastest tile and split-K choice: its waves x per-tile time (tile elements x
    (K per split + k_fill) / tile_rate) against the ideal (every SM busy on useful
    multiply-adds the whole time). 1.0 when the device has no SM count (a CPU).
    `tile_load` and `k_fill` default to this module's assumptions; a fitted GPU
    (cost_models/gpu_costs.py) passes its own.
    """
    if units <= 0:
        return 1.0
    ideal = shape.batch * shape.m * shape.n * shape.k / units
    best = min(_tile_time(shape, bm, bn, split, units, tile_load, k_fill)
               for bm, bn in TILES for split in SPLIT_K
               if split == 1 or _tiles(shape, bm, bn) < units)
    return min(ideal / best, 1.0)


def _tiles(shape: GemmShape, bm: int, bn: int) -> int:
    return shape.batch * -(-shape.m // bm) * -(-shape.n // bn)


def _tile_time(shape: GemmShape, bm: int, bn: int, split: int, units: int, tile_load: float,
               k_fill: float) -> float:
    """Multiply-add slots of one SM the schedule takes (waves x one tile's K loop)."""
    tiles = _tiles(shape, bm, bn) * split
    waves = -(-tiles // units)
    k_per_block = -(-shape.k // split)
    return waves * bm * bn * (k_per_block + k_fill) / tile_rate(bm, bn, tile_load)


def combined_efficiency(shapes: list[GemmShape], units: int) -> float:
    """One shape efficiency for several GEMMs run one after the other (a linear layer's
    backward: input and weight gradients): their FLOPs over the sum of their FLOP-seconds."""
    total = sum(s.flops for s in shapes)
    if not total:
        return 1.0
    return total / sum(s.flops / shape_efficiency(s, units) for s in shapes)


def aligned(shape: GemmShape, elem_bytes: int) -> bool:
    """Whether every dimension is a multiple of 16 bytes of the element type (8 elements of a 16-bit
    dtype, 4 of fp32): what the aligned tensor-core kernels need (NVIDIA, "Matrix Multiplication
    Background User's Guide", section 4.1); a GEMM that misses it runs a slower kernel
    (GpuCosts.gemm_misaligned)."""
    step = max(16 // max(elem_bytes, 1), 1)
    return shape.m % step == 0 and shape.n % step == 0 and shape.k % step == 0
