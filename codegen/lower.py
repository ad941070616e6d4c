"""`codegen.lower`: a Plan becomes one Program per rank, through small pure passes.

    schedule     per pipeline position, the F/B order (codegen/schedules.py); under the
                 bidirectional (GEMS) schedule a position holds stages i and p-1-i and the
                 micro-batch's parity says which direction (and so which rank) runs a stage
    p2p          receives posted one compute ahead and waited just before use; sends
                 issued right after the compute that makes them, waited at the end of
                 the pipeline (a send never blocks a rank mid-schedule, so the only
                 waits are on data the schedule has already ordered: no deadlock)
    zero3        (ZeRO-3) all-gather a stage's parameters before each of its F and B
    grad sync    after each stage's last backward, one collective per gradient bucket
                 (all-reduce; reduce-scatter under ZeRO), issued from inside that
                 backward; waited before the step (bidirectional: over the "pair" group,
                 positions i and p-1-i across every data rank, higher stage first)
    ties         a weight used by several stages (tied embeddings) has a copy in each;
                 once the gradient collectives are done, one all-reduce per tied weight
                 over the pipeline positions holding a copy sums the copies' gradients
    step         ZERO_GRAD first; STEP; ZeRO-1/2 parameter all-gathers; the loss
                 reduced over data and broadcast from the last stage, so every rank
                 reports the step's loss

Every pass is a function from a list of instructions to a new list; the
Program is assembled at the end. `check_programs` runs all ranks' Programs
against each other (sends matched with receives, collectives with their
groups) and reports a deadlock or a mismatch.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

from codegen.partition import Partition, partition
from codegen.schedules import ScheduleError, bidirectional, bidirectional_position, build_schedule
from planner.graph import ModelGraph
from planner.plan import Plan
from planner.subgraph import module_owners
from runtime.program import PAIR_AXIS, Bucket, Instr, Program, Tie, axis_group, coords_of, rank_of, tie_axis
from runtime.vocab import MeshAxis, element_bytes

DEFAULT_BUCKET_BYTES = 25 * 2**20


class LoweringError(ValueError):
    """A plan that cannot become Programs; the message names the reason."""


def make_buckets(stage: int, params, data: int, cap_bytes: int = DEFAULT_BUCKET_BYTES,
                 alone: frozenset[str] = frozenset(), decay_of: Callable[[int], bool] | None = None) -> list[Bucket]:
    """Group a stage's parameters (name, shape, dtype), already in gradient-ready order,
    into buckets closed once they reach `cap_bytes` (PyTorch DDP's rule: small parameters
    ride with the next large one instead of travelling alone). Parameters in `alone` (the
    copies of tied weights) get a bucket of their own: under ZeRO, each data rank then holds
    the same slice of every copy, and the copies' gradient shards can be summed.

    decay_of(ndim): the parameter's weight-decay class (runtime.optim.OptimizerSpec.decays), when
    the classes step differently: a bucket then holds one class only (a ZeRO flat shard of it is
    one optimizer group's), recorded as Bucket.decay; None: one class (Bucket.decay True)."""
    out, cur, numel, elem, cls = [], [], 0, 4, True
    for name, shape, dtype in params:
        n = 1
        for s in shape:
            n *= s
        this = decay_of(len(shape)) if decay_of is not None else True
        if cur and (name in alone or this != cls):
            out.append(_bucket(stage, cur, numel, elem, data, cls))
            cur, numel = [], 0
        elem, cls = element_bytes(dtype), this
        cur.append(name)
        numel += n
        if numel * elem >= cap_bytes or name in alone:
            out.append(_bucket(stage, cur, numel, elem, data, cls))
            cur, numel = [], 0
    if cur:
        out.append(_bucket(stage, cur, numel, elem, data, cls))
    return out


def _bucket(stage, names, numel, elem, data, decay: bool = True) -> Bucket:
    padded = -(-numel // data) * data
    return Bucket(stage, tuple(names), numel, padded * elem, decay)


# ---------------------------------------------------------------------------
# passes (pure: list in, list out)


def p2p_pass(actions: list[Instr], handles: Iterator[int], peer_of: Callable[[int], int], num_stages: int,
             act_bytes: dict[int, int], grad_bytes: dict[int, int]) -> list[Instr]:
    """Insert SEND/RECV/WAIT around compute actions.

    A message is named by the cut it crosses: "act s m" is stage s's output for
    micro-batch m (sent to stage s + 1), "grad s m" its gradient (sent back from
    stage s + 1). Both ends of a message carry the same stage and micro-batch.
    act_bytes[s] / grad_bytes[s]: bytes of stage s's output activations / of their
    gradients (0: nothing crosses). peer_of(s, m): global rank running stage s for
    micro-batch m (same data and tensor coordinates; the micro-batch matters only for the
    bidirectional schedule, whose two directions place a stage on different ranks).
    """
    def recv_for(a: Instr) -> Instr | None:
        if a.op == "F" and a.stage > 0 and act_bytes.get(a.stage - 1, 0):
            return Instr("RECV", a.stage - 1, a.micro, peer=peer_of(a.stage - 1, a.micro), kind="act",
                         handle=next(handles), nbytes=act_bytes[a.stage - 1])
        if a.op == "B" and a.stage < num_stages - 1 and grad_bytes.get(a.stage, 0):
            return Instr("RECV", a.stage, a.micro, peer=peer_of(a.stage + 1, a.micro), kind="grad",
                         handle=next(handles), nbytes=grad_bytes[a.stage])
        return None

    recvs = [recv_for(a) if a.op in ("F", "B") else None for a in actions]
    out: list[Instr] = []
    sends: list[int] = []
    if recvs and recvs[0] is not None:
        out.append(recvs[0])
    for k, a in enumerate(actions):
        if k + 1 < len(actions) and recvs[k + 1] is not None:
            out.append(recvs[k + 1])          # pre-posted: overlaps with this compute
        if recvs[k] is not None:
            out.append(Instr("WAIT", handle=recvs[k].handle))
        out.append(a)
        if a.op == "F" and a.stage < num_stages - 1 and act_bytes.get(a.stage, 0):
            h = next(handles)
            out.append(Instr("SEND", a.stage, a.micro, peer=peer_of(a.stage + 1, a.micro), kind="act", handle=h,
                             nbytes=act_bytes[a.stage]))
            sends.append(h)
        elif a.op == "B" and a.stage > 0 and grad_bytes.get(a.stage - 1, 0):
            h = next(handles)
            out.append(Instr("SEND", a.stage - 1, a.micro, peer=peer_of(a.stage - 1, a.micro), kind="grad", handle=h,
                             nbytes=grad_bytes[a.stage - 1]))
            sends.append(h)
    out += [Instr("WAIT", handle=h) for h in sends]
    return out


def zero3_pass(instrs: list[Instr], handles: Iterator[int], buckets: list[Bucket]) -> list[Instr]:
    """ZeRO-3: gather a stage's parameters right before each of its forwards and backwards."""
    out = []
    for ins in instrs:
        if ins.op in ("F", "B"):
            hs = []
            for b, bucket in enumerate(buckets):
                if bucket.stage == ins.stage:
                    h = next(handles)
                    out.append(Instr("ALLGATHER", ins.stage, kind="params", axis="data", handle=h, bucket=b,
                                     nbytes=bucket.nbytes))
                    hs.append(h)
            out += [Instr("WAIT", handle=h) for h in hs]
        out.append(ins)
    return out


def grad_sync_pass(instrs: list[Instr], handles: Iterator[int], buckets: list[Bucket], zero: int, *,
                   axis: str = "data", order: tuple[int, ...] | None = None) -> list[Instr]:
    """After each stage's last backward, one collective per bucket; their WAITs at the end.

    `order`: the stages in the order their collectives must be issued (every member of
    the group must issue them alike); a stage whose last backward comes before that of a
    stage ahead of it in `order` waits for it. None: in the order the last backwards run.
    `axis`: the group the gradients are reduced over ("data", or "pair" for GEMS).
    """
    last_b = {}
    for k, ins in enumerate(instrs):
        if ins.op == "B":
            last_b[ins.stage] = k
    queue = list(order) if order is not None else sorted(last_b, key=last_b.get)
    op = "REDUCESCATTER" if zero >= 1 else "ALLREDUCE"
    out, waits = [], []
    done: set[int] = set()     # stages whose last backward (and its SEND) is placed
    after: int | None = None   # stage whose last B's SEND is still to be placed
    for k, ins in enumerate(instrs):
        out.append(ins)
        if ins.op == "B" and last_b.get(ins.stage) == k:
            after = ins.stage
            if k + 1 < len(instrs) and instrs[k + 1].op == "SEND" and instrs[k + 1].kind == "grad":
                continue  # the gradient for the previous stage goes out first
        if after is not None:
            done.add(after)
            after = None
            while queue and queue[0] in done:
                stage = queue.pop(0)
                # buckets hold parameters last-layer-first, so bucket 0 is ready first
                for b, bucket in enumerate(buckets):
                    if bucket.stage == stage:
                        h = next(handles)
                        out.append(Instr(op, stage, kind="grads", axis=axis, handle=h, bucket=b,
                                         nbytes=bucket.nbytes))
                        waits.append(h)
    return out + [Instr("WAIT", handle=h) for h in waits]


def tie_pass(instrs: list[Instr], handles: Iterator[int], ties: list[Tie], nbytes: dict[int, int]) -> list[Instr]:
    """One ALLREDUCE tied per tied weight this rank holds, and its WAIT, after every other
    instruction of the step body (the gradient collectives' WAITs included): the copies'
    gradients are complete there, and the step that follows reads their sum."""
    out = list(instrs)
    for tie in ties:
        h = next(handles)
        out += [Instr("ALLREDUCE", kind="tied", axis=tie.axis, handle=h, bucket=tie.index, nbytes=nbytes[tie.index]),
                Instr("WAIT", handle=h)]
    return out


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


def stats_pass(instrs: list[Instr], handles: Iterator[int], stats: dict[int, int], axis: str) -> list[Instr]:
    """After the step, one ALLREDUCE stats per stage with BatchNorm running statistics
    (stats: stage -> bytes), over the gradient axis, and their WAITs: every rank then holds
    the mean of the data ranks' statistics."""
    out, waits = list(instrs), []
    for stage, nbytes in sorted(stats.items()):
        h = next(handles)
        out.append(Instr("ALLREDUCE", stage, kind="stats", axis=axis, handle=h, nbytes=nbytes))
        waits.append(Instr("WAIT", handle=h))
    return out + waits


def step_pass(instrs: list[Instr], handles: Iterator[int], buckets: list[Bucket], zero: int, *, is_last: bool,
              data: int, pipe: int, last_rank: int, loss_sum_over_pipe: bool = False) -> list[Instr]:
    """ZERO_GRAD, the body, STEP, ZeRO-1/2 parameter gathers, and the loss to every rank.

    The loss is complete after the last stage's last forward: its all-reduce over data is
    issued there (hidden behind the backwards) and waited at the end; the broadcast from
    the last stage to the other stages of its pipeline closes the step. With
    `loss_sum_over_pipe` (bidirectional: the last stage runs on two positions, each with
    its direction's share of the loss) an all-reduce over the pipeline replaces the broadcast.
    """
    body = list(instrs)
    tail: list[Instr] = []
    if is_last and data > 1:
        h = next(handles)
        last_stage = max(ins.stage for ins in body if ins.op == "F")
        last_f = max(k for k, ins in enumerate(body) if ins.op == "F" and ins.stage == last_stage)
        body.insert(last_f + 1, Instr("ALLREDUCE", kind="loss", axis="data", handle=h, nbytes=8))
        tail.append(Instr("WAIT", handle=h))
    out = [Instr("ZERO_GRAD"), *body, Instr("STEP")]
    if zero in (1, 2):
        hs = []
        for b, bucket in enumerate(buckets):
            h = next(handles)
            out.append(Instr("ALLGATHER", bucket.stage, kind="params", axis="data", handle=h, bucket=b,
                             nbytes=bucket.nbytes))
            hs.append(h)
        out += [Instr("WAIT", handle=h) for h in hs]
    out += tail
    if pipe > 1:
        h = next(handles)
        out += [Instr("ALLREDUCE", kind="loss", axis=MeshAxis.PIPELINE, handle=h, nbytes=8) if loss_sum_over_pipe else
                Instr("BROADCAST", kind="loss", axis=MeshAxis.PIPELINE, peer=last_rank, handle=h, nbytes=8),
                Instr("WAIT", handle=h)]
    return out


def _held(params, owners: dict[str, int], branch: int) -> list:
    """The (name, shape, dtype) of the parameters this rank holds: under sub-graph
    parallelism, not those of paths another sub-grid runs."""
    if not owners:
        return list(params)
    return [q for q in params if owners.get(q[0], owners.get(q[0].rsplit(".", 1)[0], branch)) == branch]


# ---------------------------------------------------------------------------
# driver


def lower(plan: Plan, graph: ModelGraph, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
          parts: Partition | None = None, decay_of: Callable[[int], bool] | None = None) -> dict[int, Program]:
    """One Program per rank for `plan` (ranks laid out pipe x data x tensor, tensor fastest).

    decay_of: the weight-decay class of a parameter by its dims, when buckets must not mix them
    (make_buckets).

    Raises LoweringError / PartitionError (ValueErrors) for plans that cannot run.
    """
    cfg = plan.config
    p, d, v = cfg.pipeline, cfg.data, cfg.virtual_stages
    bidi = cfg.bidirectional
    try:
        m = cfg.micro_batches(plan.global_batch_size)
    except ValueError as e:
        raise LoweringError(str(e)) from None
    if len(plan.stages) != cfg.num_stages:
        raise LoweringError(f"the plan has {len(plan.stages)} stages but its config needs {cfg.num_stages}")
    for st in plan.stages:
        if st.device_index != st.index % p:
            raise LoweringError(f"stage {st.index} is placed on pipeline position {st.device_index}; the runtime "
                                f"runs stage k on position k % pipeline ({st.index % p})")
    if parts is None:
        parts = partition(plan, graph)
    try:
        sched = bidirectional(p, cfg.replicas_per_direction) if bidi else build_schedule(cfg.schedule, p, m, v)
    except ScheduleError as e:
        raise LoweringError(str(e)) from None
    zero = cfg.zero if d > 1 else 0
    mesh = tuple(cfg.mesh.items())   # pipe, data, (branch), tensor
    # sub-graph parallelism: a rank holds only its sub-grid's paths (planner/subgraph.py)
    owners = module_owners(graph, plan.subgraph) if plan.subgraph else {}
    ns = cfg.num_stages
    specs = {sp.spec.index: sp for sp in parts.stages}
    act_bytes = {s: sum(b.nbytes for b in specs[s].spec.outputs) for s in range(ns)}
    grad_bytes = {s: sum(b.nbytes for b in specs[s].spec.outputs if b.requires_grad) for s in range(ns)}
    stats_bytes = {sp.spec.index: _stats_bytes(graph, sp.spec.running_stats) for sp in parts.stages}
    tied = find_ties(parts)
    alone = frozenset(name for copies in tied.values() for _s, name, _b in copies)
    tie_bytes = {k: copies[0][2] for k, copies in enumerate(tied.values())}

    def positions(stage: int) -> list[int]:
        return sorted({stage, p - 1 - stage}) if bidi else [stage % p]

    programs = {}
    for rank in range(cfg.num_devices):
        coords = coords_of(mesh, rank)
        i = coords[0]
        branch = dict(zip(cfg.mesh, coords)).get(MeshAxis.SUBGRAPH, 0)
        if bidi:
            # Position i holds stage i (replica A) and stage p-1-i (replica B); both ranks of the
            # pair {i, p-1-i} hold the same two stages and reduce them over the pair and the
            # data axis, higher stage first on both (so their collectives match).
            stages = tuple(sorted({i, p - 1 - i}))
            order: tuple[int, ...] | None = tuple(reversed(stages))
            grad_axis, group = PAIR_AXIS, len(axis_group(mesh, coords, PAIR_AXIS))
        else:
            stages = tuple(sorted(s for s in range(ns) if s % p == i))
            order, grad_axis, group = None, "data", d
        buckets = [b for s in (order or stages)
                   for b in make_buckets(s, _held(specs[s].params, owners, branch), group, bucket_bytes, alone,
                                          decay_of)] \
            if group > 1 else []
        ties = []
        for k, (key, copies) in enumerate(tied.items()):
            here = [(s, name) for s, name, _b in copies if s in stages]
            if not here:
                continue
            holders = sorted({q for s, _n, _b in copies for q in positions(s)})
            owned = tuple(s for s, _n in here if min(positions(s)) == i)
            ties.append(Tie(k, key, tuple(here), owned, tie_axis(holders)))
        handles = itertools.count()

        def peer_of(s: int, micro: int, _coords=coords) -> int:
            pos = bidirectional_position(s, micro, p) if bidi else s % p
            return rank_of(mesh, (pos, *_coords[1:]))

        instrs = p2p_pass(sched[i], handles, peer_of, ns, act_bytes, grad_bytes)
        if zero >= 3:
            instrs = zero3_pass(instrs, handles, buckets)
        if buckets:
            instrs = grad_sync_pass(instrs, handles, buckets, zero, axis=grad_axis, order=order)
        instrs = tie_pass(instrs, handles, ties, tie_bytes)
        instrs = step_pass(instrs, handles, buckets, zero, is_last=(ns - 1) in stages, data=d, pipe=p,
                           last_rank=rank_of(mesh, ((ns - 1) % p, *coords[1:])), loss_sum_over_pipe=bidi)
        if group > 1:
            instrs = stats_pass(instrs, handles, {s: stats_bytes[s] for s in (order or stages) if stats_bytes[s]},
                                grad_axis)
        programs[rank] = Program(rank=rank, world_size=cfg.num_devices, mesh=mesh, coords=coords, stages=stages,
                                 num_stages=ns, num_micro_batches=m, micro_batch_size=cfg.micro_batch_size,
                                 instrs=tuple(instrs), zero=zero, buckets=tuple(buckets), ties=tuple(ties))
    check_programs(programs)
    return programs


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
                if ins.op == "WAIT":
                    ready = pending.get((r, ins.handle))
                    if ready is None:
                        raise LoweringError(f"rank {r}: WAIT h{ins.handle} has no earlier instruction")
                    if not ready():
                        break
                    del pending[(r, ins.handle)]
                elif ins.op == "SEND":
                    key = (r, ins.peer, ins.kind, ins.stage, ins.micro)
                    sent.add(key)
                    pending[(r, ins.handle)] = lambda: True
                elif ins.op == "RECV":
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


__all__ = ["DEFAULT_BUCKET_BYTES", "LoweringError", "check_programs", "find_ties", "grad_sync_pass", "lower",
           "make_buckets", "p2p_pass", "stats_pass", "step_pass", "tie_pass", "zero3_pass"]
