"""A connected rank's training run (runtime/rank_main.py): the steps with their metrics, traces, held-out
evaluations and checkpoints, the shared-directory check before them, and the records it writes after them
(run/rank_XXXX.json, its timeline, parameters; rank 0 merges the timelines unless `meshplan run` does)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from runtime.checkpoint import RankState, save_checkpoint
from runtime.checkpoint.run_ids import claim_checkpoint_dir, sweep_resumed_root
from runtime.execute.compiled import compiled_graphs
from runtime.execute.evaluation import EvalResult, evaluate_held_out
from runtime.executor import RankFailure
from runtime.launch.faults import SAVE_FAULTS, inject
from runtime.join import listed
from runtime.launch.placement import node_of
from runtime.launch.shared_dirs import NotSharedError, probe
from runtime.execute.grad_step import outcome_record, scaler_state
from runtime.execute.memtrack import measure_step_memory
from runtime.metrics import StepLog, check_loss
from runtime.program.trace import PROBE_BYTES, TRACE_WINDOW_STEPS, probe_all_reduce, write_run_timeline
from runtime.launch.rank_contact import under_meshplan_run, world_broadcast
from runtime.launch.rank_session import RankSession


def train_run(session: RankSession) -> None:
    p, ex = session.prepared, session.executor
    rank, args = p.rank, p.args
    out = Path(args.out)
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    first = p.restore.step if p.restore is not None else 0
    if p.restore is not None and rank == 0:
        print(f"meshplan rank 0: resumed from checkpoint {p.restore.ckpt} (step {first}): this run trains steps "
              f"{first} to {first + args.steps - 1}", flush=True)
    probe = probe_all_reduce(session.comm, p.program.world_size, p.device) if args.probe_comm else None
    metrics = StepLog(out / "metrics.jsonl", first, args.steps, p.spec.global_batch_size, p.spec.work, p.device,
                      tensorboard=args.tensorboard, progress=not args.no_progress) if rank == 0 else None
    evals: list[EvalResult] = []
    try:
        losses, seconds, memory, memory_step = _train_steps(session, first, metrics, evals)
    finally:
        if metrics is not None:
            metrics.close()
    grads = session.grads
    if args.save_params:
        if grads is not None:
            grads.gather_all()
        torch.save({s: {k: v.detach().cpu().clone() for k, v in m.named_parameters()}
                    for s, m in p.modules.items()}, run_dir / f"params_rank_{rank:04d}.pt")
    (run_dir / f"rank_{rank:04d}.json").write_text(json.dumps(
        {"rank": rank, "losses": losses, "seconds": seconds, "stages": sorted(p.specs), "first_step": first,
         "optimizer_impl": p.spec.optimizer.resolve_impl(p.device).value if ex.optimizer is not None else None,
         **outcome_record(session.results),
         **({"resumed_from": str(p.restore.ckpt)} if p.restore is not None else {}),
         **({"eval": p.evaluation.to_dict(), "evals": [e.to_dict() for e in evals]} if p.evaluation else {}),
         **({"memory": {**dataclasses.asdict(memory), "step": memory_step}} if memory is not None else {}),
         **({"probe": {"all_reduce_bytes": PROBE_BYTES, "seconds": probe}} if probe is not None else {}),
         **({"compiled_graphs": session.compiled} if p.spec.execution.compiles else {})}))
    if session.recorder is not None:
        session.recorder.save(run_dir / f"steps_rank_{rank:04d}.pt")
    if not args.no_trace:
        ex.recorder.timeline().save(run_dir / f"timeline_rank_{rank:04d}.json")
    session.comm.barrier()
    if rank == 0 and not under_meshplan_run():   # `meshplan run` merges them itself
        ranks = session.out_ranks if session.out_ranks is not None else range(p.program.world_size)
        files = [] if args.no_trace else [run_dir / f"timeline_rank_{r:04d}.json" for r in ranks]
        write_run_timeline(out, [f for f in files if f.is_file()])


def _train_steps(session: RankSession, first: int, metrics,
                 evals: list[EvalResult]) -> tuple[list[float], list[float], object, int]:
    """Steps first .. first + --steps - 1: (losses, seconds, peak memory or None, the step it was measured in);
    the held-out evaluations after the steps that have one are appended to `evals` (rank 0 prints them).

    Traces the first TRACE_WINDOW_STEPS steps (every step with --trace, none with --no-trace); rank 0
    writes each step's line to `metrics` as it ends. The ranks that hold the last stage check the loss
    (every rank has the step's loss, but one check suffices): a NaN or infinite loss raises there, and the
    others learn it through the failure reporting of run_rank."""
    p, ex = session.prepared, session.executor
    args = p.args
    traced = 0 if args.no_trace else args.steps if args.trace else TRACE_WINDOW_STEPS
    checks_loss = any(sp.is_last for sp in p.specs.values())
    losses, seconds, memory = [], [], None
    # The second step is in steady state (optimizer state exists from the first step on).
    memory_step = first + 1 if args.steps >= 3 else first
    steps = session.recorder
    compiled = session.compiled if p.spec.execution.compiles else None
    for step in range(first, first + args.steps):
        ex.recorder.enabled = step - first < traced
        if steps is not None:
            steps.start(step)
        if metrics is not None:
            metrics.start_step()
        following = step + 1 if step + 1 < first + args.steps else None
        if args.track_memory and step == memory_step:  # counting slows ops: one step only
            r, memory = measure_step_memory(p.device, lambda: ex.run_step(step, following))
        else:
            r = ex.run_step(step, following)
        ex.recorder.collect()   # the device times of what the device has passed; never waits
        if compiled is not None:
            compiled.append(compiled_graphs())
        if steps is not None:
            steps.end(r.loss)
        if p.evaluation is not None and p.evaluation.due(step):
            ev = evaluate_held_out(ex, p.evaluation, step)
            evals.append(ev)
            r.evaluation = ev.metrics()
            if p.rank == 0:
                print(f"meshplan rank 0: {ev.line()}", flush=True)
        session.results.append(r)
        losses.append(r.loss)
        seconds.append(r.seconds)
        if metrics is not None:
            line = metrics.fields(r)
            epoch = getattr(p.data, "epoch_of", None)   # a Dataset's epoch (runtime/datasets.py)
            if epoch is not None and epoch(step) is not None:
                line["epoch"] = epoch(step)
            line.update(r.evaluation or {})
            metrics.write(line)
        if checks_loss:
            check_loss(r.loss, step, p.rank)
        last = step == first + args.steps - 1
        if args.checkpoint_dir and (last or (args.save_every and (step + 1) % args.save_every == 0)):
            _save(session, step + 1)
    return losses, seconds, memory, memory_step


def _save(session: RankSession, next_step: int) -> None:
    """Every rank saves its checkpoint shard after step next_step - 1 (a collective: see runtime/checkpoint/__init__.py)."""
    p = session.prepared
    fa = p.args.fail_at
    kill = None
    if p.args.fault in SAVE_FAULTS and p.fail_at is not None and p.fail_at[0] == next_step - 1:
        kill = lambda: inject(p.args.fault, p.rank, f"the checkpoint of step {next_step} ({fa})")  # noqa: E731
    claim = session.checkpoint_claim
    st = RankState(p.rank, p.program, p.specs, p.modules, p.spec, p.signature, session.grads,
                   session.executor.optimizer, barrier=session.comm.barrier, scheduler=session.executor.scheduler,
                   run_id=claim.run_id if claim is not None else "", loss_scale=scaler_state(session.executor.guard))
    save_checkpoint(p.args.checkpoint_dir, next_step, st, interrupt=kill)


def lock_checkpoint_dir(session: RankSession) -> None:
    """Rank 0 locks --checkpoint-dir for this run (runtime/checkpoint/run_ids.py); a refusal is its failure."""
    p = session.prepared
    if p.rank != 0:
        return
    if not p.args.checkpoint_dir:
        if p.restore is not None:
            sweep_resumed_root(p.restore.ckpt)
        return
    resumed = p.restore.manifest if p.restore is not None else None
    try:
        session.checkpoint_claim = claim_checkpoint_dir(p.args.checkpoint_dir, resumed, p.args.resume,
                                                        allow_other_run=p.args.resume_from_other_run)
    except ValueError as e:  # reported to every rank like any other failure, without a traceback
        raise RankFailure(f"rank 0: {e}") from None


def check_shared_dirs(session: RankSession) -> None:
    """On a launch over several nodes (or an unknown placement): refuse a --checkpoint-dir that is not one
    directory for every rank (runtime/launch/shared_dirs.py), and note which ranks share rank 0's --out."""
    p = session.prepared
    if p.where.nodes == 1 or p.program.world_size == 1:
        return
    world, device = p.program.world_size, p.device
    dirs = [p.args.out] + ([p.args.checkpoint_dir] if p.args.checkpoint_dir else [])

    def all_gather(flags: list[int]) -> list[list[int]]:
        mine = torch.tensor(flags, dtype=torch.int64, device=device)
        out = torch.empty(world * len(flags), dtype=torch.int64, device=device)
        session.comm.group(range(world)).all_gather(out, mine)
        return out.view(world, len(flags)).tolist()
    missing = probe(dirs, p.rank, world, world_broadcast(session.comm, world, device), all_gather)
    devices = p.devices_per_node
    if len(missing) > 1 and missing[1]:
        raise NotSharedError(
            f"the checkpoint directory {p.args.checkpoint_dir} is not shared by all ranks: "
            f"{listed(missing[1], 'rank', lambda r: node_of(r, devices))} do not see the file rank 0 wrote there; "
            "--checkpoint-dir must be one directory every node mounts (a shared file system): every rank writes its "
            "shard there and rank 0 completes each checkpoint")
    session.out_ranks = [r for r in range(world) if r not in missing[0]]
    if missing[0] and p.rank == 0:
        print(f"meshplan rank 0: warning: --out {p.args.out} is not shared with "
              f"{listed(missing[0], 'rank', lambda r: node_of(r, devices))}: their records and timelines stay on "
              "their nodes, and timeline.json and trace.json hold the other ranks only; use a directory every "
              "node shares (the build directory on shared storage)", file=sys.stderr, flush=True)
