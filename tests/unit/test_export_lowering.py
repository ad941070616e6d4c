"""Graphs captured by torch.export lower to rank programs: batch-independent capture, a flat graph,
tied weights held by every stage that reads them and summed, odd vocabularies padded, and the
planner told which tensor-parallel regions the code generator can split."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from planner.evaluator import Evaluator
from planner.app.commands import make_fixed_plan
from codegen.lower import lower
from codegen.partition import partition
from planner.capabilities import MESHPLAN_RUNTIME
from planner.graph.capture import capture_ref
from planner.strategies.tensor.sharding import find_sharding
from planner.strategies.tensor.split.analysis import unsplittable
from planner.graph.ties import tied_weights
from runtime.losses import compute_loss
from runtime.parallel.tensor.layers import FeatureSplit
from tests.tp_threads import run_ranks

HF = "examples/models/hf.py:build"


@functools.lru_cache(maxsize=None)
def graph(arch: str, batch: int = 2, **kw):
    return capture_ref(HF, {"arch": arch, **kw}, batch_size=batch)


def fixed_plan(g, **cfg):
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
    return make_fixed_plan(g, planner.Cluster.preset("local", devices=config.num_devices), config, 8)


def test_export_capture_does_not_depend_on_the_batch():
    graphs = [graph("gpt2", b) for b in (1, 2, 8)]
    assert all(g.method == "export" for g in graphs)
    assert len({g.fingerprint for g in graphs}) == 1
    assert [n.name for n in graphs[0].nodes] == [n.name for n in graphs[2].nodes]


def test_export_graph_is_flat():
    gm = graph("llama").module
    targets = [str(n.target) for n in gm.graph.nodes]
    assert not any("higher_order" in t or "wrap_with" in t for t in targets)     # no-grad rotary inlined
    assert "_guards_fn" not in targets and not any("_assert" in t for t in targets)


class _NoGradScale(nn.Module):
    """A no-grad region (as transformers' rotary embeddings used to have) between two layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            s = h.abs().amax(dim=-1, keepdim=True) + 1.0
        return self.b(h / s)


def test_no_grad_region_is_inlined_with_detached_outputs():
    from planner.graph.export import export_dynamic_batch
    torch.manual_seed(0)
    model = _NoGradScale()
    x = torch.randn(3, 4)
    gm = export_dynamic_batch(model, (x,), {}, batch_dim=0, batch_size=3)
    targets = [str(n.target) for n in gm.graph.nodes]
    assert not any("wrap_with" in t or "higher_order" in t for t in targets)
    assert sum(n.target == torch.ops.aten.detach.default for n in gm.graph.nodes) == 1


def test_tied_weight_is_held_by_both_stages_and_summed_over_their_positions():
    g = graph("gpt2")
    assert g.shared_params == (("transformer.wte.weight", "lm_head.weight"),)
    assert tied_weights(g)[0].layers == (1, len(g.layers) - 1)
    plan = fixed_plan(g, data=2, pipeline=2)
    parts = partition(plan, g)
    for sp in parts.stages:
        assert "lm_head.weight" in sp.spec.attributes and sp.spec.shared == g.shared_params
        assert "device(type='meta')" not in sp.source and "sym_size" not in sp.source
    assert "run_device" in parts.stages[0].source                  # arange(..., device=run_device)
    programs = lower(plan, g, parts=parts, bucket_bytes=2**16)
    for prog in programs.values():
        (tie,) = prog.ties
        assert tie.axis == "tie:0,1" and tie.name == "transformer.wte.weight"
        ops = [(i.op, i.kind) for i in prog.instrs]
        tied = ops.index(("ALLREDUCE", "tied"))
        assert tied > max(k for k, (op, kind) in enumerate(ops) if kind == "grads") and ops.index(("STEP", "")) > tied
        alone = [b for b in prog.buckets if "lm_head.weight" in b.params]
        assert alone and alone[0].params == ("lm_head.weight",)


def test_an_odd_vocabulary_is_padded_under_tensor_parallelism():
    g = graph("gpt2")
    parts = partition(fixed_plan(g, tensor=2), g)
    first, last = parts.stages[0].spec, parts.stages[-1].spec
    (ps,) = [p for p in first.param_shards if p.name == "lm_head.weight"]
    assert ps.dim == 0 and ps.split == FeatureSplit((1001,), 0) and ps.split.local_size(2) == 501
    assert last.output_split == FeatureSplit((1001,), 0)
    assert "vocab_parallel_embedding" in parts.stages[0].source and "copy_to_group" in parts.stages[0].source


def test_padded_split_slices_round_trip():
    fs = FeatureSplit((5,), 0)
    full = torch.arange(10.0).view(5, 2)
    pieces = [fs.take(full, 0, r, 3) for r in range(3)]
    assert [len(fs.indices(r, 3)) for r in range(3)] == [2, 2, 1]
    assert all(p.shape == (2, 2) for p in pieces) and torch.equal(pieces[2][1], torch.zeros(2))
    back = torch.zeros(5, 2)
    for r, p in enumerate(pieces):
        fs.put(back, 0, r, 3, p)
    assert torch.equal(back, full)
    with pytest.raises(ValueError, match="divide"):
        FeatureSplit((3, 4), 0).check(2)      # a factor among several is not padded


def test_vocabulary_parallel_loss_over_padded_classes_equals_the_whole_loss():
    torch.manual_seed(0)
    logits = torch.randn(6, 5, requires_grad=True)
    target = torch.tensor([0, 4, 2, 3, 1, 4])
    fs = FeatureSplit((5,), 0)
    whole = F.cross_entropy(logits, target)
    whole.backward()

    def rank(r, group):
        local = fs.take(logits.detach(), 1, r, 2).requires_grad_(True)
        loss = compute_loss("cross_entropy", local, target,
                            class_split=(fs.contiguous_start(r, 2), group, len(fs.indices(r, 2))))
        loss.backward()
        return float(loss.detach()), local.grad
    for r, (loss, grad) in enumerate(run_ranks(2, rank)):
        assert loss == pytest.approx(float(whole.detach()), rel=1e-6)
        torch.testing.assert_close(grad, fs.take(logits.grad, 1, r, 2))


def test_padding_is_allowed_and_priced_heads_are_not_padded():
    sp = find_sharding(graph("gpt2"))
    sp.check(2)                                         # 1001 tokens over 2: padded
    with pytest.raises(ValueError, match="heads"):
        sp.check(3)                                     # 4 heads over 3: refused
    vocab = next(r for r in sp.roles.values() if r.role == "vocab")
    assert vocab.divisor(2) == pytest.approx(1001 / 501)


class SoftmaxOverFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.d(F.relu(self.c(self.b(torch.softmax(self.a(x), dim=-1)))))


def test_the_planner_replicates_regions_the_code_generator_cannot_split():
    with torch.device("meta"):
        g = planner.capture(SoftmaxOverFeatures(), (torch.zeros(2, 8, device="meta"),))
    sp = find_sharding(g)
    roles = {n: r.role for n, r in sp.roles.items() if r.sharded}
    err = unsplittable(g, roles, 2)
    assert err is not None and err.node == "softmax" and "at the top level" in str(err)
    kept = MESHPLAN_RUNTIME.splittable(g, sp, [2])
    assert kept.roles["a"].role == "replicate" and kept.roles["softmax"].role == "replicate"
    assert kept.roles["c"].role == "column" and kept.roles["d"].role == "row"   # the other region stays split
    assert unsplittable(g, {n: r.role for n, r in kept.roles.items() if r.sharded}, 2) is None


def test_tied_copies_are_priced():
    g = graph("gpt2")
    ev = Evaluator(g, planner.Cluster.preset("local", devices=2))
    cfg = planner.ParallelConfig(pipeline=2, micro_batch_size=2, dtype="fp32")
    costs = [ev.layer_cost(layer, cfg) for layer in g.layers]
    extra, seconds = ev.tie_costs(cfg, ev.stage_bounds(cfg, costs, 8))
    assert extra == {1: 1001 * 64} and seconds > 0
    one = planner.ParallelConfig(data=2, micro_batch_size=2, dtype="fp32")
    assert ev.tie_costs(one, ev.stage_bounds(one, costs, 8)) == ({}, 0.0)


def test_random_ops_are_named_for_verify():
    from runtime.verify import random_ops_problem

    ops = graph("gpt2", resid_pdrop=0.1).random_ops
    assert ops and all("dropout p=0.1" in o for o in ops)
    assert "set dropout to 0" in random_ops_problem({"random_ops": list(ops)})
    assert graph("gpt2").random_ops == ()
