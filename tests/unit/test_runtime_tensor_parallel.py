"""runtime.parallel.tensor.layers: feature splits, sharded modules, and their collectives (2 thread ranks, gloo)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.losses import vocab_parallel_cross_entropy
from runtime.parallel.tensor.layers import (FeatureSplit, ModuleShard, ShardError, gather_whole, sequence_grads,
                                     shard_module)
from tests.tp_threads import run_ranks


def test_feature_split_indices():
    assert FeatureSplit((8,), 0).indices(1, 2).tolist() == [4, 5, 6, 7]
    # qkv read as (3 parts, 4 heads, 2 dims): rank 0 holds heads 0-1 of q, of k and of v
    assert FeatureSplit((3, 4, 2), 1).indices(0, 2).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert FeatureSplit((3, 4, 2), 1).contiguous_start(0, 2) is None
    assert FeatureSplit((1, 6), 1).contiguous_start(1, 2) == 3
    with pytest.raises(ShardError, match="divide"):
        FeatureSplit((3, 4), 0).indices(0, 2)
    assert FeatureSplit.from_list(FeatureSplit((3, 4), 1).to_list()) == FeatureSplit((3, 4), 1)


def test_shard_module_shapes_and_errors():
    lin = nn.Linear(6, 8)
    col = shard_module(lin, ModuleShard("fc", "column", FeatureSplit((8,), 0)), 1, 2, None)
    assert col.weight.shape == (4, 6) and torch.equal(col.weight, lin.weight[4:])
    row = shard_module(lin, ModuleShard("fc", "row", FeatureSplit((6,), 0)), 0, 2, None)
    assert row.weight.shape == (8, 3) and torch.equal(row.bias, lin.bias)
    conv = shard_module(nn.Conv2d(4, 6, 3, padding=1, bias=False), ModuleShard("c", "column", FeatureSplit((6,), 0)),
                        0, 2, None)
    assert conv.weight.shape == (3, 4, 3, 3)
    bn = shard_module(nn.BatchNorm2d(6), ModuleShard("bn", "channels", FeatureSplit((6,), 0)), 1, 2, None)
    assert bn.weight.shape == (3,) and bn.running_mean.shape == (3,) and bn.num_features == 3
    emb = shard_module(nn.Embedding(10, 4), ModuleShard("e", "vocab", FeatureSplit((10,), 0)), 1, 2, None)
    assert emb.start == 5 and emb.weight.shape == (5, 4)
    with pytest.raises(ShardError, match="LayerNorm"):
        shard_module(nn.LayerNorm(4), ModuleShard("ln", "column", FeatureSplit((4,), 0)), 0, 2, None)
    with pytest.raises(ShardError, match="groups=1"):
        shard_module(nn.Conv2d(4, 4, 3, groups=2), ModuleShard("c", "row", FeatureSplit((4,), 0)), 0, 2, None)


def test_column_row_vocab_and_loss_match_the_full_layers_forward_and_backward():
    torch.manual_seed(0)
    emb, fc1, fc2, head = nn.Embedding(12, 8), nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 12, bias=False)
    ids = torch.randint(0, 12, (3, 5))
    target = torch.randint(0, 12, (3, 5))

    def full():
        x = emb(ids)
        y = head(fc2(F.gelu(fc1(x))) + x)
        return F.cross_entropy(y.reshape(-1, 12), target.reshape(-1))

    loss = full()
    loss.backward()
    ref = {n: m for n, m in (("emb", emb), ("fc1", fc1), ("fc2", fc2), ("head", head))}

    def rank(r, group):
        e = shard_module(emb, ModuleShard("emb", "vocab", FeatureSplit((12,), 0)), r, 2, group)
        a = shard_module(fc1, ModuleShard("fc1", "column", FeatureSplit((16,), 0)), r, 2, group)
        b = shard_module(fc2, ModuleShard("fc2", "row", FeatureSplit((16,), 0)), r, 2, group)
        h = shard_module(head, ModuleShard("head", "column_out", FeatureSplit((12,), 0)), r, 2, group)
        x = e(ids)
        logits = h(b(F.gelu(a(x))) + x)            # (3, 5, 6): this rank's classes
        lo = vocab_parallel_cross_entropy(logits, target, 6 * r, group).mean()
        lo.backward()
        return float(lo.detach()), {"emb": e.weight.grad, "fc1": a.weight.grad, "fc2": b.weight.grad, "head": h.weight.grad,
                           "fc2.bias": b.bias.grad}

    out = run_ranks(2, rank)
    for r, (lo, grads) in enumerate(out):
        assert lo == pytest.approx(float(loss.detach()), rel=1e-6)
        half = slice(8 * r, 8 * r + 8)
        torch.testing.assert_close(grads["fc1"], ref["fc1"].weight.grad[half])
        torch.testing.assert_close(grads["fc2"], ref["fc2"].weight.grad[:, half])
        torch.testing.assert_close(grads["fc2.bias"], ref["fc2"].bias.grad)
        torch.testing.assert_close(grads["emb"], ref["emb"].weight.grad[6 * r:6 * r + 6])
        torch.testing.assert_close(grads["head"], ref["head"].weight.grad[6 * r:6 * r + 6])


def test_sequence_parallel_layers_match_the_full_layers_forward_and_backward():
    # emb -> LayerNorm -> fc1 (column) -> gelu -> fc2 (row) + residual -> head (column_out), with the
    # stream between fc2 and the next column split along the sequence (6 tokens, 3 per rank); a second
    # head reads the whole sequence (gather_whole) through a replicated linear
    torch.manual_seed(0)
    emb, ln, fc1, fc2 = nn.Embedding(12, 8), nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
    head, side = nn.Linear(8, 12, bias=False), nn.Linear(8, 1)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    ids = torch.randint(0, 12, (3, 6))
    target = torch.randint(0, 12, (3, 6))

    def full():
        x = ln(emb(ids))
        y = fc2(F.gelu(fc1(x))) + x
        return F.cross_entropy(head(y).reshape(-1, 12), target.reshape(-1)) + side(y).pow(2).mean()

    loss = full()
    loss.backward()

    def rank(r, group):
        e = shard_module(emb, ModuleShard("emb", "vocab", FeatureSplit((12,), 0), 1), r, 2, group)
        a = shard_module(fc1, ModuleShard("fc1", "column", FeatureSplit((16,), 0), 1), r, 2, group)
        b = shard_module(fc2, ModuleShard("fc2", "row", FeatureSplit((16,), 0), 1), r, 2, group)
        h = shard_module(head, ModuleShard("head", "column_out", FeatureSplit((12,), 0), 1), r, 2, group)
        n = copy.deepcopy(ln)
        s = copy.deepcopy(side)
        sequence_grads(n, group)
        x = n(e(ids))                                # (3, 3, 8): this rank's 3 tokens
        assert x.shape == (3, 3, 8)
        y = b(F.gelu(a(x))) + x
        logits = h(y)                                # (3, 6, 6): every token, this rank's classes
        lo = vocab_parallel_cross_entropy(logits, target, 6 * r, group).mean()
        lo = lo + s(gather_whole(y, 1, group)).pow(2).mean()
        lo.backward()
        return float(lo.detach()), {"fc1": a.weight.grad, "fc2": b.weight.grad, "fc2.bias": b.bias.grad,
                                    "ln.weight": n.weight.grad, "ln.bias": n.bias.grad, "side": s.weight.grad}

    for r, (lo, grads) in enumerate(run_ranks(2, rank)):
        assert lo == pytest.approx(float(loss.detach()), rel=1e-6)
        half = slice(8 * r, 8 * r + 8)
        torch.testing.assert_close(grads["fc1"], fc1.weight.grad[half])
        torch.testing.assert_close(grads["fc2"], fc2.weight.grad[:, half])
        torch.testing.assert_close(grads["fc2.bias"], fc2.bias.grad)
        torch.testing.assert_close(grads["ln.weight"], ln.weight.grad)
        torch.testing.assert_close(grads["ln.bias"], ln.bias.grad)
        torch.testing.assert_close(grads["side"], side.weight.grad)
