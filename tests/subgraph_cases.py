"""Shared by tests/distributed and tests/mpi: builds of sub-graph parallel plans (tiny models).

`emit_subgraph` splits the Inception-style CNN's branches over B sub-grids; `emit_heads` splits a
small GPT's attention heads. Both write the build with codegen.emit (plan from planner.make_plan).
"""

from __future__ import annotations

import functools

import planner
from codegen.emit import capture_ref, emit
from tests.parallel_cases import MODELS, SGD, graph_of


INCEPTION = ("examples/models/inception.py:build", {"num_modules": 2, "channels": 4, "stem_channels": 8,
                                                   "image_size": 8})


@functools.lru_cache(maxsize=None)
def inception_graph():
    ref, kw = INCEPTION
    return capture_ref(ref, kw, batch_size=2)


def emit_subgraph(root, name: str, *, subgraph: int, data: int = 1, pipeline: int = 1, global_batch: int = 8,
                  dtype: str = "fp32"):
    cfg = planner.ParallelConfig(subgraph=subgraph, data=data, pipeline=pipeline, micro_batch_size=2, dtype=dtype)
    # the plan is priced on a device with bf16 when asked (the run is on this machine either way)
    cluster = planner.Cluster.preset("local" if dtype == "fp32" else "dgx-a100-80gb", devices=cfg.num_devices)
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
