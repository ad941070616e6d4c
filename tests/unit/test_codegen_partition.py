"""codegen.partition: stage boundaries (side tensors passed along), generated code, and a
single-process chain of the generated stage modules equal to the whole model."""

import pytest
import torch

import planner
from codegen.emit import capture_ref
from codegen.partition import PartitionError, partition, stage_imports
from runtime.losses import compute_loss
from runtime.materialize import build_model, build_stage, load_factory
from runtime.spec import TrainSpec
from tests import sidenet_source
from tests.parallel_cases import graph_of, plan_for


def _classes(parts):
    ns: dict = {}
    exec("\n".join(stage_imports(list(parts.stages))) + "\n\n" + "\n\n".join(p.source for p in parts.stages), ns)
    return {p.spec.index: ns[p.class_name] for p in parts.stages}


def _chain(parts, spec, inputs, targets):
    """Run the stage modules one after another in this process (no communication)."""
    classes = _classes(parts)
    modules = {s: build_stage(classes[s], parts.stages[s].spec, spec) for s in classes}
    carry: dict[str, torch.Tensor] = {}
    for s in sorted(modules):
        sp = parts.stages[s].spec
        args = [inputs[b.data_index] if b.source == "data" else carry[b.name] for b in sp.inputs]
        out = modules[s](*args)
        if sp.is_last:
            loss = compute_loss("cross_entropy", out, targets)
            loss.backward()
            return loss, modules
        carry = {b.name: t for b, t in zip(sp.outputs, out)}


@pytest.fixture
def sidenet(tmp_path):
    ref = sidenet_source.write(tmp_path)
    graph = capture_ref(ref, {}, batch_size=2)
    cfg = planner.ParallelConfig(pipeline=3, micro_batch_size=4, dtype="fp32", stage_boundaries=("inp", "blocks.1"))
    plan = planner.make_plan(graph, planner.Cluster.preset("local", devices=3), cfg, global_batch_size=4)
    spec = TrainSpec(model_ref=ref, data_ref=ref.replace(":build", ":example_batch"), global_batch_size=4)
    return graph, plan, spec


def test_side_tensor_is_passed_along_through_the_middle_stage(sidenet):
    graph, plan, spec = sidenet
    parts = partition(plan, graph)
    s0, s1, s2 = (p.spec for p in parts.stages)
    assert [b.name for b in s0.inputs] == ["x"] and s0.inputs[0].source == "data"
    assert [b.name for b in s0.outputs] == ["x", "sigmoid"]          # x itself crosses the first cut
    assert [b.name for b in s1.inputs] == ["x", "sigmoid"]
    assert [b.name for b in s1.outputs] == ["sigmoid", "add"]        # the gate passes through stage 1
    assert [b.name for b in s2.inputs] == ["sigmoid", "add"] and s2.is_last
    assert [b.requires_grad for b in s1.outputs] == [False, True]
    assert s1.outputs[1].shape == (4, 16)


def test_chained_stage_modules_equal_the_whole_model(sidenet):
    graph, plan, spec = sidenet
    parts = partition(plan, graph)
    (x,), y = load_factory(spec.data_ref, "", "data factory")(4, 0)
    loss, modules = _chain(parts, spec, [x], y)
    full = build_model(spec)
    ref = compute_loss("cross_entropy", full(x), y)
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    ref_grads = {k: p.grad for k, p in full.named_parameters()}
    for m in modules.values():
        for k, p in m.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[k])


def test_generated_code_is_plain_python_importing_only_torch_and_runtime():
    parts = partition(plan_for("gpt", pipeline=2, recompute="full"), graph_of("gpt"))
    lines = stage_imports(list(parts.stages))
    assert lines[0] == "import torch"
    assert all(ln.split()[1].split(".")[0] in ("torch", "math", "runtime") or ln.startswith("NoneType")
               for ln in lines), lines
    src = parts.stages[0].source
    assert "checkpoint(self.layer_blocks_0, drop, use_reentrant=False, context_fn=keep_statistics(self))" in src
    assert "def layer_wte(self, idx):" in src
    compile(src, "stage0", "exec")


def test_plan_for_another_graph_is_refused():
    with pytest.raises(PartitionError, match="another model"):
        partition(plan_for("gpt", pipeline=2), graph_of("mlp"))
