"""Shared by tests/distributed and tests/mpi: tiny models, configurations, and builds.

A case is (model, configuration); `emit_case` captures the model, makes the
plan for the configuration (every tensor-parallel region split), and writes
the build with codegen.emit. The tests then run the generated rank scripts
in real processes and compare with the single-process reference.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

import planner
from planner.app.commands import make_fixed_plan
from codegen.emit import capture_ref, emit

MODELS = {
    "mlp": ("examples/models/mlp.py:build", {}),
    "gpt": ("examples/models/gpt.py:build", {"preset": "tiny"}),
    "resnet": ("examples/models/resnet.py:build", {"depth": 8, "width": 4, "image_size": 8}),
}

# name -> ParallelConfig fields (micro-batch 2, global batch 8 unless a case says otherwise)
CONFIGS = {
    "d2": dict(data=2),
    "t2": dict(tensor=2),
    "p2_gpipe": dict(pipeline=2, schedule="gpipe"),
    "p2_1f1b": dict(pipeline=2, schedule="1f1b"),
    "p2_interleaved": dict(pipeline=2, schedule="interleaved", virtual_stages=2),
    "d2t2p2": dict(data=2, tensor=2, pipeline=2),
    "d2p2": dict(data=2, pipeline=2),
}

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


@functools.lru_cache(maxsize=None)
def graph_of(model: str):
    ref, kw = MODELS[model]
    return capture_ref(ref, kw, batch_size=2)


def plan_for(model: str, global_batch: int = 8, micro_batch: int = 2, **cfg):
    config = planner.ParallelConfig(micro_batch_size=micro_batch, dtype="fp32", **cfg)
    cluster = planner.Cluster.preset("local", devices=config.num_devices)
    return make_fixed_plan(graph_of(model), cluster, config, global_batch)


def emit_case(root: Path, model: str, name: str, cfg: dict, *, global_batch: int = 8, micro_batch: int = 2,
              optimizer: dict | None = None, bucket_bytes: int = 2048, **emit_kw) -> Path:
    """Write the build of `model` under configuration `cfg` to root/<model>_<name>."""
    ref, kw = MODELS[model]
    plan = plan_for(model, global_batch, micro_batch, **cfg)
    if cfg.get("tensor", 1) > 1:
        assert plan.shardings, f"the plan for {model} {name} splits nothing over the tensor axis"
    build = emit(plan, ref, None, root / f"{model}_{name}", model_kwargs=kw, graph=graph_of(model),
                 optimizer=optimizer or SGD, bucket_bytes=bucket_bytes, **emit_kw)
    return build.path


def assert_exact(result, label: str) -> None:
    """Every rank finished, reported the same losses as the reference, and holds the reference's
    parameters (rtol 1e-4, atol 1e-6)."""
    assert result.returncode == 0, f"{label}: the run failed\n{result.output[-4000:]}"
    assert len(result.losses) == result.world_size, f"{label}: missing rank results"
    cmp = result.comparison
    assert cmp is not None and cmp.ok, f"{label}: {cmp.summary() if cmp else 'not compared'}"
    assert cmp.params_compared > 0


def saved_params(build: Path) -> dict[int, dict[str, torch.Tensor]]:
    """rank -> {parameter name: tensor} from the run's --save-params files."""
    out = {}
    for f in sorted((build / "run").glob("params_rank_*.pt")):
        stages = torch.load(f, weights_only=True)
        out[int(f.stem.rsplit("_", 1)[1])] = {k: v for s in stages.values() for k, v in s.items()}
    return out
