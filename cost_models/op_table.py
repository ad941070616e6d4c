"""An op table: per-op timings on one GPU, the facts the GPU cost model is fit to and checked against.

The same rows come from two places: the measured H100 table the project keeps
(../shared/reference/gpu/h100_ops.csv, read with `read_op_table`) and `meshplan calibrate` on a
GPU (cost_models/calibration/gpu_ops.py measures them with CUDA events). Columns, as in the CSV:

    op      what one timed call does (mm_fwd, mm_dgrad, mm_wgrad, sdpa_fwd, sdpa_fwd_bwd,
            layernorm_fwd, layernorm_fwd_bwd, gelu_fwd, add, xent_fp32_fwd_bwd, xent_bf16_fwd_bwd,
            adamw_fused, adamw_foreach, copy_d2d, copy_h2d_pinned, copy_h2d_pageable,
            launch_1000_small_adds, nccl_allreduce_ws1)
    shape   its sizes as text ("qkv M2048 K768 N2304", "B16 H12 T1024 D64 causal", "N16384 h768",
            "N16384 V50304", "params10000000 tensors100", "bytes268435456", "16 floats", "MiB64")
    dtype   "bf16", "fp32", "tf32", "bf16->fp32", "u8"
    ms      median milliseconds of one call (CUDA events around each call, after warm-ups)
    tflops  / gbps: derived rates (informative; the fit reads ms and the shape)
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("op", "shape", "dtype", "ms", "tflops", "gbps")


class OpTableError(ValueError):
    """An op table that cannot be read; the message names the file and the row."""


@dataclass(frozen=True)
class OpRow:
    """One measured op: `ms` milliseconds per call (median)."""

    op: str
    shape: str
    dtype: str
    ms: float
    tflops: float | None = None
    gbps: float | None = None

    def dims(self) -> dict[str, int]:
        """The named sizes in `shape`: "M2048 K768 N2304" -> {"M": 2048, "K": 768, "N": 2304};
        "params10000000 tensors100" -> {"params": ..., "tensors": 100}."""
        return shape_dims(self.shape)

    @property
    def seconds(self) -> float:
        return self.ms * 1e-3

    def to_dict(self) -> dict:
        return {"op": self.op, "shape": self.shape, "dtype": self.dtype, "ms": self.ms,
                "tflops": self.tflops, "gbps": self.gbps}

    @classmethod
    def from_dict(cls, d) -> "OpRow":
        """The row `to_dict` wrote (a mapping, or pairs as a Cluster's measurements keep it)."""
        d = dict(d)
        try:
            return cls(op=str(d["op"]), shape=str(d["shape"]), dtype=str(d["dtype"]), ms=float(d["ms"]),
                       tflops=None if d.get("tflops") is None else float(d["tflops"]),
                       gbps=None if d.get("gbps") is None else float(d["gbps"]))
        except (KeyError, TypeError, ValueError):
            raise OpTableError(f"an op row needs op, shape, dtype and a number ms (tflops, gbps: numbers or "
                               f"null), got {d!r}") from None


def shape_dims(shape: str) -> dict[str, int]:
    """The named sizes in an op row's shape text (OpRow.dims)."""
    return {k: int(v) for k, v in re.findall(r"\b([A-Za-z]+)(\d+)\b", shape)}


# Where a GPU calibration keeps its op rows in a Cluster's measurements (a table of records: to_dict's).
GPU_OPS_KEY = "raw.gpu_ops"


def measured_rows(measurements) -> list[OpRow]:
    """The op rows a GPU calibration stored in a Cluster's `measurements` (pairs or a mapping) under
    GPU_OPS_KEY; [] when it holds none (a preset, a CPU calibration)."""
    table = dict(measurements).get(GPU_OPS_KEY)
    if table is None:
        return []
    if isinstance(table, (str, int, float)):
        raise OpTableError(f"measurement {GPU_OPS_KEY} must be a list of op rows, got {table!r}")
    return [OpRow.from_dict(r) for r in table]


def parse_op_table(text: str, where: str = "op table") -> list[OpRow]:
    """Rows of an op table in CSV text (header `COLUMNS`)."""
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None or tuple(reader.fieldnames[:4]) != COLUMNS[:4]:
        raise OpTableError(f"{where}: the header must start with {','.join(COLUMNS[:4])}, "
                           f"got {','.join(reader.fieldnames or [])!r}")
    rows = []
    for i, r in enumerate(reader, start=2):
        try:
            ms = float(r["ms"])
            if not ms > 0:
                raise ValueError
            rate = {k: float(r[k]) if r.get(k) not in (None, "") else None for k in ("tflops", "gbps")}
        except (TypeError, ValueError):
            raise OpTableError(f"{where}, line {i}: 'ms' must be a positive number and tflops/gbps numbers "
                               f"or empty, got {dict(r)}") from None
        rows.append(OpRow(op=r["op"].strip(), shape=r["shape"].strip(), dtype=r["dtype"].strip(), ms=ms, **rate))
    if not rows:
        raise OpTableError(f"{where}: no rows")
    return rows


def read_op_table(path: str | Path) -> list[OpRow]:
    """The rows of the CSV op table at `path`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OpTableError(f"op table {p} cannot be read ({e})") from None
    return parse_op_table(text, f"op table {p}")


def format_op_table(rows: list[OpRow]) -> str:
    """CSV text of `rows` (what parse_op_table reads)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([r.op, r.shape, r.dtype, f"{r.ms:.5f}", "" if r.tflops is None else f"{r.tflops:.2f}",
                    "" if r.gbps is None else f"{r.gbps:.1f}"])
    return out.getvalue()
