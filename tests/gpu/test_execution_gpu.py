"""Execution options on one GPU (NCCL, world size 1): compiled stages (inductor, Triton kernels), the fused
chunked loss in bf16 and the padded vocabulary, with batches prefetched into pinned memory and copied on a
side stream, train like the single-process run (--verify at bf16's tolerances); so does the stage compiled
whole with the compiled loss (its forward and loss one graph); nothing recompiles."""

from __future__ import annotations

import json

import pytest

import planner
from codegen.emit import emit
from planner.app.commands import make_fixed_plan
from runtime.execution import Execution
from runtime.launch.launcher import run_local
from tests.parallel_cases import MODELS, graph_of


@pytest.mark.parametrize("execution", [
    Execution(compile=True, loss="chunked", vocab_multiple=48),
    Execution(compile=True, compile_scope="stage", loss="compiled", vocab_multiple=48),
], ids=["blocks_chunked", "stage_compiled_loss"])
def test_every_option_on_one_gpu_equals_the_single_process_run(tmp_path, execution):
    ref, kw = MODELS["gpt"]
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="bf16")
    plan = make_fixed_plan(graph_of("gpt"), planner.Cluster.preset("local", devices=1), cfg, 8)   # 4 micro-batches
    build = emit(plan, ref, None, tmp_path / "b", model_kwargs=kw, graph=graph_of("gpt"),
                 optimizer={"name": "adamw", "lr": 0.01, "impl": "fused"},
                 execution=execution).path
    res = run_local(build, steps=3, backend="nccl", timeout=600, verify=True)
    assert res.returncode == 0, res.output[-4000:]
    assert res.comparison is not None and res.comparison.ok, res.comparison.summary()
    graphs = json.loads((build / "run" / "rank_0000.json").read_text())["compiled_graphs"]
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3, graphs
