"""Context parallelism lowered: the stage code calls the rank's context by name, the Programs reduce
over data x context, and what cannot be split (a sequence not divisible by 2c, a mask tensor) is refused
with a sentence naming it. Hand-computed chunk orders: T = 8 tokens over c = 2 ranks are 4 chunks of
2; rank 0 holds chunks 0 and 3 (tokens 0 1 6 7), rank 1 chunks 1 and 2 (tokens 2 3 4 5)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from codegen.strategies.context.stage_code import context_spec
from codegen.lower import lower_plan
from codegen.strategies.base import LoweringError
from planner.app.commands import make_fixed_plan
from runtime.comm import SoloGroup
from runtime.parallel.context.layout import chunk_layout
from runtime.program.instr_set import ProgramError
from runtime.parallel.context.strategy import ContextBatches, ContextRank
from runtime.parallel.context.part import ContextShard
from runtime.program import Program
from tests.parallel_cases import graph_of, plan_for


@pytest.fixture(scope="module")
def d2c2():
    return lower_plan(plan_for("gpt", data=2, context=2), graph_of("gpt"))


def test_stage_code_takes_tokens_positions_and_attention_from_the_context(d2c2):
    parts, _ = d2c2
    src = parts.stages[0].source
    assert "take = context.take(idx, 1)" in src
    assert "arange = context.positions(0, device = getattr_1)" in src
    assert ("scaled_dot_product_attention = context.attention(getitem, getitem_1, getitem_2, causal = True, "
            "mode = 'ring')") in src
    assert "torch.arange" not in src and "torch._C._nn.scaled_dot_product_attention" not in src


def test_selective_recompute_recomputes_the_context_attention():
    parts, _ = lower_plan(plan_for("gpt", context=2, recompute="selective"), graph_of("gpt"))
    src = parts.stages[0].source
    assert "self.recompute_scaled_dot_product_attention = Recompute(method='attention')" in src
    assert ("scaled_dot_product_attention = self.recompute_scaled_dot_product_attention(context, getitem, getitem_1, "
            "getitem_2, causal = True, mode = 'ring')") in src


def test_stage_boundaries_hold_this_ranks_tokens():
    parts, _ = lower_plan(plan_for("gpt", pipeline=2, context=2, schedule="1f1b"), graph_of("gpt"))
    first, last = parts.stages
    assert [b.shape for b in first.spec.inputs] == [(2, 16)]          # idx whole: the code takes its tokens
    assert [b.shape for b in first.spec.outputs] == [(2, 8, 32)]      # (B, T / c, C)
    assert [b.shape for b in last.spec.inputs] == [(2, 8, 32)]


def test_gradients_and_zero_reduce_over_data_x_context(d2c2):
    _, programs = d2c2
    assert programs[0].mesh == (("pipeline", 1), ("data", 4), ("tensor", 1))
    assert {i.axis for i in programs[0].instrs if i.kind in ("grads", "loss")} == {"data"}
    assert programs[0].group("data") == (0, 1, 2, 3)
    assert [programs[r].part("context").ranks for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [programs[r].data_shard() for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert programs[0].num_micro_batches == 2   # 8 samples / (2 data shards x micro-batch 2)


def test_program_context_round_trips_and_is_checked(d2c2):
    _, programs = d2c2
    p = programs[3]
    assert Program.from_json(p.to_json()) == p
    bad = p.to_dict()
    bad["context"] = {**bad["context"], "ranks": [0, 1]}
    with pytest.raises(ProgramError, match=r"context.ranks.*does not hold this rank 3"):
        Program.from_dict(bad)
    with pytest.raises(ProgramError, match="does not cut into 2 x 2 chunks"):
        ContextShard(2, 18, 1, (0, 1))


def test_a_sequence_not_divisible_by_2c_is_refused_naming_both_numbers():
    graph = graph_of("gpt")   # seq_len 16
    assert context_spec(graph, 4, "ring").seq_len == 16
    with pytest.raises(LoweringError, match=r"2 x 3 = 6 chunks .* the sequence has 16 tokens, which 6 does not"):
        context_spec(graph, 3, "ring")


class _Masked(nn.Module):
    """Attention with a (T, T) mask tensor: the shape of what HF models build from the sequence length."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.register_buffer("mask", torch.ones(12, 12).tril().bool())

    def forward(self, x):                                    # (B, T=12, 8)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # each (B, 1, T, 8)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).squeeze(1)


def test_attention_with_a_mask_tensor_is_refused_naming_the_node():
    with torch.device("meta"):
        graph = planner.capture(_Masked(), (torch.zeros(2, 12, 8),))
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", context=2)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=2), config, 4)
    with pytest.raises(LoweringError, match=r"cannot split the attention mask of node 'scaled_dot_product_attention'.*"
                                            r"is_causal=True"):
        lower_plan(plan, graph)


class _SizedMask(nn.Module):
    """A mask built from the sequence length in forward(), as HF models build theirs: the causal
    triangle (tril) or, to be refused, its transpose (triu: each token sees the later ones)."""

    def __init__(self, upper: bool):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.upper = upper

    def forward(self, x):                                    # (B, T=12, 8)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # each (B, 1, T, 8)
        ones = torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device)
        mask = ones.triu() if self.upper else ones.tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)


@pytest.mark.parametrize("upper", [False, True])
def test_a_mask_built_from_sizes_becomes_the_causal_flag_only_if_causal(upper):
    with torch.device("meta"):
        graph = planner.capture(_SizedMask(upper), (torch.zeros(2, 12, 8),))
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", context=2)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=2), config, 4)
    if upper:
        with pytest.raises(LoweringError, match="cannot split the attention mask"):
            lower_plan(plan, graph)
        return
    src = lower_plan(plan, graph)[0].stages[0].source
    assert "context.attention(getitem, getitem_1, getitem_2, causal = True, mode = 'ring')" in src
    assert "tril" not in src and "ones" not in src


class _Scores(nn.Module):
    """Causal attention, then attention written out: its (B, T, T) scores hold the sequence twice."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):                                            # (B, T=12, 8)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)          # each (B, 1, T, 8)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        return (h @ h.transpose(1, 2)).softmax(-1) @ h               # scores (B, T, T)


def test_a_value_holding_the_sequence_twice_is_refused_naming_it():
    with torch.device("meta"):
        graph = planner.capture(_Scores(), (torch.zeros(2, 12, 8),))
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=2),
                           planner.ParallelConfig(micro_batch_size=2, dtype="fp32", context=2), 4)
    with pytest.raises(LoweringError, match=r"cannot split node 'matmul' .* shape \(2, 12, 12\) holds the sequence "
                                            "length 12 on several dimensions"):
        lower_plan(plan, graph)


def test_rank_context_takes_targets_and_positions_in_chunk_order():
    rank1 = ContextRank(SoloGroup(0), chunk_layout(8, 2, 1))
    assert rank1.take(torch.arange(8).view(1, 8), 1).tolist() == [[2, 3, 4, 5]]
    assert rank1.positions(5).tolist() == [7, 8, 9, 10]

    class Source:
        def micro_batches(self, step):
            return [((torch.zeros(1, 8),), torch.arange(8).view(1, 8) + 10 * step)]

    (inputs, targets), = ContextBatches(Source(), chunk_layout(8, 2, 0), 1).micro_batches(1)
    assert targets.tolist() == [[10, 11, 16, 17]]
    assert inputs[0].shape == (1, 8)           # the stage code takes the inputs itself
