"""Both targets train on CUDA over NCCL at world size 1 and equal the single-process CPU run.

For the example GPT (preset tiny) and a Hugging Face Llama built from its config (preset tiny;
rotary tables and position ids: buffers and tensors made in forward, all of which must be on the
rank's device), codegen writes a meshplan build and a torch-target build (`codegen --target torch`)
of the same world-size-1 plan; one launch (`meshplan run`'s launcher, --backend nccl) runs both
on cuda:0 for STEPS steps with --verify. Each run must:

- finish (the torch target once stopped at its first step: "index is on cpu, different from other
  tensors on cuda:0 (index_select)"),
- give every step's loss within LOSS_RTOL of the single-process fp32 run of the same model, data and
  seed on the CPU (runtime.reference.reference_run), and
- pass --verify (runtime/verify/__init__.py: every step's loss and gradients from the run's own parameters
  against float64, and the trajectory against rounding-level twins).

And a model built on cuda:0 captures to the graph codegen captures on meta (a plan made from
either binds to the factory).

LOSS_RTOL = 1e-4 (relative). Both runs are fp32 with TF32 off (PyTorch's default for matmuls; these
models have no convolution), so they differ only in summation order: cuBLAS and the CPU's kernels
round dot products of at most a few hundred terms differently, about 1e-6 of the loss after STEPS
SGD steps on models this small. 1e-4 leaves a 100x margin for that while a real error (a tensor on
the wrong device silently copied back, a step's gradient lost or doubled) moves the losses of the
second and third steps by 1e-2 or more. Each test takes a few seconds on a GPU plus the launch (the
fixture's, about 10-20 s, is counted in the first test of each model).
"""

from __future__ import annotations

import json

import pytest
import torch

import planner
from codegen.emit import emit
from codegen.torch_target.script import emit_torch
from planner.graph.capture import capture_ref
from runtime.launch.launcher import run_many
from runtime.reference import reference_run
from runtime.refs import load_module
from runtime.spec import TrainSpec

STEPS = 3
LOSS_RTOL = 1e-4
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
MODELS = {
    "gpt": ("examples/models/gpt.py:build", {"preset": "tiny"}),
    "hf_llama": ("examples/models/hf.py:build", {"arch": "llama", "preset": "tiny"}),
}
TARGETS = ("meshplan", "torch")


def _builds(root, ref: str, kwargs: dict) -> dict:
    """target -> build directory of the world-size-1 plan (micro-batch 2, global batch 4: two micro-batches)."""
    graph = capture_ref(ref, kwargs, batch_size=2)
    cluster = planner.Cluster.preset("dgx-h100", devices=1)    # a fixed preset: nothing measured
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="fp32")
    out = {}
    for target in TARGETS:
        plan = planner.make_plan(graph, cluster, cfg, global_batch_size=4, target=target)
        write = emit_torch if target == "torch" else emit
        out[target] = write(plan, ref, None, root / target, graph=graph, model_kwargs=kwargs, optimizer=SGD).path
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def runs(request, tmp_path_factory):
    """(model name, target -> RunResult, the CPU reference's losses)."""
    name = request.param
    builds = _builds(tmp_path_factory.mktemp(f"gpu_{name}"), *MODELS[name])
    results = run_many([builds[t] for t in TARGETS], steps=STEPS, backend="nccl", timeout=120, verify=True)
    spec = TrainSpec.from_dict(json.loads((builds["meshplan"] / "build.json").read_text())["train"])
    reference = reference_run(spec, STEPS).losses
    return name, dict(zip(TARGETS, results)), reference


@pytest.mark.parametrize("target", TARGETS)
def test_runs_on_cuda_over_nccl_and_equals_the_cpu_reference(runs, target):
    assert torch.cuda.is_available()
    name, results, reference = runs
    res = results[target]
    assert res.returncode == 0, f"{name} ({target}) failed on CUDA:\n{res.output[-4000:]}"
    losses = res.losses[0]
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference, rel=LOSS_RTOL), \
        f"{name} ({target}) on CUDA: losses {losses}, the CPU reference's {reference}"
    cmp = res.comparison
    assert cmp is not None and cmp.ok, f"{name} ({target}): {cmp.summary() if cmp else 'not compared'}"
    assert cmp.grads_compared > 0 and cmp.params_compared > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_on_the_gpu_captures_as_on_meta(name):
    """A plan made from the model on cuda:0 binds to the factory codegen captures on meta (tests/unit/
    test_plan_binding.py does the CPU's side): the same graph fingerprint."""
    ref, kwargs = MODELS[name]
    module = load_module(ref.rsplit(":", 1)[0])
    torch.manual_seed(0)
    model = module.build(**kwargs).to("cuda")
    on_gpu = planner.capture(model, module.example_inputs(2, "cuda", **kwargs))
    assert on_gpu.fingerprint == capture_ref(ref, kwargs, batch_size=2).fingerprint
