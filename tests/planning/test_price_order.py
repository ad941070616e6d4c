"""A configuration's price does not depend on what the Evaluator priced before it.

The search prices thousands of configurations through one Evaluator, whose per-layer caches are keyed
by what a layer's cost reads of the configuration. On a GPU, meshplan's runtime adds every backward's
weight gradients into gradient buckets wherever ranks sum them (data, spatial and context replicas), so
a layer's cost there depends on that replica count too; a cache keyed without it gave a data-1 plan the
bucket costs of a data-2 plan priced before it (or the other way round), and the search's answer
depended on the order it met the candidates in (54 of 148 GPT configurations differed on an A100).
"""

from __future__ import annotations

import random

import pytest
import torch

import planner
from examples.models import gpt
from planner.evaluator import Evaluator


def _configs() -> list[planner.ParallelConfig]:
    out = []
    for d, t, p in ((8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4)):
        for mb, rc in ((1, "none"), (2, "full"), (2, "selective")):
            for sp in (False, True) if t > 1 else (False,):
                out.append(planner.ParallelConfig(data=d, tensor=t, pipeline=p, micro_batch_size=mb, recompute=rc,
                                                  zero=1 if d > 1 else 0, sequence_parallel=sp))
    out += [planner.ParallelConfig(data=d, context=c, tensor=t, micro_batch_size=1)
            for d, c, t in ((4, 2, 1), (1, 2, 4), (1, 4, 2))]
    return out


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = gpt.build(preset="tiny")
    return planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="tiny"))


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-a100-80gb"])
def test_prices_are_the_same_in_any_order(graph, preset):
    cluster = planner.Cluster.preset(preset, devices=8)
    configs = _configs()
    alone = {c: Evaluator(graph, cluster).evaluate(c, 32) for c in configs}
    for seed in range(2):
        order = configs[:]
        random.Random(seed).shuffle(order)
        ev = Evaluator(graph, cluster)
        for c in order:
            p = ev.evaluate(c, 32)
            assert (p.step_time, p.peak_memory) == (alone[c].step_time, alone[c].peak_memory), (
                f"{c.short()} priced after others: {p.step_time} s, {p.peak_memory} B; alone: "
                f"{alone[c].step_time} s, {alone[c].peak_memory} B")


def test_spatial_and_context_replicas_sum_gradients_in_buckets(graph):
    """The replicas the GPU pricing counts are the ranks the lowering gives gradient buckets: data x
    spatial x context (their plans lower to a data-parallel twin of that degree)."""
    ev = Evaluator(graph, planner.Cluster.preset("dgx-h100", devices=8))
    assert ev.grad_replicas(planner.ParallelConfig(data=2, tensor=4)) == 2
    assert ev.grad_replicas(planner.ParallelConfig(data=2, context=2, tensor=2)) == 4
    assert ev.grad_replicas(planner.ParallelConfig(data=1, tensor=8)) == 1
    assert ev.grad_replicas(planner.ParallelConfig(data=2, spatial=4, spatial_until="pool")) == 8
    assert ev.adds_into_buckets(planner.ParallelConfig(data=1, context=2, tensor=4))
    assert not ev.adds_into_buckets(planner.ParallelConfig(data=1, tensor=8))
