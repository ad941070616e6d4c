"""`codegen.emit`: write a build directory that trains the plan on a cluster.

    build/
      plan.json            the Plan
      build.json           the training setup (TrainSpec) and what the ranks check
      programs.json        every rank's Program (for the simulator and for reading)
      graph.json           the captured ModelGraph: what `simulate` and `compare` need from
                           the model, so that they never import the model's code
      rank_0000.py ...     one readable script per rank: its stages' generated code, its
                           process groups, its Program; runs with only `runtime` and the
                           user's model code importable
      run_rank.py          picks this process's rank script from the launcher's environment
      launch_torchrun.sh   torchrun (gloo on CPU, nccl on GPU)
      launch_mpirun.sh     mpirun with the mpi4py communicator
      launch_srun.sh       a Slurm batch script (srun)

Every launcher passes its arguments on to the rank scripts (--steps N, --backend ...).

Strings from the user (references, arguments, paths) and from the model (module paths,
source lines) land in generated Python only as literals, comments or docstrings escaped by
codegen/pysrc.py (py_literal, comment_text, doc_text), and in shell scripts only quoted
by shlex.quote or as arguments: a generated file never runs them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from codegen.launchers import launch_scripts
from codegen.lower import DEFAULT_BUCKET_BYTES, lower_plan
from codegen.throughput import step_work
from codegen.partition import Partition, stage_imports
from codegen.pysrc import comment_text, doc_text, py_literal
from codegen.strategies import registry
from planner.binding import graph_mismatch
from planner.graph.capture import capture_ref
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.datasets import DatasetSpec
from runtime.execute.eval_support import check_program
from runtime.execute.evaluation import EvalSpec
from runtime.execution import Execution
from runtime.execute.lr_schedule import ScheduleSpec
from runtime.execute.optim import OptimizerSpec
from runtime.program import Program
from runtime.rank_main import PlanMismatchError
from runtime.refs import RefError, check_call, load_callable
from runtime.execute.loss_scale import LossScaleSpec
from runtime.spec import TrainSpec


# The captured ModelGraph in a build (planner/graph/model.py's JSON): readers of a build use it instead
# of capturing the model again, which would import and run the model's code.
GRAPH_FILE = "graph.json"


@dataclass(frozen=True)
class Build:
    """What emit wrote."""

    path: Path
    world_size: int
    programs: dict[int, Program]
    train: TrainSpec

    def rank_script(self, rank: int) -> Path:
        return self.path / f"rank_{rank:04d}.py"


def train_spec(plan: Plan, model_ref: str, data_ref: str | None = None, *, model_kwargs: dict | None = None,
               data_kwargs: dict | None = None, graph: ModelGraph | None = None, loss: str = "cross_entropy",
               optimizer: OptimizerSpec | dict | None = None, seed: int = 0, data_seed: int = 1000,
               init: str = "seed", checkpoint: str | None = None, root: str | None = None,
               dataset: DatasetSpec | None = None, evaluation: EvalSpec | None = None,
               schedule: ScheduleSpec | None = None, clip_grad: float | None = None,
               loss_scale: LossScaleSpec | None = None, grad_norm: bool = True,
               execution: Execution | None = None) -> tuple[ModelGraph, TrainSpec]:
    """(the model's captured graph, the build's TrainSpec) for `emit`'s arguments (see there): the
    graph captured from model_ref when not given, and checked against the plan's (PlanMismatchError)."""
    model_kwargs = dict(model_kwargs or {})
    default_data = data_ref is None and dataset is None
    if default_data:
        data_ref = f"{model_ref.rsplit(':', 1)[0]}:example_batch"
        if data_kwargs is None:
            data_kwargs = dict(model_kwargs)
    if dataset is None:   # the ranks read their batches from it: refuse a missing or unfit one now, not at run time
        _check_data_factory(data_ref, dict(data_kwargs or {}), root, default_data)
    if graph is None:
        graph = capture_ref(model_ref, model_kwargs, batch_size=plan.config.micro_batch_size)
    mismatch = graph_mismatch(plan, graph)
    if mismatch:
        raise PlanMismatchError(f"{model_ref} with {model_kwargs}: {mismatch}; make the plan again for this model")
    if isinstance(optimizer, dict):
        optimizer = OptimizerSpec.from_dict(optimizer)
    train = TrainSpec(model_ref=model_ref, data_ref=data_ref or "", global_batch_size=plan.global_batch_size,
                      dataset=dataset, model_kwargs=model_kwargs, data_kwargs=dict(data_kwargs or {}), seed=seed,
                      data_seed=data_seed, loss=loss, optimizer=optimizer or OptimizerSpec(), init=init,
                      checkpoint=checkpoint, dtype=plan.config.dtype, root=str(Path(root or os.getcwd()).resolve()),
                      eval=evaluation,
                      schedule=schedule or ScheduleSpec(), clip_grad=clip_grad, loss_scale=loss_scale,
                      grad_norm=grad_norm, work=step_work(plan, graph), execution=execution or plan.execution)
    return graph, train


def _check_data_factory(data_ref: str, data_kwargs: dict, root: str | None, default: bool) -> None:
    """RefError unless `data_ref` names a function the ranks can call as fn(batch_size, seed, **data_kwargs)."""
    try:
        check_call(load_callable(data_ref, root, "data factory"), data_kwargs, ref=data_ref, what="data factory",
                   batch_size=1, seed=0)
    except RefError as e:
        if not default:
            raise
        raise RefError(f"{e}. Every rank reads its training batches from the model file's "
                       "example_batch(batch_size, seed, **kwargs) -> (inputs, targets): define it there (README, "
                       "'Your own model'), or name another with --data-ref or a torch Dataset with --dataset") from None


class ExecutionError(ValueError):
    """Execution options (compiled stages, the fused loss, the padded vocabulary) the build cannot run;
    the message names the option and why."""


def check_execution(plan: Plan, execution: Execution, loss: str) -> None:
    """ExecutionError naming the option and the plan's strategy or the loss it does not run with."""
    cfg = plan.config
    blocked = [s.exchanges_in_layers for s in registry.active(plan) if s.exchanges_in_layers]
    for option, on in (("--compile", execution.compile), ("--loss-impl chunked", execution.chunked),
                       ("--loss-impl compiled", execution.compiled_loss)):
        if on and blocked:
            raise ExecutionError(f"{option} does not run with {blocked[0]}: its stages exchange tiles, paths or "
                                 f"sequence chunks inside their layers; leave {option.split()[0]} out")
    if execution.whole_stage and cfg.recompute != "none":
        # torch.compile cannot trace the runtime's recomputation (torch.utils.checkpoint with its context_fn)
        # inside a compiled forward; regional compilation puts the checkpoint around the compiled blocks
        raise ExecutionError(f"--compile-scope stage does not run with recompute {cfg.recompute}: torch.compile "
                             "cannot trace the recomputation inside the stage's forward; use --compile-scope blocks "
                             "or --recompute none")
    if execution.chunked and loss != "cross_entropy":
        raise ExecutionError(f"--loss-impl chunked fuses a cross-entropy loss with the output layer; this build's "
                             f"loss is {loss}: use --loss-impl full")
    if execution.compiled_loss and loss != "cross_entropy":
        raise ExecutionError(f"--loss-impl compiled compiles a cross-entropy loss over the logits; this build's "
                             f"loss is {loss}: use --loss-impl full")


def check_loss_split(parts: Partition, execution: Execution) -> None:
    """ExecutionError when the compiled loss is asked for but the last stage's logits are split by class over
    the tensor ranks (their vocabulary-parallel loss exchanges statistics between ranks and runs eager)."""
    if execution.compiled_loss and any(sp.spec.is_last and sp.spec.output_split is not None for sp in parts.stages):
        raise ExecutionError("--loss-impl compiled needs the whole logits on each rank, but this plan splits the "
                             "output layer over the vocabulary (tensor parallelism); use --loss-impl chunked, which "
                             "runs split, or --loss-impl full")


def emit(plan: Plan, model_ref: str, data_ref: str | None = None, out_dir: str | os.PathLike = "build", *,
         model_kwargs: dict | None = None, data_kwargs: dict | None = None, graph: ModelGraph | None = None,
         loss: str = "cross_entropy", optimizer: OptimizerSpec | dict | None = None, seed: int = 0,
         data_seed: int = 1000, init: str = "seed", checkpoint: str | None = None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, root: str | None = None,
         dataset: DatasetSpec | None = None,
         evaluation: EvalSpec | None = None,
         schedule: ScheduleSpec | None = None,
         clip_grad: float | None = None, loss_scale: LossScaleSpec | None = None, grad_norm: bool = True,
         execution: Execution | None = None) -> Build:
    """Write the build directory for `plan` (see module docstring).

    Args:
        model_ref: the model factory, e.g. "examples/models/gpt.py:build"; model_kwargs its arguments.
        data_ref: the batch factory fn(batch_size, seed, **data_kwargs) -> ((inputs...), targets);
            default: example_batch in the model's file (with the model's kwargs).
        graph: the captured graph the plan was made from (captured again from model_ref if None).
        loss, optimizer, seed, data_seed, init, checkpoint, schedule, clip_grad, loss_scale: the training setup
            (runtime/spec.py; loss_scale: fp16 dynamic loss scaling, runtime/execute/loss_scale.py, None: none).
        grad_norm: report the global gradient norm every step (False: compute it only where the step
            clips or scales the loss; TrainSpec.grad_norm).
        bucket_bytes: gradient bucket size for the data-parallel reduction.
        dataset: a torch Dataset by reference (runtime.datasets.DatasetSpec), read instead of a batch
            factory; give it without data_ref.
        execution: how the stages' compute runs (runtime/execution.py); None: the plan's. The build's
            plan.json records the one it runs.

    Raises PlanMismatchError when model_ref builds another model than the plan's, and
    ValueErrors (PartitionError, LoweringError, TensorSplitError, ExecutionError) for plans the runtime
    cannot run.
    """
    execution = execution or plan.execution
    check_execution(plan, execution, loss)
    plan = dataclasses.replace(plan, execution=execution)
    graph, train = train_spec(plan, model_ref, data_ref, model_kwargs=model_kwargs, data_kwargs=data_kwargs,
                              graph=graph, loss=loss, optimizer=optimizer, seed=seed, data_seed=data_seed, init=init,
                              checkpoint=checkpoint, root=root, dataset=dataset, evaluation=evaluation,
                              schedule=schedule, clip_grad=clip_grad, loss_scale=loss_scale, grad_norm=grad_norm,
                              execution=execution)
    model_kwargs = train.model_kwargs
    decay_of = train.optimizer.decays if train.optimizer.splits_decay else None   # buckets: one class each
    parts, programs = lower_plan(plan, graph, bucket_bytes=bucket_bytes, decay_of=decay_of)
    check_loss_split(parts, execution)
    if evaluation is not None:   # as the ranks check it, from what the Programs run
        check_program(programs[0])
    # every rank script is written (and compiled) before any file is: a failure leaves no half build
    scripts = {rank: rank_script(rank, prog, parts, train, plan, model_ref, model_kwargs)
               for rank, prog in programs.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = len(programs)
    plan.save(out / "plan.json")
    graph.save(out / GRAPH_FILE)
    (out / "build.json").write_text(json.dumps({
        "train": train.to_dict(), "world_size": world, "mesh": dict(plan.mesh),
        "schedule": plan.config.schedule, "micro_batches": programs[0].num_micro_batches,
        "signature": {"hash": parts.signature, "shapes": parts.tensor_shapes},
        "graph_fingerprint": plan.graph_fingerprint, "bucket_bytes": bucket_bytes, **node_layout(plan),
        "stages": {str(sp.spec.index): sp.spec.to_dict() for sp in parts.stages},
        "random_ops": list(graph.random_ops),   # runtime/verify/__init__.py says why they rule out a sample-exact check
    }, indent=1))
    (out / "programs.json").write_text(json.dumps({str(r): p.to_dict() for r, p in programs.items()}))
    for rank, text in scripts.items():
        path = out / f"rank_{rank:04d}.py"
        path.write_text(text)
        _executable(path)
    (out / "run_rank.py").write_text(_RUN_RANK.replace("@WORLD@", str(world)))
    for name, text in launch_scripts(plan, world, str(out.resolve())).items():
        (out / name).write_text(text)
        _executable(out / name)
    for f in ("metrics.jsonl",):
        if (out / f).exists():
            (out / f).unlink()
    return Build(out, world, programs, train)


def _executable(path: Path) -> None:
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def rank_script(rank: int, prog: Program, parts: Partition, train: TrainSpec, plan: Plan, model_ref: str,
                model_kwargs: dict) -> str:
    """The source of one rank's script."""
    mine = [sp for sp in parts.stages if sp.spec.index in prog.stages]
    groups = {a: list(prog.group(a)) for a, _ in prog.mesh}
    cfg = plan.config
    # the reader's summary: every line holds names from the user, the plan or the model, so
    # each goes through doc_text (it cannot close the docstring; TRAIN below holds the values)
    summary = [
        f"Model: {model_ref} {model_kwargs or ''}".rstrip(),
        "Plan:  " + " x ".join(f"{a} {s}" for a, s in prog.mesh)
        + f", {cfg.schedule}" + (f" (v={cfg.virtual_stages})" if cfg.schedule == "interleaved" else "")
        + f", {prog.num_micro_batches} micro-batches of {prog.micro_batch_size}, recompute {cfg.recompute}, "
        f"ZeRO {prog.zero}, {cfg.dtype}",
        "This rank: " + ", ".join(f"{a} {c}" for (a, _), c in zip(prog.mesh, prog.coords))
        + "; stages " + ", ".join(f"{sp.spec.index} ({sp.spec.layers[0]} .. {sp.spec.layers[-1]})" for sp in mine),
        "Process groups (global ranks): " + ", ".join(f"{a} {g}" for a, g in groups.items()),
        *([f"Execution: {' '.join(train.execution.options())}"] if not train.execution.is_default else []),
        *(line for s in registry.active(plan) for line in s.reader_lines(prog)),
    ]
    head = [
        "#!/usr/bin/env python3",
        f'"""meshplan build, rank {rank} of {prog.world_size}.',
        "",
        *(doc_text(line) for line in summary),
        "",
        "Generated by `meshplan codegen`: change the plan and generate again rather than editing.",
        "Run through run_rank.py or a launch script; options: --steps N --backend gloo|nccl|mpi --out DIR.",
        '"""',
        "",
        "import os",
        "import sys",
        "",
        *stage_imports(mine),
        "",
        "from runtime.rank_main import run_rank",
        "",
        f"RANK = {rank}",
        f"MESH = {dict(prog.mesh)!r}",
        f"COORDS = {dict(zip((a for a, _ in prog.mesh), prog.coords))!r}",
        f"GROUPS = {groups!r}  # for the reader: the runtime builds them from MESH",
        "",
    ]
    body = []
    for sp in mine:
        body += ["", f"# {'=' * 78}", f"# stage {sp.spec.index}: {len(sp.spec.layers)} layers", f"# {'=' * 78}", "",
                 sp.source.rstrip(), ""]
    specs = {sp.spec.index: sp.spec.to_dict() for sp in mine}
    tail = [
        "",
        f"STAGE_SPECS = {py_literal(specs)}",
        "",
        "# " + "=" * 78,
        "# this rank's Program (one training step)",
        *[f"#   {comment_text(line)}" for line in str(prog).splitlines()],
        "PROGRAM = " + py_literal(prog.to_dict(), width=120),
        "",
        f"TRAIN = {py_literal(train.to_dict())}",
        "",
        f"SIGNATURE = {{'hash': {parts.signature!r}, 'shapes': {{}}}}  # shapes: see build.json",
        "",
        "",
        "def main(argv=None):",
        "    here = os.path.dirname(os.path.abspath(__file__))",
        "    stages = {" + ", ".join(f"{sp.spec.index}: ({sp.class_name}, STAGE_SPECS[{sp.spec.index}])"
                                    for sp in mine) + "}",
        "    return run_rank(rank=RANK, program=PROGRAM, stages=stages, train=TRAIN, signature=SIGNATURE,",
        "                    argv=sys.argv[1:] if argv is None else argv, build_dir=here)",
        "",
        "",
        'if __name__ == "__main__":',
        "    sys.exit(main())",
        "",
    ]
    text = "\n".join(head + body + tail)
    compile(text, f"rank_{rank:04d}.py", "exec")
    return text


_RUN_RANK = '''#!/usr/bin/env python3
"""Start this process's rank script; the rank comes from the launcher's environment
(torchrun: RANK, mpirun: OMPI_COMM_WORLD_RANK / PMI_RANK, srun: SLURM_PROCID)."""

import os
import runpy
import sys
from pathlib import Path

WORLD_SIZE = @WORLD@
HERE = Path(__file__).resolve().parent


def _env(names):
    for k in names:
        v = os.environ.get(k, "").strip()
        if v.isdigit():
            return int(v), k
    return None, None


def main() -> int:
    rank, _ = _env(("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"))
    size, var = _env(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"))
    if rank is None:
        rank = 0
        if WORLD_SIZE != 1:
            print(f"meshplan: error: no rank in the environment; start this build with one of its launch "
                  f"scripts ({WORLD_SIZE} processes)", file=sys.stderr)
            return 2
    if size is not None and size != WORLD_SIZE:
        print(f"meshplan rank {rank}: error: the plan needs {WORLD_SIZE} processes, but {size} were started "
              f"({var}={size}); start exactly {WORLD_SIZE}", file=sys.stderr)
        return 2
    script = HERE / f"rank_{rank:04d}.py"
    if not script.is_file():
        print(f"meshplan rank {rank}: error: {script} is missing; generate the build again", file=sys.stderr)
        return 2
    return runpy.run_path(str(script), run_name="meshplan_rank")["main"](sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
'''


def node_layout(plan: Plan) -> dict:
    """What build.json records of the plan's cluster for the launch checks (runtime/launch/placement.py,
    runtime/join.py): its node count and devices per node (rank r runs on node r // devices_per_node)."""
    return {"nodes": plan.cluster.num_nodes, "devices_per_node": plan.cluster.devices_per_node}


__all__ = ["GRAPH_FILE", "Build", "ExecutionError", "PlanMismatchError", "capture_ref", "check_execution", "emit",
           "node_layout", "rank_script", "train_spec"]
