"""Shared by the real-model tests: Hugging Face models built from configs (examples/models/hf.py) and
the ResNet-50-style CNN (examples/models/resnet50.py), written as builds the way `meshplan codegen`
writes them, and run as real processes with --verify.

A case is (model, configuration). The configurations are the issue's: data 2, data 2 with ZeRO-3,
tensor 2, data 2 x pipeline 2 (1F1B), pipeline 2 interleaved, and the plan `planner.optimize` picks
for this machine's `local` cluster with 4 devices.
"""

from __future__ import annotations

import functools
from pathlib import Path

import planner
from planner.app.commands import make_fixed_plan
from planner.graph.model import ModelGraph
from codegen.emit import capture_ref, emit

HF = "examples/models/hf.py:build"
HF_ARCHS = ("gpt2", "llama", "bert", "t5", "vit")

# name -> ParallelConfig fields; micro-batch 2, global batch 8
CONFIGS = {
    "d2": dict(data=2),
    "d2_zero3": dict(data=2, zero=3),
    "t2": dict(tensor=2),
    "p2_interleaved": dict(pipeline=2, schedule="interleaved", virtual_stages=2),
    "d2p2": dict(data=2, pipeline=2, schedule="1f1b"),
}
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


@functools.lru_cache(maxsize=None)
def graph_of(ref: str, kwargs: tuple) -> ModelGraph:
    return capture_ref(ref, dict(kwargs), batch_size=2)


def emit_fixed(root: Path, ref: str, kwargs: dict, name: str, cfg: dict, *, batch: int = 8, micro: int = 2,
               optimizer: dict | None = None, **emit_kw) -> Path:
    """The build of the model under configuration `cfg` (every splittable tensor-parallel region split)."""
    graph = graph_of(ref, tuple(sorted(kwargs.items())))
    config = planner.ParallelConfig(micro_batch_size=micro, dtype="fp32", **cfg)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=config.num_devices), config, batch)
    if cfg.get("tensor", 1) > 1:
        assert plan.shardings, f"{name}: the plan splits nothing over the tensor axis"
    return emit(plan, ref, None, root / name, model_kwargs=kwargs, graph=graph, optimizer=optimizer or SGD,
                bucket_bytes=2**16, **emit_kw).path


def emit_optimized(root: Path, ref: str, kwargs: dict, name: str, *, devices: int = 4, batch: int = 8) -> Path:
    """The build of the plan planner.optimize picks for `local` with `devices` processes."""
    graph = graph_of(ref, tuple(sorted(kwargs.items())))
    plan = planner.optimize(graph, planner.Cluster.preset("local", devices=devices), global_batch_size=batch,
                            progress=False)
    return emit(plan, ref, None, root / name, model_kwargs=kwargs, graph=graph, optimizer=SGD,
                bucket_bytes=2**16).path


def assert_verified(result, label: str) -> None:
    """The run finished and --verify passed, with gradients and parameters compared."""
    assert result.returncode == 0, f"{label}: the run failed\n{result.output[-4000:]}"
    cmp = result.comparison
    assert cmp is not None and cmp.ok, f"{label}: {cmp.summary() if cmp else 'not compared'}"
    assert cmp.grads_compared > 0 and cmp.params_compared > 0, f"{label}: {cmp.summary()}"
