"""Read the fitted constants a calibrated Cluster file carries (written by `meshplan calibrate`).

A calibrated cluster keeps its fits in `Cluster.measurements` under ``fit.``
names, next to the raw measurements (``raw.``), so the file format needs no
new section and an old meshplan still loads it:

    fit.eff.matmul / fit.eff.conv / fit.eff.memory     achieved fraction of the device's peak
    fit.eff.kernel_overhead                            s per op of a kind without its own figure
    fit.overhead.<kind>.forward / .backward            s per op of that kind (Efficiency.kind_overheads)
    fit.call.forward / .backward                       s per stage forward / backward call (simulator)
    fit.loss.forward / .backward                       s per loss on the last stage, plus
    fit.loss.forward_per_element / ...                 s per logits element (simulator)
    fit.zero_grad.per_tensor / .per_byte               s of zeroing gradients (simulator)
    fit.executor.gap.<op> / .issue.<op>                s the runtime's executor spends after a synchronous
                                                       instruction / issuing an asynchronous one (simulator)
    fit.executor.extra.F / .B                          s a forward / backward instruction takes in a run
                                                       beyond the stage called in a row (simulator)
    fit.tensor_wrapper.forward / .backward             s per tensor-parallel layer wrapper (the autograd
      (+ _per_element)                                 function around an in-layer all-reduce), besides
                                                       the all-reduce, plus s per element reduced
                                                       (planner.evaluate)
    fit.tensor_embedding.forward / ... (+ _per_element)  s a vocabulary-parallel embedding adds, plus s per
                                                       output element (planner.evaluate)
    fit.loss.vocab_forward / ... (+ _per_element)      s the vocabulary-parallel loss adds to the plain one,
                                                       plus s per logits element (simulator)
    fit.optimizer.<kind>.per_tensor / .per_step        s per parameter tensor / per call of one optimizer
                                                       step (kind: sgd, sgd_momentum, adamw)
    fit.comm.<op>.g<size>.alpha / .beta                s and s/byte: one `op` over a group of
                                                       `size` ranks of one node costs alpha + beta * n
    raw.comm.<op>.g<size>.<n>                          s: the measured mean of one such `op` of n bytes
    fit.after_reduce.optimizer_per_byte / ...          s per gradient byte an optimizer step (and zeroing:
      .zero_grad_per_byte                              zero_grad_per_byte) costs beyond its own buffer's
                                                       right after an all-reduce went through it (simulator)
    fit.comm.overlap_hidden                            share (-1..1) of an asynchronous collective that
                                                       compute running meanwhile hides (simulator;
                                                       below 0: overlapping it costs extra)
    raw.curve.<family>.<size>.forward / .backward      s per op of that family at that size
                                                       (cost_models/op_curves.py: planner.evaluate prices
                                                       fp32 nodes of those families from them)
    fit.curve_mix.forward / .backward                  in-layer slow-down of curve-priced ops (probe block)
    fit.in_run.forward / .backward                     a node's time in a traced training run over its
                                                       per-op price (planner/app/calibrate_run.py: a probe
                                                       model trained through the runtime; planner.evaluate)

A collective's time is the measured table interpolated piecewise-linearly in the
message size (:func:`measured_collective`), plus fit.comm.wake: on gloo over
loopback the time of a call is not affine in n (1 KiB - 64 KiB all-reduces cost
several times an 8-byte one and as much as 1 MiB), which a single alpha + beta n
cannot follow. Past the largest measured size the fitted beta extends the table.

The cost models use them through :func:`calibrated_efficiency` (planner.evaluate's
default Efficiency) and :func:`fitted_collective` (cost_models.comm.collective_time).
Both are cached per measurements table, since the search asks thousands of times.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

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


def measured_collective(cluster, op: str, group_size: int, nbytes: float, *, wake: bool = True) -> float | None:
    """Seconds of one `op` of `nbytes` over `group_size` ranks of one node, read off the measured
    table (raw.comm.*), or None when the cluster has no table with two sizes for it.

    Linear between neighbouring measured sizes, the smallest size's time below it, the largest
    size's time plus fit beta per extra byte above it; plus, with `wake`, fit.comm.wake (the
    delay of a transfer issued right after computing, cost_models/calibration/calibrate.py)."""
    table = _tables(cluster.measurements).get((op, group_size))
    if table is None or len(table) < 2:
        return None
    fits = _fits(cluster.measurements)
    wake = fits.get("comm.wake", 0.0) if wake else 0.0
    sizes = [n for n, _ in table]
    if nbytes <= sizes[0]:
        return table[0][1] + wake
    if nbytes >= sizes[-1]:
        beta = fits.get(f"comm.{op}.g{group_size}.beta", 0.0)
        return table[-1][1] + beta * (nbytes - sizes[-1]) + wake
    i = bisect.bisect_right(sizes, nbytes)
    (n0, t0), (n1, t1) = table[i - 1], table[i]
    return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0) + wake


@functools.lru_cache(maxsize=64)
def _tables(measurements: tuple[tuple[str, object], ...]) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """{(op, group size): [(n bytes, s), ...] sorted by n} from the raw.comm.<op>.g<size>.<n> entries."""
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for k, v in measurements:
        parts = k.split(".")
        if len(parts) == 5 and parts[:2] == ["raw", "comm"] and parts[3][:1] == "g" and isinstance(v, (int, float)):
            try:
                key, n = (parts[2], int(parts[3][1:])), float(parts[4])
            except ValueError:
                continue
            out.setdefault(key, []).append((n, float(v)))
    return {key: sorted(pts) for key, pts in out.items()}


def call_overheads(cluster) -> tuple[float, float]:
    """(forward s, backward s) of fixed cost per stage forward / backward call; (0, 0) if not calibrated."""
    fits = _fits(cluster.measurements)
    return fits.get("call.forward", 0.0), fits.get("call.backward", 0.0)


@dataclass(frozen=True)
class PerElementCost:
    """A fitted cost of fixed seconds plus seconds per element, forward and backward (zeros:
    not calibrated). Read once (per_element_cost) where it is priced many times."""

    forward: float = 0.0
    forward_per_element: float = 0.0
    backward: float = 0.0
    backward_per_element: float = 0.0

    def at(self, elements: float) -> tuple[float, float]:
        """(forward s, backward s) for `elements` elements; (0, 0) for none."""
        if elements <= 0:
            return 0.0, 0.0
        return (self.forward + self.forward_per_element * elements,
                self.backward + self.backward_per_element * elements)


def per_element_cost(cluster, prefix: str) -> PerElementCost:
    """fit.<prefix>forward, fit.<prefix>forward_per_element and the backward ones of `cluster`:
    prefix "loss." (the runtime's loss), "loss.vocab_" (what the vocabulary-parallel loss adds),
    "tensor_wrapper." or "tensor_embedding." (see the table above)."""
    fits = _fits(cluster.measurements)
    return PerElementCost(*(fits.get(f"{prefix}{p}", 0.0) for p in
                            ("forward", "forward_per_element", "backward", "backward_per_element")))


def loss_costs(cluster, elements: float) -> tuple[float, float]:
    """(forward s, backward s) of the runtime's loss over `elements` logits on the last stage
    (cross-entropy, read back, scaled), beyond the stage call; (0, 0) if not calibrated."""
    return per_element_cost(cluster, "loss.").at(elements)


def tensor_wrapper_costs(cluster, elements: float = 0.0) -> tuple[float, float]:
    """(forward s, backward s) a tensor-parallel layer pays for the wrapper around each of its
    in-layer all-reduces of `elements` values (the copy it reduces, the bias added after it),
    beyond the all-reduce; (0, 0) if not calibrated."""
    fit = per_element_cost(cluster, "tensor_wrapper.")
    return fit.at(elements) if elements > 0 else (fit.forward, fit.backward)


def tensor_embedding_costs(cluster, elements: float) -> tuple[float, float]:
    """(forward s, backward s) a vocabulary-parallel embedding with `elements` output values pays
    beyond the plain embedding and its all-reduce (masking the ids outside its rows, zeroing
    their rows of the output, the all-reduce's wrapper); (0, 0) if not calibrated."""
    return per_element_cost(cluster, "tensor_embedding.").at(elements)


def vocab_loss_costs(cluster, elements: float) -> tuple[float, float]:
    """(forward s, backward s) the vocabulary-parallel cross-entropy over `elements` logits of
    this rank pays beyond the plain loss on them, besides its three all-reduces; (0, 0) if not
    calibrated."""
    return per_element_cost(cluster, "loss.vocab_").at(elements)


def executor_costs(cluster) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """({op: s after a synchronous instruction}, {op: s issuing an asynchronous one},
    {"F" / "B": s a forward / backward instruction takes beyond its stage call}) of the runtime's
    executor (cost_models/calibration/executor.py); empty dicts if not calibrated."""
    fits = _fits(cluster.measurements)
    parts: tuple[dict[str, float], ...] = ({}, {}, {})
    names = ("executor.gap", "executor.issue", "executor.extra")
    for k, v in fits.items():
        head, _, op = k.rpartition(".")
        if head in names:
            parts[names.index(head)][op] = v
    return parts


def zero_grad_cost(cluster, tensors: int, nbytes: float) -> float:
    """Seconds of one ZERO_GRAD: `tensors` gradient tensors (or flat buckets) of `nbytes` in all;
    0 if not calibrated."""
    fits = _fits(cluster.measurements)
    return fits.get("zero_grad.per_tensor", 0.0) * tensors + fits.get("zero_grad.per_byte", 0.0) * nbytes


def after_reduce_costs(cluster) -> tuple[float, float]:
    """(optimizer s per byte, zeroing s per byte) that reading and zeroing gradients cost beyond
    the same on a rank's own buffer right after an all-reduce went through them; (0, 0) if
    not calibrated."""
    fits = _fits(cluster.measurements)
    return fits.get("after_reduce.optimizer_per_byte", 0.0), fits.get("after_reduce.zero_grad_per_byte", 0.0)


def overlap_hidden(cluster) -> float:
    """Share (-1..1) of an asynchronous collective's time hidden by compute running meanwhile
    (below 0: overlapping costs more than running the two one after the other); 1 (free
    overlap) when the cluster was not calibrated."""
    return min(max(_fits(cluster.measurements).get("comm.overlap_hidden", 1.0), -1.0), 1.0)


def optimizer_per_tensor(cluster, kind: str) -> float:
    """Seconds of fixed cost per parameter tensor of one `kind` optimizer step (sgd,
    sgd_momentum, adamw); 0 when the cluster was not calibrated for it."""
    return _fits(cluster.measurements).get(f"optimizer.{kind}.per_tensor", 0.0)


def optimizer_per_step(cluster, kind: str) -> float:
    """Seconds of fixed cost per call of one `kind` optimizer step; 0 when not calibrated for it."""
    return _fits(cluster.measurements).get(f"optimizer.{kind}.per_step", 0.0)


@functools.lru_cache(maxsize=64)
def _curves(measurements: tuple[tuple[str, object], ...]) -> dict[str, tuple[tuple, tuple]]:
    """{family: ((size, forward s) points, (size, backward s) points)} from raw.curve.<family>.<size>.<pass>."""
    table: dict[str, dict[float, dict[str, float]]] = {}
    for k, v in measurements:
        if not (k.startswith("raw.curve.") and isinstance(v, (int, float))):
            continue
        head, _, rest = k[len("raw.curve."):].partition(".")
        size, _, which = rest.rpartition(".")
        try:
            n = float(size)
        except ValueError:
            continue
        if which in ("forward", "backward"):
            table.setdefault(head, {}).setdefault(n, {})[which] = float(v)
    out = {}
    for fam, pts in table.items():
        full = sorted((n, p) for n, p in pts.items() if len(p) == 2)
        if full:
            out[fam] = (tuple((n, p["forward"]) for n, p in full), tuple((n, p["backward"]) for n, p in full))
    return out


def op_curves(cluster) -> dict[str, tuple[tuple, tuple]]:
    """The calibrated op curves of `cluster` (cost_models/op_curves.py), {} when it has none."""
    return _curves(cluster.measurements)


def curve_mix(cluster) -> tuple[float, float]:
    """(forward, backward) in-context factor for curve-priced ops; (1, 1) when not calibrated."""
    fits = _fits(cluster.measurements)
    return fits.get("curve_mix.forward", 1.0), fits.get("curve_mix.backward", 1.0)


def in_run_factors(cluster) -> tuple[float, float]:
    """(forward, backward) factor of a node's calibrated price in a training run over its price
    from the per-op timings (planner/app/calibrate_run.py); (1, 1) when not measured."""
    fits = _fits(cluster.measurements)
    return fits.get("in_run.forward", 1.0), fits.get("in_run.backward", 1.0)
