"""The `meshplan codegen` and `meshplan run` verbs (parsers live in planner/app/cli.py).

    meshplan codegen examples/models/gpt.py:build --arg preset=tiny --batch 8 \\
        --data 2 --tensor 2 --pipeline 2 --micro-batch 2 --schedule 1f1b --dtype fp32 -o build/
    meshplan codegen examples/models/gpt.py:build --plan plan.json -o build/
    meshplan codegen examples/models/gpt.py:build --batch 8 --data 2 --tensor 2 --target torch -o build/
    meshplan run build/ --steps 3 --backend gloo --verify
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import planner
from codegen.dataset_flags import check_dataset, dataset_spec
from codegen.emit import capture_ref, emit
from codegen.torch_target.script import emit_torch
from codegen.train_flags import execution_of, optimizer_and_schedule
from cost_models.step_costs import StepSetup
from planner.app.cli_args import config_from_flags, output_dir
from planner.capabilities import RuntimeSupport, TargetError
from planner.config import ConfigError
from planner.fixed_plan import make_fixed_plan  # noqa: F401  (importable from here, as before)
from planner.plan import MAX_WORLD
from runtime.execute.eval_support import check_supported
from runtime.execute.evaluation import EvalSpec, eval_setting
from runtime.launch.launcher import read_build, run_local, stop_reasons
from runtime.lifetime import Interrupted
from runtime.execute.loss_scale import loss_scale_for
from runtime.spec import computes_grad_norm
from runtime.materialize import check_checkpoint_file
from runtime.tensorboard_log import require_tensorboard
from runtime.vocab import Target
from runtime.documents import read_document


# `meshplan run --verify`'s exit status when no sample-exact check applies (dropout): neither a pass (0)
# nor a difference (1)
VERIFY_NOT_APPLICABLE = 3

# Rank scripts one codegen writes (each is lowered, checked and compiled: the MLP at data 1024 takes
# 20 s, at 4096 140 s on 2 busy cores); plans may be larger (planner.plan.MAX_WORLD): priced, not generated.
MAX_CODEGEN_WORLD = 4096


def codegen_command(args: argparse.Namespace, kwargs: dict, data_kwargs: dict | None) -> int:
    dataset = dataset_spec(args)  # its flags are checked before the (slow) capture
    if args.init == "checkpoint" and args.checkpoint:
        check_checkpoint_file(args.checkpoint)
    if args.plan:
        plan = planner.Plan.load(args.plan)
        if plan.config.num_devices > MAX_CODEGEN_WORLD:
            raise ValueError(f"plan {args.plan} has {plan.config.num_devices} devices; meshplan codegen writes at "
                             f"most {MAX_CODEGEN_WORLD} rank scripts")
        scaling = _loss_scaling(args, plan.config.dtype)
        graph = capture_ref(args.model, kwargs, batch_size=plan.config.micro_batch_size)
        if graph.fingerprint == plan.graph_fingerprint:  # else emit names the other model
            plan.check_layers([layer.name for layer in graph.layers])
    else:
        if args.batch is None:
            raise ValueError("give --plan PLAN.json, or the configuration with at least --batch (global batch size)")
        cfg = config_from_flags(args, micro_batch_size=args.micro_batch, recompute=args.recompute, dtype=args.dtype)
        check_fixed_config(cfg, args.batch)
        check_target_config(cfg, args.batch, args.target)
        scaling = _loss_scaling(args, cfg.dtype)
        if args.cluster in (None, "local"):
            cluster = planner.Cluster.preset("local", devices=cfg.num_devices)
        elif args.cluster in planner.Cluster.preset_names():
            cluster = planner.Cluster.preset(args.cluster, nodes=args.nodes)
        else:
            cluster = planner.Cluster.load(args.cluster)
        graph = capture_ref(args.model, kwargs, batch_size=cfg.micro_batch_size)
        plan = make_fixed_plan(graph, cluster, cfg, args.batch, args.target, setup=_step_setup(args, scaling))
    opt, schedule = optimizer_and_schedule(args)
    if dataset is not None:
        check_dataset(dataset, plan.global_batch_size, graph)
    evaluation = eval_setting(None, args.eval_every, args.eval_batches)
    execution = execution_of(args, plan.execution)   # the plan's, as the flags given change it
    if args.target == Target.TORCH:
        return _torch_codegen(args, plan, graph, kwargs, data_kwargs, dataset, opt, schedule, evaluation, scaling,
                              execution)
    build = emit(plan, args.model, args.data_ref, args.output, model_kwargs=kwargs, data_kwargs=data_kwargs,
                 dataset=dataset,
                 graph=graph, loss=args.loss, optimizer=opt, seed=args.seed, data_seed=args.data_seed,
                 init=args.init, checkpoint=args.checkpoint, bucket_bytes=int(args.bucket_mb * 2**20),
                 evaluation=evaluation, schedule=schedule, clip_grad=args.clip_grad, loss_scale=scaling,
                 grad_norm=args.grad_norm, execution=execution)
    print(plan.summary())
    print(f"\nwrote {build.path}/: plan.json, build.json, programs.json, {build.world_size} rank scripts, "
          "run_rank.py, launch_torchrun.sh, launch_mpirun.sh, launch_srun.sh")
    print(f"run it here with:  meshplan run {shlex.quote(str(build.path))} --steps 10")
    return 0


def _torch_codegen(args: argparse.Namespace, plan, graph, kwargs: dict, data_kwargs: dict | None, dataset, opt,
                   schedule, evaluation, scaling, execution) -> int:
    """`meshplan codegen --target torch`: the one SPMD script for PyTorch's parallel stack (codegen/torch_target)."""
    build = emit_torch(plan, args.model, args.data_ref, args.output, graph=graph, model_kwargs=kwargs,
                       data_kwargs=data_kwargs, dataset=dataset, loss=args.loss, optimizer=opt, seed=args.seed,
                       data_seed=args.data_seed, init=args.init, checkpoint=args.checkpoint, evaluation=evaluation,
                       schedule=schedule, clip_grad=args.clip_grad, loss_scale=scaling, grad_norm=args.grad_norm,
                       execution=execution)
    print(plan.summary())
    print(f"\nwrote {build.path}/: plan.json, build.json, {build.script.name} (the same on every rank), "
          "launch_torchrun.sh, launch_srun.sh")
    print(f"run it here with:  meshplan run {shlex.quote(str(build.path))} --steps 10")
    return 0


def _loss_scaling(args: argparse.Namespace, dtype: str):
    """The build's LossScaleSpec (or None) from --loss-scale-init/--loss-scale-growth-interval/--no-loss-scale,
    checked before any capture."""
    return loss_scale_for(dtype, args.loss_scale_init, args.loss_scale_growth_interval,
                          enabled=not args.no_loss_scale)


def check_fixed_config(cfg, global_batch_size: int) -> None:
    """ConfigError before any capture when the configuration cannot run whatever the model:
    more devices than a plan may have, or a batch its micro-batches and data ranks do not split."""
    if cfg.num_devices > MAX_CODEGEN_WORLD:
        raise ConfigError(f"the configuration needs {cfg.num_devices} devices (the product of the degrees); "
                          f"meshplan codegen writes at most {MAX_CODEGEN_WORLD} rank scripts")
    if cfg.data > global_batch_size:
        raise ConfigError(f"--data {cfg.data} is more data ranks than the {global_batch_size} samples of --batch; "
                          f"use --data {global_batch_size} or fewer")
    cfg.micro_batches(global_batch_size)


def check_target_config(cfg, global_batch_size: int, target: Target) -> None:
    """TargetError (a ConfigError) before any capture when `target` does not run the configuration."""
    why = RuntimeSupport.for_target(target).why_not(cfg, global_batch_size)
    if why:
        raise TargetError(f"codegen --target {target} for {cfg.short()}: {why}")


def _step_setup(args: argparse.Namespace, scaling) -> StepSetup:
    """What the build's step runs besides the model, for the cost model (cost_models/step_costs.py)."""
    return StepSetup(optimizer=args.optimizer, optimizer_impl=args.optimizer_impl, clip_grad=args.clip_grad is not None,
                     loss_scaling=scaling is not None, loss=args.loss,
                     grad_norm=computes_grad_norm(args.grad_norm, args.clip_grad, scaling is not None))


def checkpoint_args(args: argparse.Namespace) -> list[str]:
    """The rank-script options for `meshplan run --checkpoint-dir/--save-every/--resume`."""
    out = []
    for flag, value in (("--checkpoint-dir", getattr(args, "checkpoint_dir", None)),
                        ("--save-every", getattr(args, "save_every", None)), ("--resume", getattr(args, "resume", None))):
        if value:
            out += [flag, str(value)]
    return out + (["--resume-from-other-run"] if getattr(args, "resume_from_other_run", False) else [])


def eval_args(args: argparse.Namespace) -> list[str]:
    """The rank-script options for `meshplan run --eval-every/--eval-batches` (they override the build's)."""
    out = []
    for flag, value in (("--eval-every", getattr(args, "eval_every", None)),
                        ("--eval-batches", getattr(args, "eval_batches", None))):
        if value is not None:
            out += [flag, str(value)]
    return out


def trace_args(args: argparse.Namespace) -> list[str]:
    """The rank-script option for `meshplan run --trace/--no-trace` (neither: the first steps' window)."""
    if getattr(args, "trace", False):
        return ["--trace"]
    return ["--no-trace"] if getattr(args, "no_trace", False) else []


def tensorboard_args(args: argparse.Namespace) -> list[str]:
    """The rank-script option for `meshplan run --tensorboard DIR` (an absolute path), checked before any
    process starts: TensorBoardMissing (a ValueError) names the extra to install."""
    board = getattr(args, "tensorboard", None)
    if not board:
        return []
    require_tensorboard()
    return ["--tensorboard", str(output_dir(board, "--tensorboard").resolve())]


def read_checked_build(build: str) -> dict:
    """build.json of a build directory, refused (ValueError) when its world size is not a
    number of processes from 1 to MAX_WORLD (a hand-edited or damaged file)."""
    info = read_build(build)
    world = info.get("world_size") if isinstance(info, dict) else None
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"{Path(build) / 'build.json'}: world_size is {world!r}, not a number of processes "
                         f"from 1 to {MAX_WORLD}; the file was edited or damaged: run meshplan codegen again")
    return info


def check_run_eval(build: str, info: dict, every: int | None, batches: int | None) -> None:
    """EvalError before any rank starts when `meshplan run --eval-every/--eval-batches` with the build's
    own setting asks for an evaluation the build cannot do (the ranks check it again)."""
    train = info.get("train") if isinstance(info.get("train"), dict) else {}
    own = EvalSpec.from_dict(train["eval"]) if train.get("eval") is not None else None
    if eval_setting(own, every, batches) is None:
        return
    plan = Path(build) / "plan.json"
    config = read_document(plan, "plan file").get("config", {}) if plan.is_file() else {}
    check_supported(dict(info.get("mesh") or {}), bool(config.get("bidirectional")))


def run_command(args: argparse.Namespace) -> int:
    info = read_checked_build(args.build)
    check_run_eval(args.build, info, getattr(args, "eval_every", None), getattr(args, "eval_batches", None))
    board = tensorboard_args(args)
    print(f"running {args.build}: {info['world_size']} processes ({args.backend}), {args.steps} step(s)",
          flush=True)
    try:
        res = run_local(args.build, steps=args.steps, backend=args.backend, timeout=args.timeout,
                        verify=args.verify, rtol=args.rtol, atol=args.atol,
                        extra_args=(["--track-memory"] if getattr(args, "track_memory", False) else [])
                        + (["--probe-comm"] if getattr(args, "probe_comm", False) else [])
                        + ["--heartbeat-timeout", str(getattr(args, "heartbeat_timeout", 30.0))]
                        + trace_args(args) + checkpoint_args(args) + eval_args(args) + board,
                        progress=not getattr(args, "quiet", False))
    except Interrupted as e:
        print(f"meshplan run: {e}; every rank was stopped (logs in {Path(args.build) / 'run'})", file=sys.stderr)
        return 128 + e.signum
    errors = [ln for ln in res.output.splitlines() if "error" in ln.lower() or "stopping" in ln.lower()]
    if res.returncode != 0:
        print(f"meshplan run: the run failed (exit status {res.returncode}):", file=sys.stderr)
        for ln in stop_reasons(args.build, res) + (errors[-20:] or res.output.splitlines()[-20:]):
            print("  " + ln, file=sys.stderr)
        return 1
    if res.resumed_from:
        print(f"resumed from checkpoint {res.resumed_from} (step {res.first_step})")
    losses, seconds = res.losses.get(0, []), res.seconds.get(0, [])
    for k, loss in enumerate(losses):
        secs = seconds[k] if k < len(seconds) else 0.0
        print(f"step {res.first_step + k}: loss {loss:.6f}  ({secs * 1e3:.1f} ms)")
    for ev in res.evals:
        print(ev.line())
    build = Path(args.build)
    print(f"wrote {build / 'metrics.jsonl'}"
          + (", timeline.json and trace.json (ui.perfetto.dev)" if res.timeline is not None else " (no trace)"))
    if res.timeline is not None:
        frac = res.timeline.overlap_fraction()
        if frac is not None:
            print(f"gradient all-reduce hidden behind backward: {frac:.0%}")
    if args.verify:
        cmp = res.comparison
        print("verify against the single-process reference: " + cmp.summary())
        if cmp.inapplicable:
            print("meshplan run: --verify does not apply to this model (see above); the run itself finished",
                  file=sys.stderr)
            return VERIFY_NOT_APPLICABLE
        if not cmp.ok:
            print("meshplan run: error: the parallel run differs from the single-process run (see above)",
                  file=sys.stderr)
            return 1
    return 0
