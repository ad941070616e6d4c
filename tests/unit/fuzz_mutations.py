"""Mutations of JSON documents for the loader fuzz tests (shared by tests and benchmarks/fuzz_loaders.py)."""

from __future__ import annotations

import copy
import random
from typing import Any

ODD_VALUES = (None, True, False, 0, -1, 1, 2**63, -2.5, 1e308, float("inf"), float("nan"), "", "x", "fp64",
              [], [1, 2], {}, {"a": 1}, [[]], "🙂", 3.5)


def paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys / indices) to a node of a JSON document."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths(v, prefix + (i,))
    return out


def odd_value(rng: random.Random) -> Any:
    """A fresh copy of an odd value: sharing the list's own containers would let later damage make cycles."""
    return copy.deepcopy(rng.choice(ODD_VALUES))


def mutate(doc: Any, rng: random.Random, steps: int = 1) -> Any:
    """Apply `steps` random damages: delete, replace with an odd value, rename, duplicate or swap types."""
    doc = copy.deepcopy(doc)
    for _ in range(steps):
        ps = [p for p in paths(doc) if p]
        if not ps:
            return odd_value(rng)
        path = rng.choice(ps)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        action = rng.randrange(5)
        if action == 0:  # delete
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif action == 1:  # odd value
            parent[key] = odd_value(rng)
        elif action == 2 and isinstance(parent, dict):  # misspell the key
            parent[str(key) + rng.choice(["_", "s", "x"])] = parent.pop(key)
        elif action == 3:  # numbers scaled or negated, strings mangled
            v = parent[key]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                parent[key] = rng.choice([-v, v * 1000, v / 1000, 0, int(v) if v == v and abs(v) < 1e18 else 0])
            elif isinstance(v, str):
                parent[key] = v[::-1] if v else "?"
            else:
                parent[key] = odd_value(rng)
        else:  # wrap or unwrap containers
            v = parent[key]
            parent[key] = [v] if not isinstance(v, list) else (v[0] if v else {})
    return doc


def sample_program_docs() -> list[dict]:
    """Program documents (JSON) of real lowered plans for GPT tiny, as codegen writes them: pipeline
    1F1B with data parallelism and ZeRO-1, interleaved pipeline, tensor x data with ZeRO-3."""
    import planner
    from planner.app.commands import make_fixed_plan
    from codegen.emit import capture_ref
    from codegen.lower import lower

    graph = capture_ref("examples/models/gpt.py:build", {"preset": "tiny"}, batch_size=2)
    docs = []
    for cfg, rank in ((dict(data=2, pipeline=2, zero=1), 1),
                      (dict(pipeline=2, schedule="interleaved", virtual_stages=2), 0),
                      (dict(data=2, tensor=2, zero=3), 3)):
        config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
        plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=config.num_devices), config, 8)
        docs.append(lower(plan, graph, bucket_bytes=2048)[rank].to_dict())
    return docs
