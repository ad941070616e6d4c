"""planner.optimize asks the code generator about the tensor degrees it searches only: a degree it never
enumerates (one that does not divide the heads, or wider than a node) must not make it replicate a region
for every degree."""

import planner
from examples.models import gpt


def test_a_never_searched_degree_does_not_replicate_attention():
    # 8 GPUs, 4 heads: degree 8 cannot split the heads and is never searched; data 4 leaves tensor 2,
    # which splits them (2 heads per rank), so every block's qkv is column-parallel in Megatron's layout.
    graph = planner.capture(gpt.build("small"), gpt.example_inputs(1, preset="small"))
    plan = planner.optimize(graph, planner.Cluster.preset("dgx-a100-80gb"), global_batch_size=8,
                            constraints=dict(data=4, pipeline=1, subgraph=1), sharding="all", progress=False)
    assert plan.config.tensor == 2
    roles = dict(plan.shardings)
    assert [roles.get(f"blocks_{k}_attn_qkv") for k in range(4)] == ["column"] * 4
