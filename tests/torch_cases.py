"""Shared by the torch-target tests (planner.parallelize and the generated torch script): the models,
their synthetic batches, the hand-written training loop, the single-process reference run, the
comparison with the tolerances `meshplan run --verify` uses, and a launcher of rank processes.

A case trains for STEPS steps on the global batch of BATCH samples `example_batch(BATCH, seed=step)`:
forward, token cross-entropy, backward, clip_grad_norm_ to CLIP, torch.optim.SGD with momentum and a
StepLR schedule. The reference runs the same loop in one process on the whole model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

import planner
from planner.app.commands import make_fixed_plan
from planner.plan import Plan
from runtime.launch.launcher import free_port
from runtime.lifetime import Children
from runtime.refs import load_callable, load_module
from runtime.verify.rounding import TOLERANCES
from tests.real_models import HF, graph_of

GPT = "examples/models/gpt.py:build"
MODELS = {"gpt": (GPT, {}), "llama": (HF, {"arch": "llama"}), "bert": (HF, {"arch": "bert"})}
# name -> ParallelConfig fields (micro-batch 2, global batch BATCH)
CONFIGS = {
    "d2": dict(data=2),
    "d2_zero3": dict(data=2, zero=3),
    "t2": dict(tensor=2),
    "d2t2": dict(data=2, tensor=2),
    "d2_zero2_selective": dict(data=2, zero=2, recompute="selective"),
    "d2_zero3_full": dict(data=2, zero=3, recompute="full"),
    "t2_sp": dict(tensor=2, sequence_parallel=True),
    "d2t2_zero3": dict(data=2, tensor=2, zero=3),
}
STEPS = 3
BATCH = 8
SEED = 0
CLIP = 0.5          # below the models' gradient norms at the start, so clipping scales every step
LR, MOMENTUM = 0.05, 0.9
LR_STEP, LR_GAMMA = 2, 0.5   # StepLR: the third step runs at half the rate
WRAPPED = "_checkpoint_wrapped_module."   # the child name checkpoint_wrapper gives a wrapped block


def build(model: str) -> torch.nn.Module:
    """The model with the seeded initial weights every process builds alike."""
    ref, kwargs = MODELS[model]
    torch.manual_seed(SEED)
    return load_callable(ref)(**kwargs)


def batch(model: str, step: int) -> tuple[object, torch.Tensor]:
    """The global batch of `step`: (forward's inputs, tuple or dict; targets (BATCH, T) int64)."""
    ref, kwargs = MODELS[model]
    return load_module(ref.rsplit(":", 1)[0]).example_batch(BATCH, step, **kwargs)


def plan_of(model: str, config: str | dict) -> Plan:
    """The plan of `model` under `config` (a CONFIGS name or ParallelConfig fields)."""
    ref, kwargs = MODELS[model]
    graph = graph_of(ref, tuple(sorted(kwargs.items())))
    fields = CONFIGS[config] if isinstance(config, str) else config
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **fields)
    return make_fixed_plan(graph, planner.Cluster.preset("local", devices=cfg.num_devices), cfg, BATCH)


def graph(model: str):
    ref, kwargs = MODELS[model]
    return graph_of(ref, tuple(sorted(kwargs.items())))


def configs_of(case: str) -> tuple[str, tuple[str, ...]]:
    """The model and the CONFIGS names a rank case ("MODEL:CONFIG[:amp|:capture]", "MODEL:dcp:A:B") runs."""
    model, config, *rest = case.split(":")
    return model, tuple(rest) if config == "dcp" else (config,)


def prepare(root: Path, cases: list[str]) -> None:
    """Write the graph of every model and the plan of every configuration the cases need under `root`
    (graph_MODEL.json, plan_MODEL_CONFIG.json), so that the ranks read them instead of capturing."""
    for case in cases:
        model, configs = configs_of(case)
        if not (root / f"graph_{model}.json").exists():
            graph(model).save(root / f"graph_{model}.json")
        for config in configs:
            plan_of(model, config).save(root / f"plan_{model}_{config}.json")


def call(fn, inputs):
    out = fn(**inputs) if isinstance(inputs, dict) else fn(*inputs)
    return out.logits if hasattr(out, "logits") else out


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_optimizer(params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=LR_STEP, gamma=LR_GAMMA)


def train(model: str, forward, clip, optimizer, scheduler, steps: range, *, local=lambda x: x,
          mean=lambda loss: float(loss.detach()), amp: bool = False) -> tuple[list[float], list[float]]:
    """The hand-written loop over `steps`: (losses, gradient norms before clipping). `forward` is the
    (parallel) model, `clip(max_norm)` its clip_grad_norm_, `local` picks this rank's samples and
    `mean` averages its loss over the data ranks (the global batch's loss)."""
    losses, norms = [], []
    for step in steps:
        inputs, targets = batch(model, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = loss_of(call(forward, local(inputs)), local(targets))
        loss.backward()
        norms.append(float(clip(CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(mean(loss))
    return losses, norms


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered: every rank must call this), by its name in the model."""
    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        out[name.replace(WRAPPED, "")] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def reference(model: str, *, amp: bool = False) -> dict:
    """The single-process run: losses, norms and parameters at the start and after STEPS steps."""
    m = build(model)
    start = full_params(m)
    opt, sched = make_optimizer(m.parameters())
    clip = lambda max_norm: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)   # noqa: E731
    losses, norms = train(model, m, clip, opt, sched, range(STEPS), amp=amp)
    return {"losses": losses, "norms": norms, "params": full_params(m), "start": start}


def mismatches(run: dict, ref: dict, dtype: str = "fp32") -> list[str]:
    """Where `run` differs from `ref` beyond --verify's trajectory tolerances (runtime/verify/__init__.py): each
    loss and gradient norm within floor x its size, each parameter within floor x how far training moved
    it (floor 1e-4 for fp32, 2e-2 under bf16 autocast). A tensor training barely moves (BERT's key bias,
    whose gradient is zero up to rounding) is measured against the model's movement per element instead,
    as --verify's per-step check measures a gradient against the rms of all of them (its atol term)."""
    floor = TOLERANCES[dtype]["floor"]
    bad = []
    for what in ("losses", "norms"):
        for k, (got, want) in enumerate(zip(run[what], ref[what])):
            if not abs(got - want) <= floor * abs(want):
                bad.append(f"{what}[{k}]: {got!r} vs the reference's {want!r}")
    if set(run["params"]) != set(ref["params"]):
        bad.append(f"parameter names differ: {sorted(set(run['params']) ^ set(ref['params']))}")
    moved = {n: float((w.double() - ref["start"][n].double()).norm()) for n, w in ref["params"].items()}
    rms = (sum(m * m for m in moved.values()) / sum(w.numel() for w in ref["params"].values())) ** 0.5
    for name, want in ref["params"].items():
        got = run["params"].get(name)
        if got is None:
            continue
        err = float((got.double() - want.double()).norm())
        if not err <= floor * max(moved[name], rms * want.numel() ** 0.5):
            bad.append(f"{name}: {err:.3g} from the reference (training moved it {moved[name]:.3g})")
    return bad


def launch(world: int, module: str, args: list[str], *, timeout: float) -> None:
    """Run `python -m module *args` as `world` ranks of one gloo job (RANK, WORLD_SIZE, MASTER_ADDR/PORT);
    every rank is ended when any fails, at `timeout` seconds, or when this process is stopped
    (runtime.lifetime.Children). AssertionError with the ranks' output tail on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    logs = [Path(args[0]) / f"rank{r}.log" for r in range(world)]
    with Children(stop_grace=5.0) as kids:
        procs = []
        for r in range(world):
            with open(logs[r], "w") as log:
                procs.append(kids.popen([sys.executable, "-m", module, *args], env=dict(env, RANK=str(r)),
                                        stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline \
                and not any(p.poll() not in (None, 0) for p in procs):
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
    if codes != [0] * world:
        tails = "\n".join(f"--- rank {r} (exit {c}):\n{logs[r].read_text()[-3000:]}" for r, c in enumerate(codes))
        raise AssertionError(f"{module} failed or ran past {timeout:.0f} s\n{tails}")


