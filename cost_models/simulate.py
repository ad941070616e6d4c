"""Discrete-event simulation of the Programs of all ranks: the predicted Timeline.

Compute instructions take their cost-model time (per stage and
micro-batch); a SEND and its matching RECV complete together, p2p time after
the later of the two was issued; a collective starts when every member of
its group has issued it and takes the communication model's time; WAIT
blocks until its handle completes. Overlap is modelled where the runtime
overlaps: gradient collectives placed right after a stage's last backward
are issued from inside that backward as their buckets become ready (bucket j
of n at (j + 1) / n of the way through it); on a calibrated cluster the
overlapped part of each, times the share the overlap does not hide
(fit.comm.overlap_hidden: the communicator's threads compete with the compute
for the cores), lengthens that backward.

A set of Programs that can never finish (a RECV with no SEND, collectives
issued in different orders) raises SimulationDeadlock naming every rank's
blocked instruction, instead of hanging.

How the simulated step relates to the planner's analytic one
(planner.evaluate, tests/unit/test_simulate_vs_analytic.py): without a
pipeline they agree to well under 5% (same compute, same collectives, the same
bucket-by-bucket overlap). With a pipeline the analytic step is
(m + p - 1) x the slowest device's slot, and it charges the activation and
gradient p2p of every micro-batch synchronously inside every slot. Both are
upper bounds of what the Programs do: fill and drain run the *other* stages
(cheaper when stages are unbalanced), and the runtime's sends and receives
are asynchronous (posted a compute ahead), so p2p is exposed only on the
fill/drain dependency path. :func:`flow_shop_step_time` is the closed form of
that behaviour; the simulator agrees with it within 5% on every schedule,
and lies at or below the analytic step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.calibrated import (after_reduce_costs, call_overheads, executor_costs, loss_costs, overlap_hidden,
                                    vocab_loss_costs, zero_grad_cost)
from cost_models.comm import collective_time
from cost_models.hardware import Cluster
from runtime.program.instr_set import Op
from runtime.program import COLLECTIVE_OPS, Instr, Program
from runtime.program.trace import Event, Timeline
from runtime.vocab import Collective, DeviceKind

_COLLECTIVE_NAMES = {Op.ALLREDUCE: Collective.ALL_REDUCE, Op.ALLGATHER: Collective.ALL_GATHER,
                     Op.REDUCESCATTER: Collective.REDUCE_SCATTER, Op.BROADCAST: Collective.BROADCAST}


class SimulationDeadlock(RuntimeError):
    """The Programs wait on each other forever; the message lists what each blocked rank waits for."""


@dataclass(frozen=True)
class ComputeCosts:
    """Seconds of compute per instruction kind.

    forward[s], backward[s]: one micro-batch of stage s (tensor-parallel
    collectives inside the stage included, as the cost model prices them).
    optimizer: one STEP. zero_grad: one ZERO_GRAD.
    gap[op]: the executor's time after a synchronous instruction `op` before the next starts;
    issue[op]: the time an asynchronous instruction `op` occupies its rank while it is issued
    (a collective without its own figure takes ALLREDUCE's). Both 0 when absent.
    """

    forward: dict[int, float]
    backward: dict[int, float]
    optimizer: float = 0.0
    zero_grad: float = 0.0
    gap: dict[str, float] = field(default_factory=dict)
    issue: dict[str, float] = field(default_factory=dict)

    def issue_time(self, op: str) -> float:
        return self.issue.get(op, self.issue.get("ALLREDUCE", 0.0) if op in COLLECTIVE_OPS else 0.0)

    @classmethod
    def from_prediction(cls, prediction, cluster: Cluster | None = None, *, loss_elements: float = 0.0,
                        grad_tensors: int = 0, grad_bytes: float = 0.0, vocab_split: tuple[float, int] | None = None,
                        reduced_grad_bytes: float = 0.0) -> "ComputeCosts":
        """Per-stage times from a planner Prediction (its StagePrediction entries).

        With a calibrated `cluster`, the runtime's fixed costs that the planner's per-op sums
        leave out (cost_models/calibrated.py, measured by cost_models/calibration/stage.py and
        cost_models/calibration/executor.py) are added: each stage call pays the cost of one
        forward / backward call (entering the stage, starting the autograd engine) and the
        executor's extra inside it; the last stage also computes the loss over
        `loss_elements` logits per micro-batch (this rank's share). With `vocab_split` = (rows
        of logits, tensor degree t > 1) the logits are split by class over t ranks and the loss
        is the vocabulary-parallel one: what it adds to the plain loss, and its three
        all-reduces of one value per row (the row maximum, the target logit, the sum of
        exponentials), go into the last stage's forward. A ZERO_GRAD zeroes `grad_tensors`
        tensors of `grad_bytes` in all; `reduced_grad_bytes` of them went through a gradient
        all-reduce in the step, which makes reading them (STEP) and zeroing them cost more
        (fit.after_reduce.*). This is why the simulated step is longer than the planner's
        analytic one on small models. The executor's time between instructions (gap) and
        issuing asynchronous ones (issue) comes from the cluster too."""
        if cluster is None or cluster.device.kind == DeviceKind.GPU:
            # a GPU's stage times already take the host's dispatch into account where it is longer
            # (planner.evaluate), as does the optimizer phase
            return cls(forward={s.index: s.forward for s in prediction.stages},
                       backward={s.index: s.backward for s in prediction.stages},
                       optimizer=prediction.time.optimizer)
        call_f, call_b = call_overheads(cluster)
        last = max(s.index for s in prediction.stages)
        loss_f, loss_b = loss_costs(cluster, loss_elements)
        if vocab_split is not None and vocab_split[1] > 1:
            rows, t = vocab_split
            vf, vb = vocab_loss_costs(cluster, loss_elements)
            reduce = collective_time(cluster, Collective.ALL_REDUCE, 4.0 * rows, list(range(t))).seconds
            loss_f, loss_b = loss_f + vf + 3 * reduce, loss_b + vb
        gap, issue, extra = executor_costs(cluster)
        call_f, call_b = call_f + extra.get("F", 0.0), call_b + extra.get("B", 0.0)
        read, zero = after_reduce_costs(cluster)
        return cls(forward={s.index: s.forward + call_f + (loss_f if s.index == last else 0.0)
                            for s in prediction.stages},
                   backward={s.index: s.backward + call_b + (loss_b if s.index == last else 0.0)
                             for s in prediction.stages},
                   optimizer=prediction.time.optimizer + read * reduced_grad_bytes, gap=gap, issue=issue,
                   zero_grad=zero_grad_cost(cluster, grad_tensors, grad_bytes) + zero * reduced_grad_bytes)


@dataclass
class _Rank:
    program: Program
    pc: int = 0
    now: float = 0.0
    rep: int = 0                                                 # which of the simulated steps
    handles: dict[tuple, float] = field(default_factory=dict)    # (rep, handle) -> completion time
    pending: dict[tuple, tuple] = field(default_factory=dict)    # (rep, handle) -> match key
    last_backward: tuple[float, float, int] | None = None        # (start, end, stage)
    after_backward: int = 0                                      # grads collectives issued since it
    backward_event: int = -1                                     # index in events of that backward
    events: list[Event] = field(default_factory=list)
    comm: list[tuple[int, tuple]] = field(default_factory=list)  # (event index, (rep, handle)) of async events


def simulate(programs: dict[int, Program] | list[Program], costs: ComputeCosts, cluster: Cluster,
             *, step: int = 0, steps: int = 1) -> Timeline:
    """The predicted Timeline of `steps` steps of `programs` on `cluster`, numbered from `step`.

    With steps > 1 each rank starts its next step as soon as it finishes its last one, so a
    rank that finishes early (a pipeline's last stage) waits inside the next step for what
    the others still send it, as in a real run: a later step's span is the steady-state one."""
    if steps < 1:
        raise ValueError(f"simulate needs steps >= 1, got {steps}")
    progs = sorted(programs.values() if isinstance(programs, dict) else programs, key=lambda p: p.rank)
    if not progs:
        raise ValueError("simulate needs at least one Program")
    world = progs[0].world_size
    if {p.rank for p in progs} != set(range(world)):
        raise ValueError(f"simulate needs the Programs of all {world} ranks, got ranks {[p.rank for p in progs]}")
    if cluster.num_devices < world:
        raise ValueError(f"the Programs use {world} ranks but cluster {cluster.name!r} has {cluster.num_devices} devices")
    ranks = {p.rank: _Rank(p) for p in progs}
    issued: dict[tuple, dict[int, tuple[float, int]]] = {}   # match key -> {rank: (issue time, handle)}
    members: dict[tuple, tuple[int, ...]] = {}
    roots: dict[tuple, int] = {}                                # broadcast match key -> its root
    durations: dict[tuple, float] = {}

    def complete(key: tuple) -> None:
        who = issued[key]
        if set(who) != set(members[key]):
            return
        end = max(t for t, _ in who.values()) + durations[key]
        root = roots.get(key)
        for r, (start, handle) in who.items():
            # a broadcast's root only sends: it is done once its data is out, whenever the
            # others arrive; a receiver waits for the root
            ranks[r].handles[handle] = start + durations[key] if r == root else \
                max(start, who[root][0]) + durations[key] if root is not None else end
            ranks[r].pending.pop(handle, None)
        del issued[key]

    while True:
        progressed = False
        for st in ranks.values():
            while st.pc < len(st.program.instrs):
                ins = st.program.instrs[st.pc]
                if not _step(st, ins, costs, cluster, issued, members, durations, complete, step + st.rep, roots):
                    break
                st.pc += 1
                progressed = True
                if st.pc == len(st.program.instrs) and st.rep + 1 < steps:
                    st.rep, st.pc, st.last_backward = st.rep + 1, 0, None
        if all(st.pc == len(st.program.instrs) for st in ranks.values()):
            break
        if not progressed:
            blocked = [f"rank {r}: #{st.pc} {st.program.instrs[st.pc]}" for r, st in ranks.items()
                       if st.pc < len(st.program.instrs)]
            raise SimulationDeadlock("the Programs can never finish; blocked on\n  " + "\n  ".join(blocked))
    for st in ranks.values():
        for k, handle in st.comm:
            e = st.events[k]
            st.events[k] = Event(e.rank, e.step, e.index, e.name, e.op, e.start, st.handles[handle], e.track)
    events = tuple(sorted((e for st in ranks.values() for e in st.events), key=lambda e: (e.start, e.rank)))
    return Timeline(events, source="predicted")


def simulate_steady(programs: dict[int, Program] | list[Program], costs: ComputeCosts, cluster: Cluster,
                    *, warm: int = 2) -> Timeline:
    """One step in steady state: the step after `warm` steps run back to back (simulate with
    steps = warm + 1), its times from its first event's start, numbered step 0.

    This is what a traced run's step after the first looks like: ranks do not start a step
    together (a pipeline's first stage starts late, as it waits for the last stage's loss at
    the end of the previous step), and the span of a step includes that skew."""
    tl = simulate(programs, costs, cluster, steps=warm + 1)
    last = [e for e in tl.events if e.step == warm]
    t0 = min(e.start for e in last)
    return Timeline(tuple(Event(e.rank, 0, e.index, e.name, e.op, e.start - t0, e.end - t0, e.track) for e in last),
                    source=tl.source)


def _step(st: _Rank, ins: Instr, costs: ComputeCosts, cluster: Cluster, issued, members, durations,
          complete, step: int, roots: dict) -> bool:
    """Execute one instruction on one rank; False when it must wait."""
    prog = st.program
    name = str(ins)
    if ins.op in (Op.F, Op.B):
        table = costs.forward if ins.op == Op.F else costs.backward
        if ins.stage not in table:
            raise ValueError(f"no {'forward' if ins.op == 'F' else 'backward'} cost for stage {ins.stage}")
        start, st.now = st.now, st.now + table[ins.stage]
        st.events.append(Event(prog.rank, step, st.pc, name, ins.op, start, st.now))
        if ins.op == Op.B:
            # gradient collectives issued from inside it are placed against [start, end]
            st.last_backward, st.after_backward = (start, st.now, ins.stage), 0
            st.backward_event = len(st.events) - 1
        else:
            st.last_backward = None
        st.now += costs.gap.get(ins.op, 0.0)
        return True
    if ins.op in (Op.STEP, Op.ZERO_GRAD):
        dur = costs.optimizer if ins.op == Op.STEP else costs.zero_grad
        st.events.append(Event(prog.rank, step, st.pc, name, ins.op, st.now, st.now + dur))
        st.now += dur + costs.gap.get(ins.op, 0.0)
        st.last_backward = None
        return True
    if ins.op == Op.WAIT:
        if (st.rep, ins.handle) not in st.handles:
            if (st.rep, ins.handle) not in st.pending:
                raise ValueError(f"rank {prog.rank} #{st.pc}: WAIT h{ins.handle} on a handle never issued")
            return False
        start = st.now
        st.now = max(st.now, st.handles[(st.rep, ins.handle)])
        st.events.append(Event(prog.rank, step, st.pc, name, "WAIT", start, st.now))
        st.now += costs.gap.get("WAIT", 0.0)
        st.last_backward = None
        return True
    # asynchronous: SEND / RECV / collectives
    issue = st.now
    if ins.op in COLLECTIVE_OPS and ins.kind in ("grads", "params") and st.last_backward is not None \
            and st.last_backward[2] == ins.stage:
        # issued from inside the backward as this bucket's gradients become ready
        b_start, b_end, _ = st.last_backward
        n_after = _grads_run_length(prog, st.pc)
        st.after_backward += 1
        issue = b_start + (b_end - b_start) * min(st.after_backward, n_after) / max(n_after, 1)
    else:  # issued by the executor: the rank is busy issuing it
        st.last_backward = None
        st.now += costs.issue_time(ins.op)
    if ins.op in (Op.SEND, Op.RECV):
        src, dst = (prog.rank, ins.peer) if ins.op == Op.SEND else (ins.peer, prog.rank)
        key = (Collective.P2P, src, dst, ins.kind, ins.stage, ins.micro, st.rep)
        members[key] = (src, dst)
        if key not in durations:
            nbytes = ins.nbytes
            durations[key] = collective_time(cluster, Collective.P2P, nbytes, [src, dst]).seconds if nbytes else 0.0
        elif ins.nbytes:
            durations[key] = collective_time(cluster, Collective.P2P, ins.nbytes, [src, dst]).seconds
    else:
        group = prog.group(ins.axis)
        key = (ins.op, ins.kind, ins.axis, group, ins.stage, ins.micro, ins.bucket, st.rep)
        members[key] = group
        if ins.op == Op.BROADCAST:
            roots[key] = ins.peer
        if key not in durations:
            durations[key] = collective_time(cluster, _COLLECTIVE_NAMES[ins.op], ins.nbytes, list(group)).seconds \
                if ins.nbytes and len(group) > 1 else 0.0
    if st.last_backward is not None and issue < st.last_backward[1]:
        _charge_overlap(st, issue, durations[key], overlap_hidden(cluster))
    who = issued.setdefault(key, {})
    if prog.rank in who:
        raise ValueError(f"rank {prog.rank} #{st.pc}: {name} issued twice for the same transfer")
    who[prog.rank] = (issue, (st.rep, ins.handle))
    st.pending[(st.rep, ins.handle)] = key
    complete(key)
    st.events.append(Event(prog.rank, step, st.pc, name, ins.op, issue, issue, track="comm"))
    st.comm.append((len(st.events) - 1, (st.rep, ins.handle)))  # its end is known once every peer has issued
    return True


def _charge_overlap(st: _Rank, issue: float, duration: float, hidden: float) -> None:
    """A collective issued at `issue` inside the rank's last backward competes with it for the
    cores: the part of its `duration` the backward overlaps, times (1 - hidden), is added to
    that backward (hidden: the calibrated share the overlap hides, fit.comm.overlap_hidden;
    below 0 when overlapping costs more than the collective alone, up to twice its time)."""
    if hidden >= 1.0 or duration <= 0.0:
        return
    extra = (1.0 - hidden) * (min(issue + duration, st.last_backward[1]) - issue)
    st.now += extra
    e = st.events[st.backward_event]
    st.events[st.backward_event] = Event(e.rank, e.step, e.index, e.name, e.op, e.start, e.end + extra, e.track)


def _grads_run_length(prog: Program, pc: int) -> int:
    """How many gradient collectives follow the last backward in a row, around position pc."""
    lo = pc
    while lo > 0 and prog.instrs[lo - 1].op in COLLECTIVE_OPS and prog.instrs[lo - 1].kind in ("grads", "params"):
        lo -= 1
    hi = pc
    while hi < len(prog.instrs) and prog.instrs[hi].op in COLLECTIVE_OPS and prog.instrs[hi].kind in ("grads", "params"):
        hi += 1
    return hi - lo



def flow_shop_step_time(slots: list[float], micro_batches: int, *, virtual_stages: int = 1, hop: float = 0.0,
                        rest: float = 0.0) -> float:
    """Closed-form step time (s) of a pipeline whose p2p is asynchronous.

    slots[i]: seconds of forward + backward of one micro-batch on pipeline
    position i (all its chunks). A micro-batch flows through every chunk
    once (the sum of the slots over v) while the slowest position sets the
    pace of the other m*v - 1 chunk passes; each of the 2 (p*v - 1) p2p hops
    on the fill/drain path costs `hop` s. `rest`: the tail after the pipeline
    (exposed gradient sync, optimizer), seconds.
    """
    if not slots or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"flow_shop_step_time needs slots, micro_batches >= 1 and virtual_stages >= 1, got "
                         f"{slots!r}, {micro_batches!r}, {virtual_stages!r}")
    v, p = virtual_stages, len(slots)
    fill = sum(slots) / v + (micro_batches * v - 1) * max(slots) / v
    return fill + 2 * (p * v - 1) * hop + rest
