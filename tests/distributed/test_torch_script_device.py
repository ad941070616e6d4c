"""The torch target's script hands the model and the loss only tensors on the rank's device.

On a GPU the data factory's CPU tensors must be moved before the model sees them (the bug was
"index is on cpu, different from other tensors on cuda:0 (index_select)" at the first embedding). On
this CPU machine the rank's device is the CPU, where moving is a no-op, so the check is on the path
instead of the device: the generated train_torch.py runs in this process (gloo, world size 1) with
its `batch_to` recording every tensor it returns, and every tensor that reaches the model's forward
(call_model) and the loss (compute_loss) must be one of those. A pipeline script's step functions
see only the batches of that same line (checked on its source). The CUDA run itself is
tests/gpu/test_gpu_targets.py.
"""

from __future__ import annotations

import ast
import importlib.util

import pytest
import torch
import torch.distributed as dist

import planner
from codegen.torch_target.script import SCRIPT, emit_torch
from planner.graph.capture import capture_ref
from runtime.data import batch_to, input_values

GPT = "examples/models/gpt.py:build"
KWARGS = {"preset": "tiny"}


def _build(root, **config):
    graph = capture_ref(GPT, KWARGS, batch_size=2)
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **config)
    plan = planner.make_plan(graph, planner.Cluster.preset("dgx-a100-80gb", devices=cfg.num_devices), cfg,
                             global_batch_size=4, target="torch")
    return emit_torch(plan, GPT, None, root, graph=graph, model_kwargs=KWARGS,
                      optimizer={"name": "sgd", "lr": 0.1})


def _load(path):
    spec = importlib.util.spec_from_file_location(f"h31_train_torch_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_tensor_the_script_feeds_the_model_and_the_loss_went_through_the_ranks_device(tmp_path, monkeypatch):
    build = _build(tmp_path / "build")
    script = _load(build.path / SCRIPT)
    handed: list[torch.Tensor] = []     # every tensor batch_to returned (kept alive: ids stay unique)
    devices: list[torch.device] = []
    seen = {"model": 0, "loss": 0}
    real_batch_to, real_call_model, real_loss = script.batch_to, script.call_model, script.compute_loss

    def batch_to(batch, device):
        devices.append(torch.device(device))
        out = real_batch_to(batch, device)
        handed.extend([*input_values(out[0]), out[1]])
        return out

    def passed(t):
        return any(t is h for h in handed)

    def call_model(model, inputs):
        assert all(passed(t) for t in input_values(inputs)), "the model got an input that did not go through batch_to"
        seen["model"] += 1
        return real_call_model(model, inputs)

    def compute_loss(name, output, targets):
        assert passed(targets), "the loss got targets that did not go through batch_to"
        seen["loss"] += 1
        return real_loss(name, output, targets)

    monkeypatch.setattr(script, "batch_to", batch_to)
    monkeypatch.setattr(script, "call_model", call_model)
    monkeypatch.setattr(script, "compute_loss", compute_loss)
    args = script.script_args(["--steps", "2", "--no-progress", "--out", str(build.path)], str(build.path))
    checkpoints = script.open_checkpoints(args, script.TRAIN.model_ref, script.TRAIN.global_batch_size)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        script.train(args, 0, "gloo", checkpoints)
    finally:
        dist.destroy_process_group()
    # 2 steps x 2 micro-batches of 2 samples (global batch 4, one data rank), each through the model and the loss
    assert seen == {"model": 4, "loss": 4}
    assert devices == [torch.device("cpu")] * 4


@pytest.mark.parametrize("config", [dict(data=2), dict(pipeline=2)])
def test_the_step_functions_read_only_the_batches_moved_to_the_device(tmp_path, config):
    """Data parallel and pipeline scripts: the one read of the data is moved by batch_to(..., device), and
    the step is handed exactly those batches."""
    text = (_build(tmp_path / "build", **config).path / SCRIPT).read_text()
    tree = ast.parse(text)
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "micro_batches"]
    assert len(reads) == 1
    moves = [n for n in ast.walk(tree) if isinstance(n, ast.ListComp) and isinstance(n.elt, ast.Call)
             and getattr(n.elt.func, "id", "") == "batch_to"]
    assert len(moves) == 1 and ast.unparse(moves[0].elt.args[1]) == "device"
    assert any(reads[0] is n for n in ast.walk(moves[0].generators[0].iter))
    steps = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "runner.step"]
    assert [ast.unparse(n.args[0]) for n in steps] == ["batches"]
    assert "batches = [batch_to(" in text


def test_batch_to_moves_inputs_and_targets():
    inputs, targets = {"x": torch.zeros(2, 3)}, torch.ones(2)
    moved = torch.device("meta")    # a device other than the CPU this machine has
    out_inputs, out_targets = batch_to((inputs, targets), moved)
    assert out_inputs["x"].device == moved and out_targets.device == moved
    pos, _ = batch_to(((torch.zeros(1),), torch.zeros(1)), moved)
    assert isinstance(pos, tuple) and pos[0].device == moved
