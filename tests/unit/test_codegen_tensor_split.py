"""codegen.strategies.tensor.split: the split dimension followed through real graphs, shape constants rewritten,
and the rewritten graph on 2 thread ranks (real gloo) equal to the full model, forward and backward."""

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import planner
from codegen.strategies.tensor.split import TensorSplitError, split_graph
from planner.strategies.tensor.sharding import find_sharding
from runtime.losses import compute_loss
from runtime.reference import local_slice
from runtime.parallel.tensor.layers import FeatureSplit, shard_dim, shard_module
from tests.tp_threads import run_ranks


class NanoAttention(nn.Module):
    """nanoGPT's attention: fused projection split into q, k, v, heads by view, merge by view."""

    def __init__(self, c=16, heads=4):
        super().__init__()
        self.n_head, self.n_embd = heads, c
        self.ln = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.head = nn.Linear(c, 8)

    def forward(self, x):
        h = self.ln(x)
        B, T, C = h.size()
        q, k, v = self.c_attn(h).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.head(x + self.c_proj(y))


class LlamaBlock(nn.Module):
    """Separate q/k/v projections, reshape to heads, SwiGLU MLP."""

    def __init__(self, c=16, heads=4):
        super().__init__()
        self.h, self.d = heads, c // heads
        self.q, self.k, self.v, self.o = (nn.Linear(c, c, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(c, 32, bias=False), nn.Linear(c, 32, bias=False)
        self.down = nn.Linear(32, c, bias=False)
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.out = nn.Linear(c, 8)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).reshape(B, T, self.h, self.d).transpose(1, 2)
        k = self.k(h).reshape(B, T, self.h, self.d).transpose(1, 2)
        v = self.v(h).reshape(B, T, self.h, self.d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o(a)
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.out(x)


class SoftmaxOverFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), dim=-1))


def _case(model_fn, x, target):
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = model_fn()
    graph = planner.capture(meta, (x.to("meta"),))
    roles = {n: r.role for n, r in find_sharding(graph).roles.items() if r.sharded}
    ph = next(n.name for n in graph.nodes if n.op == "placeholder")
    res = split_graph(graph.module, roles, 2, {ph: x.to("meta")})
    torch.manual_seed(0)
    full = model_fn()
    init = copy.deepcopy(full)
    loss = compute_loss("cross_entropy", full(x), target)
    loss.backward()
    return graph, res, init, full, loss


def _run_tp(res, init, x, target):
    def rank(r, group):
        local = copy.deepcopy(init)
        for path, sh in res.shards.items():
            parent, _, leaf = path.rpartition(".")
            owner = local.get_submodule(parent) if parent else local
            setattr(owner, leaf, shard_module(local.get_submodule(path), sh, r, 2, group))
        gm = fx.GraphModule(local, res.graph)
        split = (res.output_split.contiguous_start(r, 2), group, len(res.output_split.indices(r, 2))) \
            if res.output_split else None
        loss = compute_loss("cross_entropy", gm(x), target, class_split=split)
        loss.backward()
        return float(loss.detach()), {k: p.grad.clone() for k, p in gm.named_parameters()}
    return run_ranks(2, rank)


def _check(res, full, loss, outs):
    for r, (lo, grads) in enumerate(outs):
        assert lo == pytest.approx(float(loss.detach()), rel=1e-5)
        for name, g in grads.items():
            path, _, leaf = name.rpartition(".")
            sh = res.shards.get(path)
            dim = shard_dim(sh.role, leaf, g.dim()) if sh is not None else None
            want = local_slice(dict(full.named_parameters())[name].grad, None if dim is None else (dim, sh.split),
                               r, 2)
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} on rank {r}: {m}")


def test_gpt_fused_qkv_is_split_per_part_and_head_count_inferred():
    from examples.models import gpt

    x, target = gpt.example_batch(3, 0)
    graph, res, init, full, loss = _case(gpt.build, x[0], target)
    assert res.shards["blocks.0.attn.qkv"].split == FeatureSplit((3, 4, 8), 1)
    assert res.shards["blocks.1.attn.proj"].split == FeatureSplit((4, 8), 0)
    assert res.shards["wte"].role == "vocab" and res.shards["lm_head"].role == "column_out"
    assert res.output_split == FeatureSplit((128,), 0)
    # the example GPT writes its head count as -1 (inferred from the local features), so no constant
    # needs rewriting and the same line runs on 2 of the 4 heads
    assert "unflatten(-1, (3, -1, 8))" in res.graph.python_code("self").src
    _check(res, full, loss, _run_tp(res, init, x[0], target))


def test_nanogpt_split_and_view_constants_follow_the_local_size():
    x = torch.randn(2, 5, 16)
    target = torch.randint(0, 8, (2, 5))
    graph, res, init, full, loss = _case(NanoAttention, x, target)
    assert res.shards["c_attn"].split == FeatureSplit((3, 16), 1)       # q, k, v halves on each rank
    src = res.graph.python_code("self").src
    assert "split(8, dim = 2)" in src and "view(getitem, getitem_1, 2," in src and "// 2" in src
    _check(res, full, loss, _run_tp(res, init, x, target))


def test_separate_projections_and_swiglu():
    x = torch.randn(2, 6, 16)
    target = torch.randint(0, 8, (2, 6))
    graph, res, init, full, loss = _case(LlamaBlock, x, target)
    assert {res.shards[p].role for p in ("q", "k", "v", "gate", "up")} == {"column"}
    assert res.shards["o"].role == "row" and res.shards["down"].role == "row"
    _check(res, full, loss, _run_tp(res, init, x, target))


def test_resnet_channels_through_batchnorm():
    from examples.models import resnet

    kw = dict(depth=8, width=4, image_size=8)
    (x,), target = resnet.example_batch(4, 0, **kw)
    graph, res, init, full, loss = _case(lambda: resnet.build(**kw), x, target)
    assert res.shards["stages.1.0.bn2"].role == "channels"
    _check(res, full, loss, _run_tp(res, init, x, target))


def test_softmax_across_the_split_dimension_is_refused_naming_the_node():
    x = torch.randn(2, 8)
    with torch.device("meta"):
        meta = SoftmaxOverFeatures()
    graph = planner.capture(meta, (x.to("meta"),))
    roles = {n: r.role for n, r in find_sharding(graph).roles.items() if r.sharded}
    assert roles.get("softmax") == "inner"          # the planner thinks it can split it
    with pytest.raises(TensorSplitError, match="softmax.*over the tensor-parallel dimension"):
        split_graph(graph.module, roles, 2, {"x": x.to("meta")})


@pytest.mark.parametrize("model,cfg", [("gpt", dict(tensor=2)), ("gpt", dict(tensor=4, sequence_parallel=True)),
                                       ("mlp", dict(tensor=2)), ("resnet", dict(tensor=2))])
def test_local_parameter_shapes_from_the_split_description_match_the_sharded_modules(model, cfg):
    """Codegen reads a split module's local parameters from its ModuleShard; the runtime builds them with
    shard_module. Both must give the same names, shapes, dtypes and trainable flags, in the same order."""
    from codegen.partition import example_inputs
    from codegen.strategies.tensor.plan_split import head_splits as _head_splits, plan_splits as _plan_splits
    from codegen.strategies.tensor.split import apply_splits
    from tests.parallel_cases import graph_of, plan_for

    plan, graph = plan_for(model, global_batch=8, **cfg), graph_of(model)
    gm, t = graph.module, plan.config.tensor
    res = apply_splits(gm, _head_splits(plan, gm, None, _plan_splits(plan, graph)),
                       example_inputs(graph, plan.config.micro_batch_size))
    roles = set()
    for path, shard in res.shards.items():
        module = gm.get_submodule(path)
        built = [(name, tuple(p.shape), p.dtype, p.requires_grad)
                 for name, p in shard_module(module, shard, 0, t, None).named_parameters()]
        assert shard.local_parameters(module, t) == built, path
        roles.add(shard.role)
    assert len(roles) >= 3, roles


_LOCAL_CASES = [  # (module, role, split factors, sequence dim, input shape); t = 2 (or 3 where it pads)
    (lambda: nn.Linear(8, 12), "column", (12,), None, (2, 6, 8)),
    (lambda: nn.Linear(8, 12, bias=False), "column_out", (3, 4), None, (2, 6, 8)),
    (lambda: nn.Linear(8, 12), "column", (12,), 1, (2, 3, 8)),
    (lambda: nn.Linear(12, 8), "row", (12,), None, (2, 6, 6)),
    (lambda: nn.Linear(12, 8), "row", (12,), 1, (2, 6, 6)),
    (lambda: nn.Linear(10, 8), "row", (10,), None, (2, 6, 4)),    # t = 3 pads 10 to 3 x 4
    (lambda: nn.Embedding(10, 8), "vocab", (10,), None, (2, 6)),
    (lambda: nn.Embedding(10, 8), "vocab", (10,), 1, (2, 6)),
    (lambda: nn.Conv2d(4, 6, 3, padding=1), "column", (6,), None, (2, 4, 5, 5)),
    (lambda: nn.Conv2d(6, 4, 3, stride=2), "row", (6,), None, (2, 3, 7, 7)),
    (lambda: nn.BatchNorm2d(6), "channels", (6,), None, (2, 3, 5, 5)),
    (lambda: nn.LayerNorm(8), "sequence", (8,), None, (2, 3, 8)),
]


@pytest.mark.parametrize("make,role,factors,seq,shape", _LOCAL_CASES)
def test_codegen_local_modules_give_the_runtime_layers_shapes(make, role, factors, seq, shape):
    """Codegen's shape-only stand-ins (made from the split description alone) give the output shape, and the
    parameters, of the runtime's split layer for rank 0 (shard_module with a shape-only group), on meta."""
    from codegen.strategies.tensor.local_modules import local_module
    from runtime.parallel.tensor.layers import ModuleShard, ShapeGroup

    t = 3 if factors == (10,) and role == "row" else 2
    module = make().to("meta")
    shard = ModuleShard("m", role, FeatureSplit(factors, len(factors) - 1), seq)
    x = torch.randint(0, 10, shape, device="meta") if isinstance(module, nn.Embedding) else \
        torch.empty(shape, device="meta")
    ours, theirs = local_module(module, shard, t), shard_module(module, shard, 0, t, ShapeGroup(t))
    assert ours(x).shape == theirs(x).shape
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]


def test_codegen_local_modules_refuse_what_the_runtime_cannot_split():
    from codegen.strategies.tensor.local_modules import local_module
    from runtime.parallel.tensor.layers import ModuleShard

    with pytest.raises(TensorSplitError, match="groups=1"):
        local_module(nn.Conv2d(4, 4, 3, groups=2), ModuleShard("c", "column", FeatureSplit((4,), 0)), 2)
    with pytest.raises(TensorSplitError, match="cannot split a LayerNorm"):
        local_module(nn.LayerNorm(4), ModuleShard("n", "row", FeatureSplit((4,), 0)), 2)
    with pytest.raises(TensorSplitError, match="does not match"):
        local_module(nn.Linear(4, 6), ModuleShard("l", "column", FeatureSplit((4,), 0)), 2)
