"""The body of every generated rank script: check, build, connect, train, report.

Order matters for "no rank left hanging": everything that can fail on one
rank alone (arguments, world size, model factory, the model's signature,
building the stage modules) happens before this rank talks to any other.
Those failures are the same on every rank, so each rank exits with the same
clear message and status 2. After the process groups exist, a failure
publishes its reason (Communicator.report_failure) and the other ranks exit
with it (status 1).

Outputs (under --out, default the build directory):
  metrics.jsonl              one line per step from rank 0: step, loss, seconds, lr, grad norm, loss scale,
                             rates, MFU, peak memory (runtime/metrics.py; written as the steps end; a
                             resumed run appends to the history before its checkpoint)
  --tensorboard DIR          the same scalars as TensorBoard event files (rank 0)
  run/rank_XXXX.json         this rank's loss and seconds per step, the global gradient norm, loss scale
                             and skip flag per step (runtime/execute/grad_step.py), its resolved optimizer
                             implementation ("optimizer_impl", runtime/execute/optim.py; null without an optimizer),
                             with compiled stages or loss the graphs torch.compile had made after each step
                             ("compiled_graphs": constant after the first step when nothing recompiles),
                             with --probe-comm the time of a 1 MiB all-reduce over all ranks before the first
                             step, and with evaluation its setting "eval" and results "evals" (runtime/execute/evaluation.py)
  run/timeline_rank_XXXX.json  this rank's Timeline (the first TRACE_WINDOW_STEPS steps; all with --trace); on a
                             GPU each instruction timed on the device with CUDA events, the host's times beside
                             them (runtime/execute/device_clock.py)
  run/params_rank_XXXX.pt    with --save-params: final parameters of its stages
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch

from runtime.checkpoint.restore import (apply_loss_scale, apply_optimizer, apply_params, apply_rng, apply_schedule,
                                        open_restore)
from runtime.checkpoint.run_ids import run_to_continue
from runtime.comm import CommError, PeerFailure, local_threads_hint
from runtime.comm.context import DistContext
from runtime.batch_source import open_data
from runtime.data import Split
from runtime.execute.eval_support import check_program
from runtime.execute.evaluation import eval_setting
from runtime.executor import Executor, RankFailure
from runtime.join import build_identity, wait_for_port
from runtime.lifetime import Terminated, die_of, die_with_launcher, raise_on_terminate
from runtime.launch.placement import check_nodes, cuda_index, placement
from runtime.launch.shared_dirs import NotSharedError
from runtime.execute.grads import GradSync
from runtime.execute.grad_step import make_gradient_step
from runtime.materialize import (build_model_for_stages, build_stage, meta_model, model_signature,
                                 separate_copies, signature_mismatch)
from runtime.execute.optim import optimizer_order, rank_optimizer
from runtime.program import Program
from runtime.parallel.registry import STRATEGIES, StageSplits, param_place
from runtime.spec import StageSpec, TrainSpec
from runtime.execute.stage import StageRunner
from runtime.execute.running_stats import RunningStats
from runtime.verify.sabotage import sabotage
from runtime.verify.step_record import StepRecorder
from runtime.execute.ties import TieSync
from runtime.tensorboard_log import require_tensorboard
from runtime.execute.device_clock import CudaClock
from runtime.program.trace import Recorder, shared_origin
from runtime.vocab import Backend, MeshAxis
from runtime.launch.rank_args import check_launch, parse_args, parse_fail_at
from runtime.documents import read_document
from runtime.launch.rank_contact import (end_stopped, make_comm, rendezvous_check, say, start_watchdog, stop,
                                      stopping, waiting_sayer, world_broadcast)
from runtime.launch.rank_session import Prepared, RankSession
from runtime.launch.rank_steps import check_shared_dirs, lock_checkpoint_dir, train_run


class PlanMismatchError(ValueError):
    """The model reference does not build the model the plan was made for (codegen checks it when it
    writes a build, every rank again when it starts)."""


def prepare(*, rank: int, program: dict, stages: dict, train: dict, signature: dict,
            argv: list[str] | None = None, build_dir: str = ".") -> Prepared:
    """Parse the arguments, check the launch, build this rank's stage modules and data.

    Raises ValueError (LaunchError, PlanMismatchError, RefError, ...) or ImportError:
    the same on every rank, so every rank can exit with it without waiting for the others.
    """
    args = parse_args(argv, build_dir)
    prog = Program.from_dict(program)
    spec = TrainSpec.from_dict(train)
    check_launch(rank, prog, args)
    layout = _node_layout(build_dir)
    where = placement(os.environ)
    check_nodes(where, layout.get("nodes"), layout.get("devices_per_node"))
    evaluation = eval_setting(spec.eval, args.eval_every, args.eval_batches)
    if evaluation is not None:
        check_program(prog)
    if args.tensorboard:  # before anything is built: every rank stops with the same advice
        require_tensorboard()
    backend = args.backend or (Backend.NCCL.value if torch.cuda.is_available() else Backend.GLOO.value)
    model = meta_model(spec)
    if model_signature(model) != signature["hash"]:
        if not signature.get("shapes") and (Path(build_dir) / "build.json").is_file():
            signature = read_document(Path(build_dir) / "build.json", "build file").get("signature", signature)
        raise PlanMismatchError(
            f"the plan was made for another model: {spec.model_ref} with {spec.model_kwargs} builds "
            f"{type(model).__name__} whose tensors differ ({signature_mismatch(model, signature['shapes'])}); "
            "make the plan and the build again for this model")
    del model
    fail_at = parse_fail_at(args.fail_at, rank)
    device = torch.device("cuda", cuda_index(os.environ, torch.cuda.device_count())) if backend == "nccl" \
        else torch.device("cpu")
    tcoord, tsize = param_place(prog)
    full = build_model_for_stages(spec)
    specs = {int(s): StageSpec.from_dict(d) for s, (_c, d) in stages.items()}
    splits = StageSplits()
    modules = {s: build_stage(stages[s][0], specs[s], spec, tcoord, tsize, device, full_model=full, splits=splits)
               for s in sorted(specs)}
    separate_copies(modules)
    del full
    for strategy in STRATEGIES:   # e.g. sub-graph parallelism: hold only this sub-grid's paths
        strategy.prepare(prog, specs, modules)
    restore = None
    if args.resume:
        restore = open_restore(args.resume, rank=rank, program=prog, stage_specs=specs, train=spec,
                               signature=signature["hash"])
        apply_params(restore, modules, specs, tcoord, tsize)
    if args.checkpoint_dir:  # may this run write there? (rank 0 checks again under the lock)
        run_to_continue(args.checkpoint_dir, restore.manifest if restore is not None else None, args.resume,
                        allow_other_run=args.resume_from_other_run)
    data = None
    if any(b.source == "data" for sp in specs.values() for b in sp.inputs) or any(sp.is_last for sp in specs.values()):
        shard, shards = prog.data_shard()
        data = _batches(prog, open_data(spec, prog.micro_batch_size, shard, shards))
    eval_data = _batches(prog, open_data(spec, prog.micro_batch_size, shard, shards, split=Split.EVAL)) \
        if data is not None and evaluation is not None else None
    return Prepared(rank, prog, spec, args, backend, device, specs, modules, data, fail_at, restore, signature["hash"],
                    evaluation, eval_data, where, build_identity(build_dir), layout.get("devices_per_node"))


def _node_layout(build_dir: str) -> dict:
    """The plan's node count and devices per node as build.json records them ({} for builds without)."""
    try:
        info = json.loads((Path(build_dir) / "build.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: info[k] for k in ("nodes", "devices_per_node") if isinstance(info.get(k), int) and info[k] > 0}


def _batches(prog: Program, source):
    """The batch source as the rank's strategies read it (context parallelism: targets in chunk order)."""
    for strategy in STRATEGIES:
        source = strategy.batches(prog, source)
    return source


def connect(p: Prepared) -> RankSession:
    """Join the other ranks: process groups, tensor-parallel groups, gradient buckets, optimizer."""
    hosts = p.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if p.backend != Backend.MPI and not hosts:   # rank 0 may start later (srun): wait without torch's retry traces
        wait_for_port(p.args.master_addr, p.args.master_port, p.args.timeout, waiting_sayer(p),
                      f"waiting for rank 0's rendezvous store at {p.args.master_addr}:{p.args.master_port}")
    comm = make_comm(p.backend, p.rank, p.program.world_size, p.args, p.device, rendezvous_check(p))
    running: list[Executor] = []
    watchdog = start_watchdog(p, comm, running)
    try:
        ctx = DistContext.create(comm, p.program.mesh, timeout=p.args.timeout,
                                 derived_axes=p.program.derived_axes)
        for strategy in STRATEGIES:   # groups into the stage modules (runtime/parallel/)
            strategy.attach(ctx, p.program, p.specs, p.modules)
        d = ctx.size(MeshAxis.DATA)
        runners = {}
        for s, sp in p.specs.items():
            class_split = next((c for strategy in STRATEGIES if (c := strategy.class_split(ctx, sp)) is not None), None)
            runners[s] = StageRunner(sp, p.modules[s], loss=p.spec.loss, class_split=class_split,
                                     loss_scale=1.0 / (p.program.num_micro_batches * d), dtype=p.spec.dtype,
                                     device=p.device, chunk_tokens=p.spec.execution.loss_chunk_tokens,
                                     compiled_loss=p.spec.execution.compile_backend
                                     if p.spec.execution.compiled_loss else None)
        grads = GradSync(p.program.buckets, p.modules, ctx.group(p.program.grad_axis), p.program.zero, p.device) \
            if p.program.buckets else None
        if grads is not None:
            params = grads.optimizer_params(p.modules)
            grads.release_params()
        else:
            params = [q for s in sorted(p.modules) for q in p.modules[s].parameters() if q.requires_grad]
        optimizer = rank_optimizer(p.spec.optimizer, params, grads, p.device) if params else None
        scheduler = p.spec.schedule.build(optimizer) if optimizer is not None else None
        held = params   # GradSync's order, which runtime/grad_norm.pieces_of lists
        if optimizer is not None:
            params = optimizer_order(optimizer)   # weight-decay groups: the order of its state_dict
        if p.restore is not None:
            apply_optimizer(p.restore, p.modules, p.specs, grads, optimizer, *param_place(p.program))
            apply_schedule(p.restore, scheduler, optimizer, p.spec.schedule)
            apply_rng(p.restore, p.rank)
        comm.barrier()
        recorder = Recorder(p.rank, origin=shared_origin(world_broadcast(comm, p.program.world_size, p.device)),
                            enabled=not p.args.no_trace)
        if p.device.type == "cuda" and not p.args.no_trace:   # time the instructions on the device too
            recorder.device = CudaClock(p.device, recorder.now)
        guard = make_gradient_step(comm.group(range(p.program.world_size)), p.device, p.modules, p.specs, grads,
                                   held, param_place(p.program)[0], p.spec, p.rank, recording=p.args.save_steps)
        if p.restore is not None:
            apply_loss_scale(p.restore, guard.scaler)
        ties = TieSync(p.program.ties, p.modules, ctx.groups, grads) if p.program.ties else None
        stats = RunningStats(p.specs, p.modules, ctx.group(p.program.grad_axis)) \
            if any(sp.running_stats for sp in p.specs.values()) else None
        sabotage(p.args.sabotage, grads, ties, p.modules)
        ex = Executor(p.program, ctx, runners, grads, optimizer, p.data, recorder, fail_at=p.fail_at,
                      fault=p.args.fault, ties=ties, stats=stats, eval_data=p.eval_data,
                      scheduler=scheduler, guard=guard)
        steps = StepRecorder(p.program, p.specs, p.modules, grads, params) if p.args.save_steps else None
        if steps is not None:
            ex.on_step = steps.before_step
        running.append(ex)
    except Terminated:
        raise   # stopped from outside: the launcher stops every rank, nobody waits for acknowledgements
    except BaseException:
        if watchdog is not None:
            watchdog.stopping()
        comm.report_failure(f"rank {p.rank} failed while connecting", grace=min(10.0, p.args.timeout))
        raise
    return RankSession(p, comm, ex, grads, watchdog, steps)


def run_rank(*, rank: int, program: dict, stages: dict, train: dict, signature: dict,
             argv: list[str] | None = None, build_dir: str = ".", exit_on_failure: bool = True) -> int:
    """Run this rank. `stages` maps stage index -> (stage class, StageSpec dict).

    `signature` holds "hash" (runtime.materialize.model_signature of the planned
    model) and "shapes" (tensor name -> shape) for the error message.
    Returns the exit status (0 ok, 2 user error); peer and runtime failures exit the
    process with status 1 (when exit_on_failure) after telling the other ranks.
    """
    local_threads_hint()
    die_with_launcher()
    raise_on_terminate()
    try:
        return _run_rank(rank, program, stages, train, signature, argv, build_dir, exit_on_failure)
    except Terminated as e:   # what it was writing is removed on the way here (runtime/files.py)
        die_of(e.signum, f"meshplan rank {rank}: {e}")
        return 128 + e.signum


def _run_rank(rank: int, program: dict, stages: dict, train: dict, signature: dict, argv: list[str] | None,
              build_dir: str, exit_on_failure: bool) -> int:
    tag = f"meshplan rank {rank}"
    try:
        prep = prepare(rank=rank, program=program, stages=stages, train=train, signature=signature, argv=argv,
                       build_dir=build_dir)
    except (ValueError, ImportError) as e:
        say(f"{tag}: error: {e}")
        return 2
    grace = min(10.0, prep.args.timeout)
    try:
        session = connect(prep)
    except PeerFailure as e:
        say(f"{tag}: stopping because another rank failed: {e}")
        return stop(exit_on_failure)
    except (CommError, ValueError) as e:
        say(f"{tag}: error: {e}")
        return stop(exit_on_failure)
    comm = session.comm
    try:
        check_shared_dirs(session)
    except NotSharedError as e:   # every rank has the same answer: each says so and stops
        say(f"{tag}: error: {e}")
        stopping(session)
        session.close()
        return 2
    try:
        lock_checkpoint_dir(session)
        train_run(session)
    except PeerFailure as e:
        stopping(session)
        say(f"{tag}: stopping because another rank failed: {e}")
        comm.acknowledge_failure(grace=grace)
        end_stopped(session)
        return stop(exit_on_failure)
    except Terminated:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure must reach the other ranks
        stopping(session)
        msg = str(e) if isinstance(e, (RankFailure, CommError)) else \
            f"rank {rank} failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        say(f"{tag}: error: {msg}")
        if not isinstance(e, (RankFailure, CommError)):
            traceback.print_exc()
        comm.report_failure(msg, grace=grace)
        end_stopped(session)
        return stop(exit_on_failure)
    session.close()
    return 0
