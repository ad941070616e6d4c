"""What the torch target's generated script (codegen/torch_target/script.py) needs from the runtime:
its launch options, joining the launcher's rendezvous, and the files `meshplan run --verify` reads.

The script is one SPMD program, the same on every rank, that applies the plan with PyTorch's own
parallel stack (DeviceMesh, DTensor, FSDP2, torch.distributed.pipelining). It is started exactly as
a meshplan build's ranks are (`meshplan run`, launch_torchrun.sh, launch_srun.sh) and takes the same
options (runtime/launch/rank_args.parse_args); those it cannot honour are refused before it talks to any
other rank, with the same message on every rank. It records no Timeline (--trace and --no-trace
change nothing; `meshplan run` then writes no trace) and runs no heartbeats (--heartbeat-timeout
changes nothing): a failing rank exits with its error, the launcher ends the others after its
grace period (runtime/launch/launcher.py, runtime/lifetime.py), and a rank waiting on a dead peer fails
after --timeout seconds, torch.distributed's collective timeout. Checkpoints (--checkpoint-dir,
--save-every, --resume) are Distributed Checkpoints: runtime/torch_script_checkpoint.py.

What --verify reads (runtime/verify/__init__.py) is written in the form of a one-stage build whose rank 0
holds the whole model: rank 0 gathers every parameter and gradient as whole tensors under the
model's own names (DTensor.full_tensor over its mesh, then a gather over the ranks, which also
joins the pipeline stages) and saves them as run/steps_rank_0000.pt (each step, before the
optimizer changes anything) and run/params_rank_0000.pt (after the last step). build.json's
WHOLE_MODEL_KEY entry describes that view (`whole_model_view`); every rank writes
run/rank_XXXX.json with its losses and step times, as rank scripts do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from runtime.comm import CommError
from runtime.execute.optim import OptimizerImpl, OptimizerSpec
from runtime.launch.placement import cuda_index
from runtime.launch.rank_args import LaunchError, parse_args
from runtime.comm.store_host import host_store, listen_address
from runtime.torch_records import whole_model_spec
from runtime.vocab import Backend

# name parts torch's wrappers put into parameter names (checkpoint_wrapper, torch.compile, FSDP1): the
# model's own name is the name without them
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def script_args(argv: list[str], default_out: str) -> argparse.Namespace:
    """The launcher's options (runtime/launch/rank_args.parse_args); LaunchError for those this script
    cannot honour, naming them and what to use instead."""
    args = parse_args(argv, default_out)
    refused = [flag for flag, given in (
        ("--backend mpi", args.backend == Backend.MPI), ("--eval-every", args.eval_every),
        ("--eval-batches", args.eval_batches),
        ("--tensorboard", args.tensorboard), ("--sabotage", args.sabotage), ("--fail-at", args.fail_at),
        ("--track-memory", args.track_memory), ("--probe-comm", args.probe_comm)) if given]
    if refused:
        raise LaunchError(f"the torch target's script does not take {', '.join(refused)}; generate a meshplan "
                          "build (meshplan codegen without --target torch) for them")
    return args


def join(args: argparse.Namespace, rank: int, world_size: int) -> str:
    """Initialise torch.distributed's default process group on the launcher's rendezvous store; returns
    the backend (nccl with CUDA, else gloo, unless --backend says).

    The store is the launcher's (`meshplan run`, torchrun: TORCHELASTIC_USE_AGENT_STORE=True) or
    hosted by rank 0 on --master-addr:--master-port, as for meshplan's rank scripts (runtime/comm/__init__.py)."""
    backend = args.backend or (Backend.NCCL.value if torch.cuda.is_available() else Backend.GLOO.value)
    if backend == Backend.NCCL:
        torch.cuda.set_device(cuda_index(os.environ, torch.cuda.device_count()))
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            store = host_store(listen_address(args.master_addr), args.master_port, args.timeout, world_size).store
        else:
            store = dist.TCPStore(args.master_addr, args.master_port, world_size, False, timeout=timeout,
                                  wait_for_workers=False)
    except Exception as e:
        raise CommError(f"rank {rank}: cannot reach the rendezvous store at {args.master_addr}:{args.master_port} "
                        f"within {args.timeout:.0f} s ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    dist.init_process_group(backend, store=dist.PrefixStore("torch", store), rank=rank, world_size=world_size,
                            timeout=timeout)
    return backend


def check_world(world_size: int) -> int:
    """This process's rank; LaunchError when the launcher started another number of processes."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    started = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if started != world_size:
        raise LaunchError(f"the plan needs {world_size} processes, but {started} were started; start exactly "
                          f"{world_size} (through the build's launch scripts or meshplan run)")
    return rank


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of `model`'s parameters and buffers -> its canonical name, the one
    named_parameters / named_buffers give it (the first; a tied weight has several names, and a
    pipeline stage may hold it under another than the canonical one). Call before parallelizing."""
    first: dict[int, str] = {}
    out = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        out[name] = first.setdefault(id(t), name)
    return out


def model_name(name: str, canonical: dict[str, str]) -> str:
    """The model's canonical name (`canonical_names`) of a parameter or buffer of a wrapped module
    (see _WRAPPER_PARTS)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return canonical.get(name, name)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh), or the tensor itself; on the CPU."""
    full = t.full_tensor() if isinstance(t, dist.tensor.DTensor) else t
    return full.detach().cpu().clone()


def _gathered(local: dict, rank: int) -> dict | None:
    """On rank 0 the union of every rank's `local` (name -> value; the first rank's value of a
    name several hold: replicas are equal); None elsewhere."""
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    if rank != 0:
        return None
    out: dict = {}
    for part in parts:
        for name, value in part.items():
            out.setdefault(name, value)
    return out


def whole_parameters(modules: list[nn.Module], rank: int, canonical: dict[str, str],
                     grads: bool = False) -> dict | None:
    """On rank 0: canonical name -> (whole value, whole gradient or None) of every parameter the
    `modules` of all ranks hold (with `grads`), else canonical name -> whole value. Every rank calls it."""
    local = {}
    for m in modules:
        for name, p in m.named_parameters():
            value = _whole(p)
            if grads:
                local[model_name(name, canonical)] = (value, _whole(p.grad) if p.grad is not None else None)
            else:
                local[model_name(name, canonical)] = value
    return _gathered(local, rank)


def whole_buffers(modules: list[nn.Module], rank: int, canonical: dict[str, str]) -> dict | None:
    """On rank 0: model name -> whole value of every floating-point buffer the `modules` hold."""
    local = {model_name(n, canonical): _whole(b) for m in modules for n, b in m.named_buffers() if b.is_floating_point()}
    return _gathered(local, rank)


class WholeModelRecorder:
    """Rank 0's record of every step for --verify (runtime/verify/step_record.py's file format, as a
    one-stage rank holding the whole model; no coordinates: assemble_files reads them as 0 on every axis)."""

    def __init__(self, modules: list[nn.Module], rank: int, canonical: dict[str, str]):
        self._modules = modules
        self._rank = rank
        self._canonical = canonical
        self._steps: list[dict] = []
        self._current: dict = {}
        self._names: list[str] = []
        self._shapes: dict[str, list[int]] = {}

    def start(self, step: int) -> None:
        self._current = {"step": step, "buffers_start": {"0": whole_buffers(self._modules, self._rank, self._canonical)}}

    def before_step(self) -> None:
        """After backward (gradients complete), before clipping and the optimizer step."""
        whole = whole_parameters(self._modules, self._rank, self._canonical, grads=True)
        if whole is None:
            return
        self._names = sorted(whole)
        self._shapes = {f"0/{n}": list(whole[n][0].shape) for n in self._names}
        self._current["optimizer"] = {"state": {
            i: {"value": whole[n][0], "grad": whole[n][1] if whole[n][1] is not None else torch.zeros_like(whole[n][0])}
            for i, n in enumerate(self._names)}}

    def end(self, loss: float) -> None:
        self._current["buffers"] = {"0": whole_buffers(self._modules, self._rank, self._canonical)}
        self._current["loss"] = loss
        self._steps.append(self._current)

    def save(self, run_dir: Path) -> None:
        if self._rank != 0:
            return
        header = {"coords": [], "stage_specs": {"0": json.dumps(whole_model_spec().to_dict())},
                  "buckets": [], "optimizer_params": [f"0/{n}" for n in self._names], "shapes": self._shapes}
        torch.save({**header, "steps": self._steps}, Path(run_dir) / "steps_rank_0000.pt")


def save_whole_parameters(modules: list[nn.Module], rank: int, run_dir: Path, canonical: dict[str, str]) -> None:
    """run/params_rank_0000.pt: the whole model's final parameters as stage 0's (rank 0 writes it)."""
    whole = whole_parameters(modules, rank, canonical)
    if whole is not None:
        torch.save({0: whole}, Path(run_dir) / "params_rank_0000.pt")


def write_rank_result(run_dir: Path, rank: int, losses: list[float], seconds: list[float], optimizer_impl: str,
                      grad_norms: list[float] | None = None, first_step: int = 0,
                      resumed_from: Path | None = None) -> None:
    """run/rank_XXXX.json as meshplan's rank scripts write it (runtime/launch/rank_steps.py): what
    `meshplan run` reports and --verify compares; `first_step`: the step a resumed run started at."""
    record = {"rank": rank, "losses": losses, "seconds": seconds, "stages": [0], "first_step": first_step,
              "optimizer_impl": optimizer_impl, **({"resumed_from": str(resumed_from)} if resumed_from else {})}
    if grad_norms is not None:
        record.update(grad_norms=grad_norms, loss_scales=[None] * len(grad_norms), skipped=[False] * len(grad_norms))
    (Path(run_dir) / f"rank_{rank:04d}.json").write_text(json.dumps(record))


@dataclass(frozen=True)
class Runner:
    """What the torch script trains on this rank: its modules (the whole parallelized model, or its
    pipeline stages), the module whose state a checkpoint holds (the model, or a pipeline rank's stages'
    tensors under the model's names: PipelineRun.state_module), `step(micro_batches) -> this rank's
    mean loss` (forward and backward), whether
    this rank computes the loss (a pipeline's last stage does; every rank without pipelines), and
    `grad_norm(max_norm) -> the whole model's gradient norm` before clipping (clipping to max_norm
    unless it is None; a collective)."""

    modules: list
    state: nn.Module
    step: Callable[[list], float]
    holds_loss: bool
    grad_norm: Callable[[float | None], float]


def optimizer_for(spec: OptimizerSpec, params: list, device: torch.device) -> OptimizerSpec:
    """`spec` with the implementation the torch script steps `params` with. torch's fused optimizer
    kernels have no DTensor sharding rule (aten._fused_sgd_ raises NotImplementedError on DTensors),
    and its foreach kernels refuse a list that mixes DTensors and plain tensors (a tensor-parallel
    model's replicated norms beside its split Linears): DTensor parameters get the foreach kernels
    when every parameter is one, else the for-loop. The run records the implementation (the
    reference steps with the same, runtime/reference.like_the_ranks)."""
    dtensors = sum(isinstance(p, dist.tensor.DTensor) for p in params)
    if not dtensors or spec.resolve_impl(device) is OptimizerImpl.FOR_LOOP:
        return spec
    return spec.with_impl(OptimizerImpl.FOREACH if dtensors == len(params) else OptimizerImpl.FOR_LOOP)
