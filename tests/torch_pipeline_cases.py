"""Pipeline plans run on torch.distributed.pipelining (runtime/torch_stack/pipeline.py) as real
processes (gloo), and their single-process reference.

A case is a model and a plan configuration. The test process makes the plan and its TorchLayout
(codegen/torch_target/layout.py; its pipeline from codegen/torch_target/pipeline.py) and hands
both to the ranks as JSON; one set of `world` spawned processes runs every case in turn (Python,
torch and transformers start once). Each rank trains 3 steps with torch.optim.SGD (momentum) in a
hand-written loop around the schedule's step, the gradient clipped, and saves its losses, gradient
norms and its stages' parameters (whole, under the model's names). The mesh is the plan's
(pipeline, data), data fastest: with pipeline 2 x data 2, ranks 0 and 2 are the pipeline of data
rank 0. Data rank k trains on samples [k * B/d, (k+1) * B/d) of the global batch B; the reference
trains the whole batch in one process.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

STEPS = 3
BATCH = 8          # global batch; micro-batch 2
SGD = {"lr": 0.05, "momentum": 0.9}
CLIP = 0.5         # gradient-norm clipping (the tiny models' norms are above it: every step clips)
# tiny models: the test runs each in several processes on a 2-core machine
MODELS = {
    "gpt": ("examples/models/gpt.py:build", {}),
    "llama": ("examples/models/hf.py:build", {"arch": "llama"}),
    "bert": ("examples/models/hf.py:build", {"arch": "bert"}),
}


@dataclass(frozen=True)
class Case:
    """A model (a key of MODELS) and ParallelConfig fields as (name, value) pairs. parallelize: the
    ranks apply the plan with planner.parallelize (capturing the model themselves) and save a
    Distributed Checkpoint after training, else they build the stages from the TorchLayout with
    codegen.torch_target.pipeline.rank_pipeline. load_from: the case loads that case's checkpoint
    into its own plan instead of training (its parameters then equal that case's reference)."""

    name: str
    model: str
    config: tuple
    parallelize: bool = False
    load_from: str = ""        # a case whose checkpoint this one loads instead of training (parallelize)

    @property
    def data(self) -> int:
        return dict(self.config).get("data", 1)


def _ref(case: Case) -> tuple[str, dict]:
    return MODELS[case.model]


def build_model(case: Case) -> torch.nn.Module:
    from runtime.refs import load_callable

    ref, kwargs = _ref(case)
    torch.manual_seed(0)
    return load_callable(ref, None, "model factory")(**kwargs)


def batch(case: Case, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The global batch of `step` as the model's keyword inputs, and its targets."""
    from runtime.refs import load_callable

    ref, kwargs = _ref(case)
    make = load_callable(ref.rsplit(":", 1)[0] + ":example_batch", None, "batch factory")
    inputs, targets = make(BATCH, 100 + step, **kwargs)
    if isinstance(inputs, tuple):      # the example GPT takes its one input positionally: forward(idx)
        inputs = {"idx": inputs[0]}
    return inputs, targets


def plan_and_layout(case: Case) -> str:
    """The case's plan and its TorchLayout (JSON: {"plan": ..., "layout": ...})."""
    import planner
    from codegen.torch_target.layout import torch_layout
    from planner.app.commands import make_fixed_plan
    from tests.real_models import graph_of

    ref, kwargs = _ref(case)
    graph = graph_of(ref, tuple(sorted(kwargs.items())))
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **dict(case.config))
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=config.num_devices), config, BATCH)
    return json.dumps({"plan": plan.to_dict(), "layout": torch_layout(plan, graph).to_dict()})


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    from runtime.losses import compute_loss

    return compute_loss("cross_entropy", output, target)


def reference(case: Case) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single process, whole batch: (losses, gradient norms, parameters after the steps, parameters
    before), by model name."""
    model = build_model(case)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = batch(case, step)
        opt.zero_grad()
        loss = loss_fn(model(**inputs), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, start


def _parallelized(case: Case, made: dict, model: torch.nn.Module):
    """planner.parallelize of `case`'s plan over `model`, the ranks capturing the model themselves."""
    import planner
    from planner.plan import Plan
    from runtime.refs import load_callable

    ref, kwargs = _ref(case)
    example = load_callable(ref.rsplit(":", 1)[0] + ":example_inputs", None, "example inputs")(2, **kwargs)
    return planner.parallelize(model, Plan.from_dict(made["plan"]), example_inputs=example, loss_fn=loss_fn)


def _pipeline(case: Case, made: dict, model: torch.nn.Module):
    """(this rank's PipelineRun, its data rank, the data degree, the ParallelModel or None) for
    `case`'s plan over `model`."""
    if case.parallelize:
        pm = _parallelized(case, made, model)
        return pm.pipeline, pm.data_rank, pm.num_data, pm

    from codegen.torch_target.layout import TorchLayout
    from codegen.torch_target.pipeline import rank_pipeline
    from runtime.torch_stack.data import apply_data
    from runtime.torch_stack.mesh import build_mesh

    layout = made["layout"]
    mesh = build_mesh(layout, "cpu")
    data_mesh = mesh["data"] if case.data > 1 else None
    # data parallelism on each stage module, as the layout says (replicate or fully_shard over data)
    run = rank_pipeline(TorchLayout.from_dict(layout).pipeline, model, mesh, loss_fn,
                        wrap=lambda m: apply_data(m, layout, data_mesh))
    return run, data_mesh.get_local_rank() if data_mesh is not None else 0, case.data, None


def _whole(named) -> dict[str, torch.Tensor]:
    """name -> the whole tensor (DTensors gathered), copied."""
    out = {}
    for name, p in named:
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def run_case(case: Case, made: dict, out: Path) -> dict:
    """This rank's part of `case`: {"losses" and "norms" (the gradient's before clipping): per step,
    the global batch's; "params": name -> whole tensor}."""
    import torch.distributed as dist

    model = build_model(case)
    if case.load_from:
        pm = _parallelized(case, made, model)
        pm.load(out / f"{case.load_from}_dcp")
        return {"losses": [], "norms": [], "params": _whole(pm.named_parameters())}
    run, dc, d, pm = _pipeline(case, made, model)
    opt = torch.optim.SGD(run.parameters(), **SGD)
    per = BATCH // d
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = batch(case, step)
        inputs = {k: v[dc * per:(dc + 1) * per] for k, v in inputs.items()}
        targets = targets[dc * per:(dc + 1) * per]
        opt.zero_grad()
        mb_losses: list = []
        run.step(target=targets, losses=mb_losses, **inputs)
        norms.append(float(run.clip_grad_norm_(CLIP)))
        opt.step()
        # the step's loss: the mean over micro-batches on the last stage's ranks, averaged over data
        mine = torch.stack(mb_losses).mean().detach().reshape(1) / d if run.has_last_stage else torch.zeros(1)
        dist.all_reduce(mine)
        losses.append(float(mine))
    if pm is not None:
        pm.save(out / f"{case.name}_dcp", opt)
    return {"losses": losses, "norms": norms, "params": _whole(run.named_parameters())}


def run_rank(rank: int, world: int, port: int, cases: list[Case], made: dict[str, str], out: str) -> None:
    """One rank: every case in turn; writes out/<case>_rank<r>.pt."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in cases:
            result = run_case(case, json.loads(made[case.name]), Path(out))
            torch.save(result, Path(out) / f"{case.name}_rank{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(cases: list[Case], world: int, out: Path, timeout: float) -> dict[str, list[dict]]:
    """Run `cases` on `world` spawned processes, killed when one fails or `timeout` seconds pass;
    per case, every rank's saved result."""
    import torch.multiprocessing as mp

    made = {c.name: plan_and_layout(c) for c in cases}
    ctx = mp.start_processes(run_rank, args=(world, free_port(), cases, made, str(out)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=5):   # raises (and stops the others) when a rank fails
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world} ranks did not finish {[c.name for c in cases]} in {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return {c.name: [torch.load(out / f"{c.name}_rank{r}.pt") for r in range(world)] for c in cases}
