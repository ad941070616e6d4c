"""Plans made from Hugging Face models built on the CPU run and verify (the subset of
tests/unit/test_plan_binding.py's six architectures that CI runs: a causal LM with rotary positions
and grouped-query attention under pipeline 2, and ViT, whose inputs are images, under data 2). Both
builds share one launch of two worker processes (gloo)."""

from __future__ import annotations

import planner
from codegen.emit import emit
from runtime.launch.launcher import run_many
from tests.real_models import HF, SGD, assert_verified
from tests.unit.test_plan_binding import cpu_plan

CASES = {"llama": dict(pipeline=2), "vit": dict(data=2)}


def test_cpu_planned_hugging_face_models_train_like_one_process(tmp_path):
    builds = []
    for arch, cfg in CASES.items():
        plan = cpu_plan(arch, planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg))
        builds.append(emit(plan, HF, None, tmp_path / arch, model_kwargs={"arch": arch}, optimizer=SGD).path)
    for arch, result in zip(CASES, run_many(builds, steps=2, timeout=60, verify=True)):
        assert_verified(result, arch)
