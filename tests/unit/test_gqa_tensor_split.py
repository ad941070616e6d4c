"""Tensor parallelism for grouped-query attention, planned on meta: the example GPT shaped like
Llama-70B (8 query heads, 2 key/value heads, SwiGLU, no bias) splits q's heads and k/v's heads in
matching contiguous blocks at tensor 2, the plan stores that split and round-trips, tensor 4 is
refused naming the key/value heads, and a partition whose query heads do not follow their key/value
heads is refused by the attention rule. Hugging Face Llama (8 heads, 2 key/value heads) repeats its
key/value heads to 8 (repeat_kv) before attention: the sharding plan still finds the 2 behind the
repeat (even beside a batch-1 rotary table), and the split gives each rank its kv head's block."""

import pytest
import torch

import planner
from examples.models import gpt
from planner import ConfigError, Plan
from planner.graph.capture import capture_ref
from planner.strategies.tensor.sharding import find_sharding
from planner.strategies.tensor.split.op_rules import _grouped_heads
from planner.strategies.tensor.split.state import Split, _Fail, _State
from runtime.parallel.tensor.layers import FeatureSplit

# hidden 64 = 8 heads of 8; 2 key/value heads, each read by 4 consecutive query heads
LLAMA_LIKE = dict(hidden=64, num_heads=8, num_kv_heads=2, activation="swiglu", mlp_hidden=96, bias=False)


def _graph(**fields):
    with torch.device("meta"):
        model = gpt.build(**fields)
    return planner.capture(model, gpt.example_inputs(batch_size=2, device="meta"))


@pytest.fixture(scope="module")
def gqa_graph():
    return _graph(**LLAMA_LIKE)


def _plan(graph, tensor):
    cfg = planner.ParallelConfig(tensor=tensor, micro_batch_size=2, dtype="fp32")
    return planner.make_plan(graph, planner.Cluster.preset("local", devices=tensor), cfg, global_batch_size=4,
                             sharding="all")


@pytest.fixture(scope="module")
def t2_plan(gqa_graph):
    return _plan(gqa_graph, 2)


def test_tensor_2_splits_query_and_key_value_heads_in_matching_blocks(t2_plan):
    splits = t2_plan.tensor_splits
    modules = {m.path: (str(m.role), m.split) for m in splits.modules}
    # q (64 = 8 heads x 8) column-split by heads: rank 0 holds heads 0-3, i.e. output features 0..31
    assert modules["blocks.0.attn.q"] == ("column", FeatureSplit((8, 8), 0))
    # k and v (16 = 2 heads x 8) column-split by their 2 heads: rank 0 holds kv head 0, features 0..7
    assert modules["blocks.0.attn.k"] == ("column", FeatureSplit((2, 8), 0))
    assert modules["blocks.0.attn.v"] == ("column", FeatureSplit((2, 8), 0))
    assert modules["blocks.0.attn.proj"] == ("row", FeatureSplit((8, 8), 0))
    assert torch.equal(FeatureSplit((8, 8), 0).indices(1, 2), torch.arange(32, 64))
    assert torch.equal(FeatureSplit((2, 8), 0).indices(1, 2), torch.arange(8, 16))
    values = {node: (dim, fs) for node, dim, fs in splits.values}
    # attention's output (B, H, T, D) is split like q: dimension 1, 8 heads in 2 blocks of 4
    assert values["scaled_dot_product_attention"] == (1, FeatureSplit((8,), 0))


def test_the_gqa_plan_round_trips(t2_plan, tmp_path):
    t2_plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == t2_plan


def test_tensor_4_is_refused_naming_the_key_value_heads(gqa_graph):
    with pytest.raises(ConfigError, match=r"tensor degree 4 does not divide the key/value heads of "
                                          r"blocks\.0\.attn = 2"):
        _plan(gqa_graph, 4)


def test_tensor_4_with_4_key_value_heads_gives_each_rank_one_kv_head_and_its_2_query_heads():
    splits = _plan(_graph(**{**LLAMA_LIKE, "num_kv_heads": 4}), 4).tensor_splits
    modules = {m.path: m.split for m in splits.modules}
    assert modules["blocks.1.attn.q"] == FeatureSplit((8, 8), 0)   # rank r: heads 2r, 2r+1
    assert modules["blocks.1.attn.k"] == FeatureSplit((4, 8), 0)   # rank r: kv head r


def _heads(q: FeatureSplit, kv: FeatureSplit) -> list[Split]:
    return [Split(1, q.factors, q.split), Split(1, kv.factors, kv.split), Split(1, kv.factors, kv.split)]


def test_the_attention_rule_accepts_query_heads_that_follow_their_key_value_heads():
    # 4 query heads, 2 kv heads, t=2: q as (2 groups, 2 per group) split on the group is heads {0,1} | {2,3}
    _grouped_heads("attn", _heads(FeatureSplit((2, 2), 0), FeatureSplit((2,), 0)), 4, 2, _State(t=2, choices={}))


def test_the_attention_rule_refuses_query_heads_that_do_not_follow_their_key_value_heads():
    # q split on the inner factor gives rank 0 heads {0, 2}, but kv head 0 serves query heads {0, 1}
    with pytest.raises(_Fail, match="rank 0's query heads are not those that read its key/value heads"):
        _grouped_heads("attn", _heads(FeatureSplit((2, 2), 1), FeatureSplit((2,), 0)), 4, 2,
                       _State(t=2, choices={}))


def test_the_attention_rule_refuses_a_degree_that_does_not_divide_the_key_value_heads():
    with pytest.raises(_Fail, match="has 2 key/value heads, and the tensor degree 4 does not divide them"):
        _grouped_heads("attn", _heads(FeatureSplit((8,), 0), FeatureSplit((2,), 0)), 8, 2, _State(t=4, choices={}))


HF_LLAMA = ("examples/models/hf.py:build", {"arch": "llama", "num_attention_heads": 8, "num_key_value_heads": 2})


@pytest.fixture(scope="module")
def llama_graph():
    return capture_ref(*HF_LLAMA, batch_size=1)


def test_the_key_value_heads_are_found_behind_hf_repeat_kv(llama_graph):
    heads = [(what, size) for what, size, paddable, _r in find_sharding(llama_graph).constraints
             if not paddable and "layers.0." in what]
    assert heads == [("the heads of model.layers.0.self_attn", 8),
                     ("the key/value heads of model.layers.0.self_attn", 2)]


def test_hf_llama_at_tensor_2_splits_k_by_its_key_value_heads(llama_graph):
    params = {p.name: (p.dim, p.split) for p in _plan(llama_graph, 2).tensor_splits.params}
    assert params["model.layers.0.self_attn.q_proj.weight"] == (0, FeatureSplit((8, 8), 0))   # 8 heads of 8
    assert params["model.layers.0.self_attn.k_proj.weight"] == (0, FeatureSplit((2, 8), 0))   # 2 kv heads of 8


def test_hf_llama_at_tensor_4_is_refused_naming_the_key_value_heads(llama_graph):
    with pytest.raises(ConfigError, match=r"tensor degree 4 does not divide the key/value heads of "
                                          r"model\.layers\.0\.self_attn = 2"):
        _plan(llama_graph, 4)
