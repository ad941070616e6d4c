"""One rank of a planner.parallelize test job (tests/distributed/test_torch_parallelize.py launches
it through tests/torch_cases.launch): runs the cases named on the command line one after another in
one gloo process group, and rank 0 writes each case's losses, gradient norms and whole parameters
to OUT/<case>.pt. The graphs and plans are read from OUT (tests/torch_cases.prepare wrote them).

    python -m tests.torch_ranks OUT CASE...
    CASE: MODEL:CONFIG          train STEPS steps under CONFIG (tests/torch_cases.CONFIGS)
          MODEL:CONFIG:amp      the same under bf16 autocast
          MODEL:CONFIG:capture  the same, the graph captured by parallelize from example inputs
          MODEL:CONFIG:mesh     the same on a DeviceMesh built here and handed to parallelize
          MODEL:dcp:A:B         train the first STEPS - 1 steps under A, save a Distributed Checkpoint
                                (model, optimizer, LR schedule), load it under B into a model whose
                                weights were zeroed, and train the last step
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import planner
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.refs import load_module
from tests import torch_cases as tc


def _parallel(model: str, config: str, root: Path, *, capture: bool = False, own_mesh: bool = False,
              zeroed: bool = False):
    m = tc.build(model)
    if zeroed:   # the checkpoint must bring every weight back
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
    plan = Plan.load(root / f"plan_{model}_{config}.json")
    if capture:
        ref, kwargs = tc.MODELS[model]
        inputs = load_module(ref.rsplit(":", 1)[0]).example_inputs(2, **kwargs)
        pm = planner.parallelize(m, plan, example_inputs=inputs)
    else:
        mesh = None
        if own_mesh:
            dims = [(axis, n) for axis, n in plan.mesh.items() if n > 1]
            mesh = init_device_mesh("cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(a for a, _ in dims))
        pm = planner.parallelize(m, plan, graph=ModelGraph.load(root / f"graph_{model}.json"), mesh=mesh)
    opt, sched = tc.make_optimizer(pm.parameters())
    return pm, opt, sched


def run_case(case: str, out: Path) -> dict:
    model, config, *rest = case.split(":")
    if config == "dcp":
        first, second = rest
        pm, opt, sched = _parallel(model, first, out)
        losses, norms = _train(model, pm, opt, sched, range(tc.STEPS - 1))
        path = out / f"checkpoint_{model}"
        pm.save(path, opt, extra={"scheduler": sched.state_dict()})
        pm, opt, sched = _parallel(model, second, out, zeroed=True)
        extra = pm.load(path, opt, extra={"scheduler": sched.state_dict()})
        sched.load_state_dict(extra["scheduler"])
        more = _train(model, pm, opt, sched, range(tc.STEPS - 1, tc.STEPS))
        losses, norms = losses + more[0], norms + more[1]
    else:
        pm, opt, sched = _parallel(model, config, out, capture=rest == ["capture"], own_mesh=rest == ["mesh"])
        losses, norms = _train(model, pm, opt, sched, range(tc.STEPS), amp=rest == ["amp"])
    return {"losses": losses, "norms": norms, "params": tc.full_params(pm.module),
            "state_keys": sorted(pm.state_dict())}


def _train(model: str, pm, opt, sched, steps: range, amp: bool = False):
    return tc.train(model, pm, pm.clip_grad_norm_, opt, sched, steps, local=pm.local_batch, mean=pm.mean_over_data,
                    amp=amp)


def main(argv: list[str]) -> None:
    out, cases = Path(argv[0]), argv[1:]
    dist.init_process_group("gloo")
    try:
        for case in cases:
            result = run_case(case, out)
            if dist.get_rank() == 0:
                torch.save(result, out / f"{case.replace(':', '_')}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
