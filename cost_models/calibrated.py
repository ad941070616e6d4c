"""Read the fitted constants a calibrated Cluster file carries (written by `meshplan calibrate`).

A calibrated cluster keeps its fits in `Cluster.measurements` under ``fit.``
names, next to the raw measurements (``raw.``), so the file format needs no
new section and an old meshplan still loads it:

    fit.eff.matmul / fit.eff.conv / fit.eff.memory     achieved fraction of the device's peak
    fit.eff.kernel_overhead                            s per op of a kind without its own figure
    fit.overhead.<kind>.forward / .backward            s per op of that kind (Efficiency.kind_overheads)
    fit.call.forward / .backward                       s per stage forward / backward call (simulator)
    fit.comm.<op>.g<size>.alpha / .beta                s and s/byte: one `op` over a group of
                                                       `size` ranks of one node costs alpha + beta * n

The cost models use them through :func:`calibrated_efficiency` (planner.evaluate's
default Efficiency) and :func:`fitted_collective` (cost_models.comm.collective_time).
Both are cached per measurements table, since the search asks thousands of times.
"""

from __future__ import annotations

import functools

from cost_models.compute import Efficiency

FIT = "fit."


@functools.lru_cache(maxsize=64)
def _fits(measurements: tuple[tuple[str, object], ...]) -> dict[str, float]:
    return {k[len(FIT):]: float(v) for k, v in measurements if k.startswith(FIT) and isinstance(v, (int, float))}


def calibrated_efficiency(cluster) -> Efficiency | None:
    """The measured Efficiency of a calibrated cluster, or None for any other cluster."""
    return _efficiency(cluster.measurements, cluster.source)


@functools.lru_cache(maxsize=64)
def _efficiency(measurements, source: str) -> Efficiency | None:
    fits = _fits(measurements)
    if "eff.matmul" not in fits:
        return None
    kinds = sorted({k.split(".")[1] for k in fits if k.startswith("overhead.")})
    overheads = tuple((k, fits[f"overhead.{k}.forward"], fits[f"overhead.{k}.backward"]) for k in kinds
                      if f"overhead.{k}.forward" in fits and f"overhead.{k}.backward" in fits)
    return Efficiency(matmul=fits["eff.matmul"], conv=fits["eff.conv"], memory=fits["eff.memory"],
                      kernel_overhead=fits["eff.kernel_overhead"], kind_overheads=overheads,
                      source=f"calibrated: {source}" if source else "calibrated")


def fitted_collective(cluster, op: str, group_size: int) -> tuple[float, float] | None:
    """(alpha s, beta s/byte) measured for `op` over `group_size` ranks of one node, or None."""
    fits = _fits(cluster.measurements)
    a = fits.get(f"comm.{op}.g{group_size}.alpha")
    b = fits.get(f"comm.{op}.g{group_size}.beta")
    return None if a is None or b is None else (a, b)


def call_overheads(cluster) -> tuple[float, float]:
    """(forward s, backward s) of fixed cost per stage forward / backward call; (0, 0) if not calibrated."""
    fits = _fits(cluster.measurements)
    return fits.get("call.forward", 0.0), fits.get("call.backward", 0.0)
