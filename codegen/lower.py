"""`codegen.lower`: a Plan becomes one Program per rank.

The driver knows no strategy by name: the strategies the plan uses (codegen/strategies/
registry.py) say which plan is lowered and how its stage modules are rewritten, which stages
each rank runs and in which order (the plan's one Placement: pipeline or bidirectional), and
which passes, each a pure function from a list of instructions to a new list, act at each
phase of the step (codegen.strategies.base.Phase):

    COMPUTE      point-to-point messages around the schedule's forwards and backwards
    PARAMS       parameter gathers before compute (ZeRO-3)
    GRADS        gradient collectives after each stage's last backward
    TIES         sums of tied weights' copies
    STEP         ZERO_GRAD first and STEP last (the driver), then the loss to every rank and
                 ZeRO-1/2 parameter gathers
    AFTER_STEP   BatchNorm running statistics

The Program is assembled at the end. `check_programs` runs all ranks' Programs against each
other (sends matched with receives, collectives with their groups) and reports a deadlock or a
mismatch.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable

from codegen.partition import Partition, partition
from codegen.strategies import registry
from codegen.strategies.base import Lowering, LoweringError, LoweringStrategy, Params, Phase, Placement, RankPlan
from codegen.strategies.data import DEFAULT_BUCKET_BYTES
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.program.instr_set import Op
from runtime.program import Instr, Program, coords_of
from runtime.vocab import element_bytes


def _stats_bytes(graph: ModelGraph, names: tuple[str, ...]) -> int:
    """Bytes of the running statistics `names` (float32, sized from the module that holds them)."""
    total = 0
    for name in names:
        obj = graph.module
        for part in name.split("."):
            obj = getattr(obj, part)
        total += obj.numel() * obj.element_size()
    return total


def find_ties(parts: Partition) -> dict[str, list[tuple[int, str, int]]]:
    """Tied weights held by more than one stage: canonical name -> [(stage, local name, bytes)].

    Raises LoweringError when the copies' local shapes differ (their tensor-parallel splits
    disagree, so their gradients cannot be summed)."""
    held: dict[str, list[tuple[int, str, int]]] = {}
    shapes: dict[str, set] = {}
    for sp in parts.stages:
        for name, shape, dtype in sp.params:
            if not any(name in g for g in sp.spec.shared):
                continue
            key = sp.spec.canonical(name)
            numel = 1
            for d in shape:
                numel *= d
            held.setdefault(key, []).append((sp.spec.index, name, numel * element_bytes(dtype)))
            shapes.setdefault(key, set()).add(tuple(shape))
    for key, sh in shapes.items():
        if len(sh) > 1 and len(held[key]) > 1:
            raise LoweringError(f"tied weight {key} has copies of different local shapes {sorted(sh)}: the "
                                "tensor-parallel split of its users differs, so their gradients cannot be summed")
    return {k: v for k, v in sorted(held.items()) if len(v) > 1}


# ---------------------------------------------------------------------------
# driver


def lower_plan(plan: Plan, graph: ModelGraph, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               parts: Partition | None = None,
               decay_of: Callable[[int], bool] | None = None) -> tuple[Partition, dict[int, Program]]:
    """(the stage modules, one Program per rank) for `plan`, ranks laid out as its mesh (tensor fastest).

    parts: the stage modules of the lowered plan, when already cut (None: cut here and rewritten by
    the plan's strategies). decay_of: the weight-decay class of a parameter by its dims, when
    buckets must not mix them (codegen.strategies.data.make_buckets).

    Raises LoweringError / PartitionError (ValueErrors) for plans that cannot run.
    """
    strategies = registry.active(plan)
    lowered = functools.reduce(lambda q, s: s.lowered_plan(q), strategies, plan)
    cfg = lowered.config
    try:
        m = cfg.micro_batches(lowered.global_batch_size)
    except ValueError as e:
        raise LoweringError(str(e)) from None
    if len(lowered.stages) != cfg.num_stages:
        raise LoweringError(f"the plan has {len(lowered.stages)} stages but its config needs {cfg.num_stages}")
    for st in lowered.stages:
        if st.device_index != st.index % cfg.pipeline:
            raise LoweringError(f"stage {st.index} is placed on pipeline position {st.device_index}; the runtime "
                                f"runs stage k on position k % pipeline ({st.index % cfg.pipeline})")
    if parts is None:
        options = {k: v for s in strategies for k, v in s.partition_options(plan, graph).items()}
        makers = tuple(mk for s in strategies if (mk := s.stage_code(plan, graph)) is not None)
        parts = functools.reduce(lambda q, s: s.rewrite_stages(plan, graph, q), strategies,
                                 partition(lowered, graph, stage_code=makers, **options))
    outs = {sp.spec.index: sp.spec.outputs for sp in parts.stages}
    lw = Lowering(plan=lowered, graph=graph, parts=parts, num_micro_batches=m, zero=cfg.zero if cfg.data > 1 else 0,
                  act_bytes={s: sum(b.nbytes for b in outs[s]) for s in range(cfg.num_stages)},
                  grad_bytes={s: sum(b.nbytes for b in outs[s] if b.requires_grad) for s in range(cfg.num_stages)},
                  stats_bytes={sp.spec.index: _stats_bytes(graph, sp.spec.running_stats) for sp in parts.stages},
                  tied=find_ties(parts), bucket_bytes=bucket_bytes, decay_of=decay_of)
    place = registry.placement(strategies)
    sched = place.schedule(lw)
    filters = [s.param_filter(lw) for s in strategies]
    programs = {rank: functools.reduce(lambda q, s: s.finish_program(plan, graph, q), strategies,
                                       _rank_program(lw, strategies, place, filters, sched, rank))
                for rank in range(cfg.num_devices)}
    check_programs(programs)
    return parts, programs


def _rank_program(lw: Lowering, strategies: tuple[LoweringStrategy, ...], place: Placement,
                  filters: list[Callable[[RankPlan, Params], Params]], sched: dict[int, list[Instr]],
                  rank: int) -> Program:
    """Rank `rank`'s Program: the placement fills in its RankPlan first, the other strategies after,
    and their passes run phase by phase on its position's schedule, ZERO_GRAD and STEP around
    the body once the phases before Phase.STEP are done."""
    specs = lw.stage_parts
    where = RankPlan(rank, coords_of(lw.mesh, rank))

    def held(stage: int) -> Params:
        return functools.reduce(lambda params, f: f(where, params), filters, list(specs[stage].params))

    rp = place.plan_rank(lw, where, held)
    for s in strategies:
        if s is not place:
            rp = s.plan_rank(lw, rp, held)
    passes = sorted(((phase, k, fn) for k, s in enumerate(strategies) for phase, fn in s.passes(lw, rp)),
                    key=lambda x: x[:2])
    handles = itertools.count()
    instrs = functools.reduce(lambda ins, x: x[2](ins, handles), (x for x in passes if x[0] < Phase.STEP),
                              list(sched[rp.position]))
    instrs = functools.reduce(lambda ins, x: x[2](ins, handles), (x for x in passes if x[0] >= Phase.STEP),
                              [Instr(Op.ZERO_GRAD), *instrs, Instr(Op.STEP)])
    cfg = lw.plan.config
    return Program(rank=rank, world_size=cfg.num_devices, mesh=lw.mesh, coords=rp.coords, stages=rp.stages,
                   num_stages=cfg.num_stages, num_micro_batches=lw.num_micro_batches,
                   micro_batch_size=cfg.micro_batch_size, instrs=tuple(instrs), zero=lw.zero, buckets=rp.buckets,
                   ties=rp.ties)


def lower(plan: Plan, graph: ModelGraph, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
          parts: Partition | None = None, decay_of: Callable[[int], bool] | None = None) -> dict[int, Program]:
    """One Program per rank for `plan` (lower_plan's Programs)."""
    return lower_plan(plan, graph, bucket_bytes=bucket_bytes, parts=parts, decay_of=decay_of)[1]


# ---------------------------------------------------------------------------
# consistency check: run every rank's Program symbolically


def check_programs(programs: dict[int, Program]) -> None:
    """Raise LoweringError if the Programs deadlock or disagree.

    Sends never block; a receive's WAIT completes once the matching send was issued; a
    collective's WAIT completes once every member of its group has issued the same
    collective (same op, kind, stage, bucket) as its n-th collective on that group.
    """
    pcs = {r: 0 for r in programs}
    sent: set[tuple] = set()
    coll_seq: dict[tuple[int, int], list] = {}   # (rank, group id) -> issued collectives in order
    group_ids: dict[tuple, tuple[int, tuple]] = {}  # group's ranks -> (group id, group's ranks)
    pending: dict[tuple[int, int], Callable[[], bool]] = {}
    remaining = sum(len(p.instrs) for p in programs.values())
    while remaining:
        progressed = False
        for r, prog in programs.items():
            while pcs[r] < len(prog.instrs):
                ins = prog.instrs[pcs[r]]
                if ins.op == Op.WAIT:
                    ready = pending.get((r, ins.handle))
                    if ready is None:
                        raise LoweringError(f"rank {r}: WAIT h{ins.handle} has no earlier instruction")
                    if not ready():
                        break
                    del pending[(r, ins.handle)]
                elif ins.op == Op.SEND:
                    key = (r, ins.peer, ins.kind, ins.stage, ins.micro)
                    sent.add(key)
                    pending[(r, ins.handle)] = lambda: True
                elif ins.op == Op.RECV:
                    key = (ins.peer, r, ins.kind, ins.stage, ins.micro)
                    pending[(r, ins.handle)] = lambda key=key: key in sent
                elif ins.is_async:
                    # Keyed by a small id: hashing the group's tuple of ranks on every look-up made
                    # this check cubic in the world size (minutes at 1024 ranks).
                    group = prog.group(ins.axis)
                    group = group_ids.setdefault(group, (len(group_ids), group))
                    seq = coll_seq.setdefault((r, group[0]), [])
                    n = len(seq)
                    what = (ins.op, ins.kind, ins.stage, ins.bucket)   # a tied weight: its global index
                    seq.append(what)

                    def ready(group=group, n=n, what=what, r=r):
                        gid, members = group
                        for q in members:
                            s = coll_seq.get((q, gid), [])
                            if len(s) <= n:
                                return False
                            if s[n] != what:
                                raise LoweringError(f"ranks {r} and {q} disagree on collective #{n} of group "
                                                    f"{list(members)}: {what} vs {s[n]}")
                        return True
                    pending[(r, ins.handle)] = ready
                pcs[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(programs[r].instrs[pcs[r]]) for r in programs if pcs[r] < len(programs[r].instrs)}
            raise LoweringError(f"the Programs deadlock; ranks wait at: {stuck}")


__all__ = ["DEFAULT_BUCKET_BYTES", "LoweringError", "check_programs", "find_ties", "lower", "lower_plan"]
