"""`meshplan codegen --target torch`: one readable SPMD training script for PyTorch's own parallel stack.

    build/
      plan.json, graph.json    as in a meshplan build (codegen/emit.py)
      build.json               the training setup (TrainSpec), "target": "torch", "entry": SCRIPT (the
                               file every process starts: runtime.launch.launcher.entry_script) and what
                               --verify reads the run's records as (runtime/torch_script.py)
      train_torch.py           the script, the same on every rank: builds the model from its reference,
                               applies the plan written out as explicit torch calls (init_device_mesh,
                               parallelize_module, checkpoint wrappers, fully_shard / replicate,
                               PipelineStage and the plan's schedule) and trains with the build's
                               optimizer, lr schedule, data and seeds; saves and resumes Distributed
                               Checkpoints (runtime/torch_script_checkpoint.py)
      launch_torchrun.sh       torchrun (gloo on CPU, nccl on GPU)
      launch_srun.sh           a Slurm batch script (srun)

The calls come from `torch_layout(plan, graph)` (codegen/torch_target/layout.py), the same derivation
planner.parallelize applies; codegen/torch_target/script_parallel.py writes them. Strings from the
user and the model (references, arguments, module paths) land in the script only as literals
(py_literal, repr) or escaped docstring text (doc_text), as in a meshplan build.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from codegen.emit import GRAPH_FILE, _executable, node_layout, train_spec
from codegen.launchers import launch_scripts
from codegen.pysrc import doc_text, py_literal
from codegen.torch_target.layout import TorchLayout, torch_layout
from codegen.torch_target.script_parallel import parallelize_source
from planner.graph.model import ModelGraph
from planner.capabilities import check_target
from planner.plan import Plan
from runtime.spec import TrainSpec
from runtime.torch_records import WHOLE_MODEL_KEY
from runtime.vocab import Target

SCRIPT = "train_torch.py"


class TorchTargetError(ValueError):
    """A training setup the torch target's script does not carry out."""


@dataclass(frozen=True)
class TorchBuild:
    """What emit_torch wrote."""

    path: Path
    world_size: int
    train: TrainSpec

    @property
    def script(self) -> Path:
        return self.path / SCRIPT


def emit_torch(plan: Plan, model_ref: str, data_ref: str | None = None, out_dir: str | os.PathLike = "build", *,
               graph: ModelGraph | None = None, **setup) -> TorchBuild:
    """Write the torch build directory for `plan` (see the module docstring).

    Args and `setup` as codegen.emit.emit's training setup (model_kwargs, data_kwargs, loss, optimizer,
    seed, data_seed, init, checkpoint, root, dataset, schedule, clip_grad, grad_norm; loss_scale and evaluation are
    refused: the torch target trains in fp32 or bf16 and does not evaluate; so is an execution other than
    the default, naming its options: the script compiles nothing, computes the full loss, pads nothing).

    Raises TargetError (planner/capabilities.py) for a plan the torch target does not run,
    PlanMismatchError when model_ref builds another model than the plan's, TorchTargetError for a setup
    the script does not carry out (held-out evaluation), and the layout's
    ValueErrors for plans PyTorch's stack does not express.
    """
    check_target(plan, Target.TORCH)
    graph, train = train_spec(plan, model_ref, data_ref, graph=graph, **setup)
    if not train.execution.is_default:
        raise TorchTargetError(f"the torch target's script runs the stages eagerly with the full loss and the "
                               f"model's own vocabulary; it does not run {', '.join(train.execution.options())}: "
                               "leave them out (for a plan that asks for them: --no-compile --loss-impl full "
                               "--vocab-multiple 1), or generate a meshplan build")
    if train.eval is not None:
        raise TorchTargetError("the torch target's script does not evaluate on held-out batches; leave out "
                               "--eval-every / --eval-batches, or generate a meshplan build")
    layout = torch_layout(plan, graph)
    text = torch_script(plan, layout, train)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = plan.config.num_devices
    plan.save(out / "plan.json")
    graph.save(out / GRAPH_FILE)
    (out / "build.json").write_text(json.dumps({
        "train": train.to_dict(), "world_size": world, "mesh": dict(plan.mesh), "target": Target.TORCH.value,
        "entry": SCRIPT,
        "schedule": plan.config.schedule, "micro_batches": _micro_batches(plan),
        "graph_fingerprint": plan.graph_fingerprint, "random_ops": list(graph.random_ops), **node_layout(plan),
        WHOLE_MODEL_KEY: {"micro_batch_size": plan.config.micro_batch_size, "micro_batches": _micro_batches(plan)},
    }, indent=1))
    (out / SCRIPT).write_text(text)
    _executable(out / SCRIPT)
    for name, launcher in launch_scripts(plan, world, str(out.resolve()), entry=SCRIPT).items():
        if name != "launch_mpirun.sh":   # torch.distributed's backends only: MPI stays with meshplan's runtime
            (out / name).write_text(launcher)
            _executable(out / name)
    for stale in ("metrics.jsonl", "launch_mpirun.sh", "run_rank.py", "programs.json"):
        (out / stale).unlink(missing_ok=True)
    for old in out.glob("rank_[0-9][0-9][0-9][0-9].py"):
        old.unlink()
    return TorchBuild(out, world, train)


def _micro_batches(plan: Plan) -> int:
    """Micro-batches per data rank and step."""
    return plan.config.micro_batches(plan.global_batch_size)


def torch_script(plan: Plan, layout: TorchLayout, train: TrainSpec) -> str:
    """The source of train_torch.py (compiled here: a script that does not compile is never written)."""
    cfg = plan.config
    axes = tuple(str(d.axis) for d in layout.mesh)
    summary = [
        f"Model: {train.model_ref} {train.model_kwargs or ''}".rstrip(),
        "Plan:  " + " x ".join(f"{a} {s}" for a, s in plan.mesh.items() if s > 1 or a == "data")
        + (f", {cfg.schedule}" + (f" (v={cfg.virtual_stages})" if cfg.schedule == "interleaved" else "")
           if cfg.pipeline > 1 else "")
        + f", {_micro_batches(plan)} micro-batches of {cfg.micro_batch_size} per data rank, recompute "
        f"{cfg.recompute}, ZeRO {cfg.zero}, {cfg.dtype}",
    ]
    parallel = parallelize_source(layout)
    head = [
        "#!/usr/bin/env python3",
        '"""meshplan build for PyTorch\'s own parallel stack: one script, the same on every rank.',
        "",
        *(doc_text(line) for line in summary),
        "",
        "Generated by `meshplan codegen --target torch` from the plan: plain PyTorch (DeviceMesh, DTensor,",
        "FSDP2, torch.distributed.pipelining) that you may read and edit. Start it with launch_torchrun.sh,",
        "launch_srun.sh or `meshplan run BUILD --steps N [--verify]`; options: --steps N --backend gloo|nccl",
        "--out DIR --timeout S --checkpoint-dir DIR --save-every N --resume CHECKPOINT --resume-from-other-run",
        "(Distributed Checkpoints: runtime/torch_script_checkpoint.py; meshplan's own builds' checkpoints are",
        "another format, refused here).",
        '"""',
        "",
        "import os",
        "import sys",
        "import time",
        "from pathlib import Path",
        "",
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.device_mesh import init_device_mesh",
        *parallel.imports,
        "",
        "from runtime.batch_source import open_data",
        "from runtime.data import batch_to, call_model",
        "from runtime.executor import StepResult",
        "from runtime.lifetime import Terminated, die_of, die_with_launcher, raise_on_terminate",
        "from runtime.losses import compute_loss",
        "from runtime.materialize import build_model",
        "from runtime.metrics import StepLog, check_loss",
        "from runtime.reference import autocast_for",
        "from runtime.spec import TrainSpec",
        "from runtime.torch_script import (Runner, WholeModelRecorder, canonical_names, check_world, join,",
        "                                  optimizer_for, save_whole_parameters, script_args, write_rank_result)",
        "from runtime.torch_script_checkpoint import open_checkpoints",
        "",
        "# the model, data, optimizer, lr schedule and seeds of the build (runtime/spec.py)",
        f"TRAIN = TrainSpec.from_dict({py_literal(train.to_dict())})",
        f"WORLD_SIZE = {plan.config.num_devices}",
        f"MESH_AXES = {axes!r}",
        f"MESH_SHAPE = {tuple(d.size for d in layout.mesh)!r}",
        f"MICRO_BATCH_SIZE = {cfg.micro_batch_size}   # samples",
        "",
        "",
    ]
    text = "\n".join(head + parallel.functions + _BODY.strip("\n").splitlines() + [""])
    compile(text, SCRIPT, "exec")
    return text


# The training loop: the same for every plan; parallelize() and the step function above it differ.
_BODY = '''
def data_coordinate(mesh):
    """(this rank's data shard, the number of shards): its coordinate on the data axis."""
    if "data" not in MESH_AXES:
        return 0, 1
    return mesh["data"].get_local_rank(), mesh["data"].size()


def global_loss(loss, holds_loss, device):
    """The global batch's mean loss on every rank: the mean over the ranks that computed one (every data
    rank's loss is the mean over its equal share of the batch; tensor ranks hold the same loss)."""
    t = torch.tensor([loss if holds_loss else 0.0, 1.0 if holds_loss else 0.0], dtype=torch.float64,
                     device=device)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def train(args, rank, backend, checkpoints):
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(device.type, MESH_SHAPE, mesh_dim_names=MESH_AXES)
    # the whole model on every rank, initialised exactly as the single-process run (same seed), then split
    model = build_model(TRAIN).to(device)
    model.train()
    names = canonical_names(model)   # for --verify's records: the model's own name of every tensor
    runner = parallelize(model, mesh, device)
    params = [p for m in runner.modules for p in m.parameters() if p.requires_grad]
    optimizer_spec = optimizer_for(TRAIN.optimizer, params, device)   # fused kernels take no DTensors
    optimizer = optimizer_spec.build(params, device=device)   # its weight-decay groups: runtime/execute/optim.py
    scheduler = TRAIN.schedule.build(optimizer)                 # stepped after every optimizer step
    shard, shards = data_coordinate(mesh)
    # the rows [shard G/d, (shard+1) G/d) of each global batch, in MICRO_BATCH_SIZE chunks: the chunks the
    # single-process reference walks, in the same order (runtime/data.py)
    data = open_data(TRAIN, MICRO_BATCH_SIZE, shard, shards)
    # --resume: the model's tensors (resharded from any plan's checkpoint), the optimizer, the lr schedule
    # and the step (the data position: batches are a function of the step); rank 0 locks --checkpoint-dir
    checkpoints.claim(rank)
    first = checkpoints.resume(runner.state, optimizer, scheduler)
    out = Path(args.out)
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    recorder = WholeModelRecorder(runner.modules, rank, names) if args.save_steps else None
    log = StepLog(out / "metrics.jsonl", first, args.steps, TRAIN.global_batch_size, TRAIN.work, device,
                  progress=not args.no_progress) if rank == 0 else None
    losses, seconds, norms = [], [], []
    try:
        for step in range(first, first + args.steps):
            start = time.perf_counter()
            if log is not None:
                log.start_step()
            if recorder is not None:
                recorder.start(step)
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            # the step's micro-batches, inputs and targets alike, on this rank's device (the data comes on the CPU)
            batches = [batch_to(batch, device) for batch in data.micro_batches(step)]
            loss = global_loss(runner.step(batches), runner.holds_loss, device)
            if recorder is not None:
                recorder.before_step()   # the step's starting parameters and complete gradients, for --verify
            # the global gradient norm, clipped as the build says (None where nothing asks for it: --verify does)
            norm = runner.grad_norm(TRAIN.clip_grad) if TRAIN.needs_grad_norm or recorder is not None else None
            norms.append(norm)
            optimizer.step()
            scheduler.step()
            if recorder is not None:
                recorder.end(loss)
            seconds.append(time.perf_counter() - start)
            losses.append(loss)
            if log is not None:
                log.write(log.fields(StepResult(step, loss, seconds[-1], lr=lr, grad_norm=norm)))
            check_loss(loss, step, rank)
            if checkpoints.due(step + 1, last=step == first + args.steps - 1):
                checkpoints.save(step + 1, rank, runner.state, optimizer, scheduler)
    finally:
        checkpoints.release()
        if log is not None:
            log.close()
    if args.save_params:
        save_whole_parameters(runner.modules, rank, run_dir, names)
    if recorder is not None:
        recorder.save(run_dir)
    write_rank_result(run_dir, rank, losses, seconds, optimizer_spec.resolve_impl(device).value, norms, first,
                      checkpoints.resumed)
    dist.barrier()


def main(argv=None):
    die_with_launcher()   # a rank ends with its launcher (runtime/lifetime.py)
    raise_on_terminate()  # SIGTERM removes what a save was writing before the rank ends
    try:
        return _main(argv)
    except Terminated as e:
        die_of(e.signum, f"meshplan rank {os.environ.get('RANK', '?')}: {e}")


def _main(argv):
    here = Path(__file__).resolve().parent
    try:
        args = script_args(sys.argv[1:] if argv is None else argv, str(here))
        rank = check_world(WORLD_SIZE)
        checkpoints = open_checkpoints(args, TRAIN.model_ref, TRAIN.global_batch_size)
    except ValueError as e:   # the same on every rank: each exits with it before talking to the others
        print(f"meshplan rank {os.environ.get('RANK', '?')}: error: {e}", file=sys.stderr, flush=True)
        return 2
    backend = join(args, rank, WORLD_SIZE)
    try:
        train(args, rank, backend, checkpoints)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
