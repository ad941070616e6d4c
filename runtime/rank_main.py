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
                             with compiled stages the graphs torch.compile had made after each step
                             ("compiled_graphs": constant after the first step when nothing recompiles),
                             with --probe-comm the time of a 1 MiB all-reduce over all ranks before the first
                             step, and with evaluation its setting "eval" and results "evals" (runtime/execute/evaluation.py)
  run/timeline_rank_XXXX.json  this rank's Timeline (the first TRACE_WINDOW_STEPS steps; all with --trace); on a
                             GPU each instruction timed on the device with CUDA events, the host's times beside
                             them (runtime/execute/device_clock.py)
  run/params_rank_XXXX.pt    with --save-params: final parameters of its stages
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from runtime.checkpoint import RankState, save_checkpoint
from runtime.checkpoint.restore import (Restore, apply_loss_scale, apply_optimizer, apply_params, apply_rng,
                                        apply_schedule, open_restore)
from runtime.checkpoint.run_ids import CheckpointClaim, claim_checkpoint_dir, run_to_continue, sweep_resumed_root
from runtime.execute.compiled import compiled_graphs
from runtime.comm import CommError, PeerFailure, local_threads_hint
from runtime.comm.context import DistContext
from runtime.batch_source import open_data
from runtime.data import DataSource, Split
from runtime.execute.eval_support import check_program
from runtime.execute.evaluation import EvalResult, EvalSpec, eval_setting, evaluate_held_out
from runtime.executor import Executor, RankFailure
from runtime.launch.faults import SAVE_FAULTS, inject
from runtime.comm.jobauth import signer_from_env
from runtime.join import Arrival, Meeting, build_identity, listed, say_to_stderr, wait_for_port
from runtime.lifetime import HEARTBEAT_STORE_ENV, LAUNCHER_PID_ENV, Terminated, die_of, die_with_launcher, raise_on_terminate
from runtime.launch.placement import Placement, check_nodes, cuda_index, node_of, placement
from runtime.launch.shared_dirs import NotSharedError, probe
from runtime.comm.store_host import LOOPBACK, host_store, listen_address
from runtime.execute.grads import GradSync
from runtime.execute.grad_step import make_gradient_step, outcome_record, scaler_state
from runtime.materialize import (build_model_for_stages, build_stage, meta_model, model_signature,
                                 separate_copies, signature_mismatch)
from runtime.execute.memtrack import measure_step_memory
from runtime.execute.optim import optimizer_order, rank_optimizer
from runtime.program import Program
from runtime.parallel.registry import STRATEGIES, param_place
from runtime.spec import StageSpec, TrainSpec
from runtime.execute.stage import StageRunner
from runtime.execute.running_stats import RunningStats
from runtime.verify.sabotage import sabotage
from runtime.verify.step_record import StepRecorder
from runtime.execute.ties import TieSync
from runtime.metrics import StepLog, check_loss
from runtime.tensorboard_log import require_tensorboard
from runtime.execute.device_clock import CudaClock
from runtime.program.trace import (PROBE_BYTES, TRACE_WINDOW_STEPS, Recorder, probe_all_reduce, shared_origin,
                           write_run_timeline)
from runtime.vocab import Backend, MeshAxis
from runtime.launch.watchdog import Watchdog
from runtime.launch.rank_args import LaunchError, check_launch, parse_args, parse_fail_at
from runtime.documents import read_document


class PlanMismatchError(ValueError):
    """The model reference does not build the model the plan was made for (codegen checks it when it
    writes a build, every rank again when it starts)."""


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


def _claim_checkpoint_dir(session: RankSession) -> None:
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


def _exit_hard(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Prepared:
    """Everything a rank sets up alone, before it talks to any other rank."""

    rank: int
    program: Program
    spec: TrainSpec
    args: argparse.Namespace
    backend: str
    device: torch.device
    specs: dict[int, StageSpec]
    modules: dict[int, torch.nn.Module]
    data: DataSource | None
    fail_at: tuple[int, int] | None
    restore: Restore | None = None
    signature: str = ""        # model_signature the build was made for
    evaluation: EvalSpec | None = None   # held-out evaluation (runtime/execute/evaluation.py)
    eval_data: DataSource | None = None
    where: Placement = Placement()        # this process's node and place on it (runtime/launch/placement.py)
    build_id: str = ""                    # runtime/join.build_identity of the build (compared at the rendezvous)
    devices_per_node: int | None = None   # the plan's (None: a build that does not record it)


@dataclass
class RankSession:
    """A connected rank, ready to run steps (`executor.run_step(step)`)."""

    prepared: Prepared
    comm: object
    executor: Executor
    grads: GradSync | None
    watchdog: Watchdog | None = None
    recorder: StepRecorder | None = None
    checkpoint_claim: CheckpointClaim | None = None   # rank 0 with --checkpoint-dir: its lock and run id
    results: list = dataclasses.field(default_factory=list)   # every step's StepResult, in order
    out_ranks: list[int] | None = None   # the ranks whose --out is rank 0's (None: not probed: all)
    compiled: list = dataclasses.field(default_factory=list)  # compiled stages: graphs compiled after each step

    def close(self) -> None:
        if self.checkpoint_claim is not None:
            self.checkpoint_claim.release()
        if self.watchdog is not None:
            self.watchdog.close()
        self.comm.shutdown()


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
    modules = {s: build_stage(stages[s][0], specs[s], spec, tcoord, tsize, device, full_model=full)
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
        wait_for_port(p.args.master_addr, p.args.master_port, p.args.timeout, _sayer(p),
                      f"waiting for rank 0's rendezvous store at {p.args.master_addr}:{p.args.master_port}")
    comm = _make_comm(p.backend, p.rank, p.program.world_size, p.args, p.device, _join(p))
    running: list[Executor] = []
    watchdog = _start_watchdog(p, comm, running)
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
                                     device=p.device, chunk_tokens=p.spec.execution.loss_chunk_tokens)
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
        recorder = Recorder(p.rank, origin=shared_origin(_world_broadcast(comm, p.program.world_size, p.device)),
                            enabled=not p.args.no_trace)
        if p.device.type == "cuda" and not p.args.no_trace:   # time the instructions on the device too
            recorder.device = CudaClock(p.device, recorder.now)
        guard = make_gradient_step(comm.group(range(p.program.world_size)), p.device, p.modules, p.specs, grads,
                                   held, param_place(p.program)[0], p.spec, p.rank)
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


def _world_broadcast(comm, world_size: int, device):
    """values -> rank 0's values (int64) on every rank, over all ranks (on `device`: NCCL
    broadcasts GPU tensors only)."""
    def broadcast(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=device)
        comm.group(range(world_size)).broadcast(t, 0)
        return [int(v) for v in t.tolist()]
    return broadcast


def _start_watchdog(p: Prepared, comm, running: list) -> Watchdog | None:
    """Heartbeats and the abort watcher (runtime/launch/watchdog.py) on the rendezvous store; under MPI on the
    store `meshplan run` hosts for them (HEARTBEAT_STORE_ENV), else none (the collective timeout)."""
    hosted = None
    if p.backend == Backend.MPI:
        where = os.environ.get(HEARTBEAT_STORE_ENV, "")
        if where:
            host, _, port = where.rpartition(":")
        else:  # started by mpirun directly: rank 0 hosts one (on loopback when every rank is on its node)
            try:
                if comm.rank == 0:
                    addr = LOOPBACK if comm.single_node else os.environ.get("MASTER_ADDR") or socket.gethostname()
                    hosted = host_store(listen_address(addr), 0, p.args.timeout)
                host, port = comm.share((addr, hosted.port) if hosted else None)
            except Exception as e:
                print(f"meshplan rank {p.rank}: warning: no heartbeat store ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
                return None
    else:
        host, port = p.args.master_addr, p.args.master_port
    instrs = p.program.instrs
    owner = _store_owner(p)

    def position() -> tuple[int, int, str, str]:
        if not running:
            return -1, -1, "connecting", ""
        step, idx = running[0].position
        ins = instrs[idx] if 0 <= idx < len(instrs) else None
        return step, idx, str(ins) if ins else "", ins.op if ins else ""
    try:
        wd = Watchdog(p.rank, p.program.world_size, host, int(port), position, grace=min(3.0, p.args.timeout),
                      heartbeat_timeout=p.args.heartbeat_timeout, signer=signer_from_env(),
                      store_owner=owner, kill_stopped="TORCHELASTIC_RUN_ID" in os.environ).start()
    except Exception as e:  # no watchdog: failures are still reported, only less precisely
        print(f"meshplan rank {p.rank}: warning: no watchdog ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return None
    wd.hosted_store = hosted   # held as long as the watchdog runs
    if p.backend != Backend.MPI:
        comm.diagnose = wd.diagnose
    return wd


def _under_meshplan_run() -> bool:
    """Whether `meshplan run` started this rank (directly, or through mpiexec with its heartbeat store)."""
    return LAUNCHER_PID_ENV in os.environ or bool(os.environ.get(HEARTBEAT_STORE_ENV))


def _store_owner(p: Prepared) -> str:
    """Where the run's store is and who hosts it, as the watchdog names it when it is gone."""
    if os.environ.get(HEARTBEAT_STORE_ENV) if p.backend == Backend.MPI else LAUNCHER_PID_ENV in os.environ:
        return "hosted by `meshplan run`"
    agent = p.backend != Backend.MPI and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = "torchrun's agent" if agent else "rank 0"
    return f"on rank 0's node (hosted by {host})" if p.where.nodes != 1 else f"hosted by {host}"


def _say(line: str) -> None:
    """Print why this rank stops; under torchrun also put it in the rank's error file, so that torchrun's
    closing summary names the cause instead of "To enable traceback see ..."."""
    print(line, file=sys.stderr, flush=True)
    _tell_launcher(line)


def _tell_launcher(reason: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path).write_text(json.dumps({"message": reason, "timestamp": int(time.time())}))
    except OSError:
        pass


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
        _say(f"{tag}: error: {e}")
        return 2
    grace = min(10.0, prep.args.timeout)
    try:
        session = connect(prep)
    except PeerFailure as e:
        _say(f"{tag}: stopping because another rank failed: {e}")
        return _stop(exit_on_failure)
    except (CommError, ValueError) as e:
        _say(f"{tag}: error: {e}")
        return _stop(exit_on_failure)
    comm = session.comm
    try:
        _check_shared_dirs(session)
    except NotSharedError as e:   # every rank has the same answer: each says so and stops
        _say(f"{tag}: error: {e}")
        _stopping(session)
        session.close()
        return 2
    try:
        _claim_checkpoint_dir(session)
        _train(session)
    except PeerFailure as e:
        _stopping(session)
        _say(f"{tag}: stopping because another rank failed: {e}")
        comm.acknowledge_failure(grace=grace)
        _end_stopped(session)
        return _stop(exit_on_failure)
    except Terminated:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure must reach the other ranks
        _stopping(session)
        msg = str(e) if isinstance(e, (RankFailure, CommError)) else \
            f"rank {rank} failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        _say(f"{tag}: error: {msg}")
        if not isinstance(e, (RankFailure, CommError)):
            traceback.print_exc()
        comm.report_failure(msg, grace=grace)
        _end_stopped(session)
        return _stop(exit_on_failure)
    session.close()
    return 0


def _check_shared_dirs(session: RankSession) -> None:
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
    missing = probe(dirs, p.rank, world, _world_broadcast(session.comm, world, device), all_gather)
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


def _end_stopped(session: RankSession) -> None:
    if session.watchdog is not None:
        session.watchdog.end_stopped()


def _stopping(session: RankSession) -> None:
    if session.watchdog is not None:
        session.watchdog.stopping()


def _stop(exit_on_failure: bool) -> int:
    if exit_on_failure:
        _exit_hard(1)
    return 1


def _make_comm(backend: str, rank: int, world_size: int, args, device, join: Callable[[object], None] | None = None):
    if backend == Backend.MPI:
        from runtime.comm.mpi import MpiCommunicator

        comm = MpiCommunicator(timeout=args.timeout)
        if comm.world_size != world_size:
            raise LaunchError(f"the plan needs {world_size} processes, but MPI started {comm.world_size}; "
                              f"run mpirun -n {world_size}")
        if comm.rank != rank:
            raise LaunchError(f"MPI says this process is rank {comm.rank}, but this is the script of rank {rank}")
        return comm
    from runtime.comm import TorchCommunicator

    return TorchCommunicator(backend, rank, world_size, args.master_addr, args.master_port, timeout=args.timeout,
                             use_agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                             device=device, signer=signer_from_env(), join=join)


def _sayer(p: Prepared) -> Callable[[str], None] | None:
    """Over several nodes (or an unknown placement), rank 0 and the first rank of each node say what they wait
    for; on one machine the ranks start together and nobody does."""
    if p.where.nodes == 1:
        return None
    return say_to_stderr(f"meshplan rank {p.rank}") if p.rank == 0 or p.where.local_rank == 0 else None


def _join(p: Prepared) -> Callable[[object], None]:
    """This rank's part of the rendezvous check (runtime/join.py); a missing rank is named with the node the
    plan puts it on."""
    several = p.where.nodes is None or p.where.nodes > 1
    say = _sayer(p)

    def join(store) -> None:
        Meeting(store, p.program.world_size, signer_from_env(), f"{p.args.master_addr}:{p.args.master_port}",
                p.args.timeout, noun="rank", say=say,
                node_of=(lambda r: node_of(r, p.devices_per_node)) if several else None,
                attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "")).meet(
            Arrival(p.rank, p.build_id, p.where.node, socket.gethostname(), os.getpid()))
    return join


def _train(session: RankSession) -> None:
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
         **({"compiled_graphs": session.compiled} if p.spec.execution.compile else {})}))
    if session.recorder is not None:
        session.recorder.save(run_dir / f"steps_rank_{rank:04d}.pt")
    if not args.no_trace:
        ex.recorder.timeline().save(run_dir / f"timeline_rank_{rank:04d}.json")
    session.comm.barrier()
    if rank == 0 and not _under_meshplan_run():   # `meshplan run` merges them itself
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
    compiled = session.compiled if p.spec.execution.compile else None
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
