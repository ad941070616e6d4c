"""Capture and graph analysis: a PyTorch model becomes a ModelGraph.

    capture.py       torch.fx, torch.export as the fallback, meta tensors for models too big to allocate
    analysis.py      the pass that runs every node once on meta tensors: shapes, FLOPs, saved bytes
    export.py        the torch.export path (unflattened back into module calls)
    ops.py           per-op facts (FLOPs, bytes, parameters) of an fx node
    model.py         ModelGraph, OpInfo, Layer, Branch, TensorMeta: the captured graph as a JSON value
    layers.py        the ordered layers pipeline stages are cut from (repeated blocks share a signature)
    branches.py      the fork/join paths sub-graph parallelism places apart
    ties.py          weights used by several layers (tied embeddings)

Nothing here prices or plans; planner/strategies and planner/evaluator.py read the ModelGraph.
"""
