"""Per-op tensor-parallel sharding of one layer as an integer program (OR-Tools CP-SAT).

Each sharding region (a column -> row group, or a vocabulary-split
embedding, from planner.strategies.tensor.sharding) is a choice: run its ops on 1/t of the
features, or replicate them. One Boolean per region; every op of a region
takes the region's choice, so the choice variables are per op in effect.
Edge variables mark graph edges whose two ends disagree (a sharded op next
to a replicated one); such an edge pays the resharding collective: the
forward all-reduce where a row-parallel output rejoins the replicated
stream, the backward all-reduce of the input gradient where the stream
enters a column-parallel op. A memory constraint caps the per-device bytes
of the layer. The objective is compute + communication + resharding time.

Repeated layers share a signature, so the evaluator solves once per
(signature, tensor degree, micro-batch, dtype) and reuses the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

# CP-SAT wants integers: time in nanoseconds, memory in KiB.
_NS = 1e9
_KIB = 1024.0


@dataclass(frozen=True)
class RegionOption:
    """What one region costs per device, replicated or sharded (seconds, bytes)."""

    region: int
    time_replicated: float
    time_sharded: float
    bytes_replicated: float
    bytes_sharded: float


@dataclass(frozen=True)
class Edge:
    """A graph edge between two regions (-1 = the always-replicated rest) and its resharding cost (s)."""

    a: int
    b: int
    cost: float


def choose_shardings(options: list[RegionOption], edges: list[Edge],
                     memory_cap: float | None = None) -> tuple[frozenset[int], bool]:
    """Regions to shard, minimizing time under the memory cap.

    Returns (sharded regions, optimal). When no choice fits the cap, the
    memory-minimal choice is returned with optimal=False.
    """
    if not options:
        return frozenset(), True
    # imported here, not with the module: every meshplan command and `import planner` load this module, and
    # only a search solves (OR-Tools takes 0.2-0.35 s to import)
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    x = {o.region: model.NewBoolVar(f"shard_r{o.region}") for o in options}
    terms = []
    base = 0
    for o in options:
        rep, sh = round(o.time_replicated * _NS), round(o.time_sharded * _NS)
        base += rep
        terms.append((sh - rep) * x[o.region])
    for k, e in enumerate(edges):
        if e.cost <= 0:
            continue
        xa = x.get(e.a, 0)
        xb = x.get(e.b, 0)
        y = model.NewBoolVar(f"reshard_e{k}")
        model.Add(y >= xa - xb)
        model.Add(y >= xb - xa)
        terms.append(round(e.cost * _NS) * y)
    if memory_cap is not None:
        mem = sum(round(o.bytes_replicated / _KIB) for o in options)
        model.Add(mem + sum(round((o.bytes_sharded - o.bytes_replicated) / _KIB) * x[o.region]
                            for o in options) <= int(memory_cap / _KIB))
    model.Minimize(sum(terms) + base)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 10.0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # Nothing fits the cap: shard whatever saves memory.
        return frozenset(o.region for o in options if o.bytes_sharded < o.bytes_replicated), False
    chosen = frozenset(r for r, v in x.items() if solver.Value(v))
    return chosen, status == cp_model.OPTIMAL
