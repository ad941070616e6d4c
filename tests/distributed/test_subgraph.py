"""Sub-graph parallelism (SUPER) on real processes (gloo): the Inception-style CNN's four branches
dealt to B sub-grids, and a small GPT's attention heads split over B = 2 and 4 sub-grids, alone and
with data parallelism, train exactly like the single process (3 steps, fp32, every loss and every
parameter each rank holds, rtol 1e-4)."""

import functools

import pytest

import planner
from codegen.emit import capture_ref, emit
from runtime.launcher import run_many
from tests.parallel_cases import MODELS, SGD, assert_exact, graph_of

INCEPTION = ("examples/models/inception.py:build", {"num_modules": 2, "channels": 4, "stem_channels": 8,
                                                   "image_size": 8})


@functools.lru_cache(maxsize=None)
def inception_graph():
    ref, kw = INCEPTION
    return capture_ref(ref, kw, batch_size=2)


def emit_subgraph(root, name: str, *, subgraph: int, data: int = 1, pipeline: int = 1, global_batch: int = 8):
    cfg = planner.ParallelConfig(subgraph=subgraph, data=data, pipeline=pipeline, micro_batch_size=2, dtype="fp32")
    cluster = planner.Cluster.preset("local", devices=cfg.num_devices)
    plan = planner.make_plan(inception_graph(), cluster, cfg, global_batch_size=global_batch)
    assert plan.subgraph and {o for r in plan.subgraph for o in r.owners} == set(range(subgraph))
    ref, kw = INCEPTION
    return emit(plan, ref, None, root / name, model_kwargs=kw, graph=inception_graph(), optimizer=SGD,
                bucket_bytes=2048).path


def emit_heads(root, name: str, *, subgraph: int, data: int = 1):
    """A small GPT (4 heads) whose attention heads are split over `subgraph` sub-grids."""
    cfg = planner.ParallelConfig(subgraph=subgraph, data=data, micro_batch_size=2, dtype="fp32")
    plan = planner.make_plan(graph_of("gpt"), planner.Cluster.preset("local", devices=cfg.num_devices), cfg,
                             global_batch_size=8)
    assert plan.subgraph and all(r.kind == "heads" for r in plan.subgraph)
    ref, kw = MODELS["gpt"]
    return emit(plan, ref, None, root / name, model_kwargs=kw, graph=graph_of("gpt"), optimizer=SGD,
                bucket_bytes=2048).path


TWO = {"inception_g2": dict(subgraph=2), "gpt_heads_g2": dict(subgraph=2)}
FOUR = {"inception_g4": dict(subgraph=4), "inception_d2g2": dict(subgraph=2, data=2),
        "inception_p2g2": dict(subgraph=2, pipeline=2), "gpt_heads_g4": dict(subgraph=4),
        "gpt_heads_d2g2": dict(subgraph=2, data=2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("subgraph")
    out = {}
    for cases in (TWO, FOUR):
        builds = {name: (emit_heads if name.startswith("gpt") else emit_subgraph)(root, name, **cfg)
                  for name, cfg in cases.items()}
        if cases is FOUR:   # the plan planner.optimize picks when asked for sub-graph parallelism
            plan = planner.optimize(inception_graph(), planner.Cluster.preset("local", devices=4),
                                    global_batch_size=8, progress=False, constraints={"subgraph": 2, "dtype": "fp32"})
            assert plan.config.subgraph == 2 and plan.subgraph
            ref, kw = INCEPTION
            builds["inception_optimized"] = emit(plan, ref, None, root / "inception_optimized", model_kwargs=kw,
                                                 graph=inception_graph(), optimizer=SGD, bucket_bytes=2048).path
        results = run_many(list(builds.values()), steps=3, backend="gloo", timeout=60, verify=True)
        out.update({name: (res, builds[name]) for name, res in zip(builds, results)})
    return out   # name -> (RunResult, build directory)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted({**TWO, **FOUR, "inception_optimized": None}))
def test_subgraph_parallel_run_equals_single_process(runs, name):
    res, _ = runs[name]
    assert_exact(res, name)
    per_rank = list(res.losses.values())
    assert all(x == per_rank[0] for x in per_rank), f"{name}: ranks disagree on the loss {res.losses}"


@pytest.mark.timeout(600)
def test_each_sub_grid_holds_only_its_paths(runs):
    """Rank 0 (sub-grid 0) and rank 1 (sub-grid 1) hold disjoint branch parameters and the same
    replicated ones (stem, classifier); together they hold every parameter of the model."""
    import torch

    from examples.models import inception

    res, build = runs["inception_g2"]
    assert res.returncode == 0
    held = [{k for st in torch.load(build / "run" / f"params_rank_{r:04d}.pt", weights_only=True).values()
             for k in st} for r in (0, 1)]
    branch = [{k for k in h if k.startswith("blocks.")} for h in held]
    assert branch[0] and branch[1] and not branch[0] & branch[1]
    assert held[0] - branch[0] == held[1] - branch[1] == {"stem.conv.weight", "stem.bn.weight", "stem.bn.bias",
                                                         "fc.weight", "fc.bias"}
    assert held[0] | held[1] == {n for n, _ in inception.build(**INCEPTION[1]).named_parameters()}
