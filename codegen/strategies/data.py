"""Data parallelism and ZeRO 1/2/3 in the lowering: gradient buckets and their collectives.

Replicas of a stage (the data axis, or the bidirectional pair group that the placement names)
reduce its gradients bucket by bucket:

    PARAMS      (ZeRO-3) all-gather a stage's parameters before each of its F and B
    GRADS       after each stage's last backward, one collective per gradient bucket (all-reduce;
                reduce-scatter under ZeRO), issued from inside that backward; waited before the step
    STEP        the loss all-reduced over data after the last stage's last forward (waited at the
                end); ZeRO-1/2: every bucket's parameters all-gathered after the step
    AFTER_STEP  BatchNorm running statistics averaged over the gradient group
"""

from __future__ import annotations

from typing import Callable, Iterator

from codegen.strategies.base import Lowering, LoweringStrategy, Pass, Phase, Params, RankPlan
from planner.plan import Plan
from runtime.program.instr_set import Kind, Op
from runtime.program import Bucket, Instr
from runtime.vocab import MeshAxis, StrategyName, element_bytes

DEFAULT_BUCKET_BYTES = 25 * 2**20


def make_buckets(stage: int, params, data: int, cap_bytes: int = DEFAULT_BUCKET_BYTES,
                 alone: frozenset[str] = frozenset(), decay_of: Callable[[int], bool] | None = None) -> list[Bucket]:
    """Group a stage's parameters (name, shape, dtype), already in gradient-ready order,
    into buckets closed once they reach `cap_bytes` (PyTorch DDP's rule: small parameters
    ride with the next large one instead of travelling alone). Parameters in `alone` (the
    copies of tied weights) get a bucket of their own: under ZeRO, each data rank then holds
    the same slice of every copy, and the copies' gradient shards can be summed.

    decay_of(ndim): the parameter's weight-decay class (runtime.execute.optim.OptimizerSpec.decays), when
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


def zero3_pass(instrs: list[Instr], handles: Iterator[int], buckets: list[Bucket]) -> list[Instr]:
    """ZeRO-3: gather a stage's parameters right before each of its forwards and backwards."""
    out = []
    for ins in instrs:
        if ins.op in (Op.F, Op.B):
            hs = []
            for b, bucket in enumerate(buckets):
                if bucket.stage == ins.stage:
                    h = next(handles)
                    out.append(Instr(Op.ALLGATHER, ins.stage, kind=Kind.PARAMS, axis=MeshAxis.DATA, handle=h, bucket=b,
                                     nbytes=bucket.nbytes))
                    hs.append(h)
            out += [Instr(Op.WAIT, handle=h) for h in hs]
        out.append(ins)
    return out


def grad_sync_pass(instrs: list[Instr], handles: Iterator[int], buckets: list[Bucket], zero: int, *,
                   axis: str = MeshAxis.DATA, order: tuple[int, ...] | None = None) -> list[Instr]:
    """After each stage's last backward, one collective per bucket; their WAITs at the end.

    `order`: the stages in the order their collectives must be issued (every member of
    the group must issue them alike); a stage whose last backward comes before that of a
    stage ahead of it in `order` waits for it. None: in the order the last backwards run.
    `axis`: the group the gradients are reduced over (data, or the bidirectional pair group).
    """
    last_b = {}
    for k, ins in enumerate(instrs):
        if ins.op == Op.B:
            last_b[ins.stage] = k
    queue = list(order) if order is not None else sorted(last_b, key=last_b.get)
    op = "REDUCESCATTER" if zero >= 1 else "ALLREDUCE"
    out, waits = [], []
    done: set[int] = set()     # stages whose last backward (and its SEND) is placed
    after: int | None = None   # stage whose last B's SEND is still to be placed
    for k, ins in enumerate(instrs):
        out.append(ins)
        if ins.op == Op.B and last_b.get(ins.stage) == k:
            after = ins.stage
            if k + 1 < len(instrs) and instrs[k + 1].op == Op.SEND and instrs[k + 1].kind == Kind.GRAD:
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
                        out.append(Instr(op, stage, kind=Kind.GRADS, axis=axis, handle=h, bucket=b,
                                         nbytes=bucket.nbytes))
                        waits.append(h)
    return out + [Instr(Op.WAIT, handle=h) for h in waits]


def loss_and_gather_pass(instrs: list[Instr], handles: Iterator[int], buckets: list[Bucket], zero: int, *,
                         reduce_loss: bool) -> list[Instr]:
    """The step's data-parallel part, on a list that ends with STEP.

    reduce_loss (this rank runs the last stage and data > 1): the loss is complete after the last
    stage's last forward; its all-reduce over data is issued there (hidden behind the backwards)
    and waited at the end. ZeRO-1/2: every bucket's parameters all-gathered after the step.
    """
    out = list(instrs)
    tail: list[Instr] = []
    if reduce_loss:
        h = next(handles)
        last_stage = max(ins.stage for ins in out if ins.op == Op.F)
        last_f = max(k for k, ins in enumerate(out) if ins.op == Op.F and ins.stage == last_stage)
        out.insert(last_f + 1, Instr(Op.ALLREDUCE, kind=Kind.LOSS, axis=MeshAxis.DATA, handle=h, nbytes=8))
        tail.append(Instr(Op.WAIT, handle=h))
    if zero in (1, 2):
        hs = []
        for b, bucket in enumerate(buckets):
            h = next(handles)
            out.append(Instr(Op.ALLGATHER, bucket.stage, kind=Kind.PARAMS, axis=MeshAxis.DATA, handle=h, bucket=b,
                             nbytes=bucket.nbytes))
            hs.append(h)
        out += [Instr(Op.WAIT, handle=h) for h in hs]
    return out + tail


def stats_pass(instrs: list[Instr], handles: Iterator[int], stats: dict[int, int], axis: str) -> list[Instr]:
    """After the step, one ALLREDUCE stats per stage with BatchNorm running statistics
    (stats: stage -> bytes), over the gradient axis, and their WAITs: every rank then holds
    the mean of the data ranks' statistics."""
    out, waits = list(instrs), []
    for stage, nbytes in sorted(stats.items()):
        h = next(handles)
        out.append(Instr(Op.ALLREDUCE, stage, kind=Kind.STATS, axis=axis, handle=h, nbytes=nbytes))
        waits.append(Instr(Op.WAIT, handle=h))
    return out + waits


class Data(LoweringStrategy):
    """Data parallelism with ZeRO 1/2/3: every plan reduces its replicas' gradients, over the
    group the placement names (a group of one reduces nothing)."""

    name = StrategyName.DATA

    def active(self, plan: Plan) -> bool:
        return True

    def plan_rank(self, lw: Lowering, rp: RankPlan, held: Callable[[int], Params]) -> RankPlan:
        if rp.grad_group <= 1:
            return rp
        alone = frozenset(name for copies in lw.tied.values() for _s, name, _b in copies)
        return rp.replace(buckets=tuple(b for s in (rp.grad_order or rp.stages)
                                        for b in make_buckets(s, held(s), rp.grad_group, lw.bucket_bytes, alone,
                                                              lw.decay_of)))

    def passes(self, lw: Lowering, rp: RankPlan) -> list[tuple[Phase, Pass]]:
        buckets = list(rp.buckets)
        out: list[tuple[Phase, Pass]] = []
        if lw.zero >= 3:
            out.append((Phase.PARAMS, lambda ins, h: zero3_pass(ins, h, buckets)))
        if buckets:
            out.append((Phase.GRADS, lambda ins, h: grad_sync_pass(ins, h, buckets, lw.zero, axis=rp.grad_axis,
                                                                   order=rp.grad_order)))
        reduce_loss = (lw.num_stages - 1) in rp.stages and lw.plan.config.data > 1
        out.append((Phase.STEP, lambda ins, h: loss_and_gather_pass(ins, h, buckets, lw.zero,
                                                                    reduce_loss=reduce_loss)))
        if rp.grad_group > 1:
            stats = {s: lw.stats_bytes[s] for s in (rp.grad_order or rp.stages) if lw.stats_bytes[s]}
            out.append((Phase.AFTER_STEP, lambda ins, h: stats_pass(ins, h, stats, rp.grad_axis)))
        return out


__all__ = ["DEFAULT_BUCKET_BYTES", "Data", "grad_sync_pass", "loss_and_gather_pass", "make_buckets", "stats_pass",
           "zero3_pass"]
