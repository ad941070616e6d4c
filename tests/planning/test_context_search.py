"""The search with context parallelism: a GPT at a long sequence on one 8-GPU node, where the
activations of a sequence do not fit a device unless the sequence is split."""

from __future__ import annotations

import pytest
import torch

import planner
from cost_models.overlap import Overlap
from runtime.execution import Execution
from examples.models import gpt
from planner import NoFeasiblePlan

# 6.4B-parameter GPT at 256K tokens: under full recompute each of the 32 layers keeps its
# (256K x 4096) bf16 input, 2 GiB, and a 1F1B first stage holds as many micro-batches as there
# are stages, so without a sequence split a device holds 64 GiB of layer inputs besides its
# weights, gradients and optimizer state.
KW = dict(vocab_size=32000, seq_len=262144, hidden=4096, num_layers=32, num_heads=32)
BATCH = 8


@pytest.fixture(scope="module")
def long_gpt():
    with torch.device("meta"):
        model = gpt.build(**KW)
    return planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", **KW))


def test_the_search_splits_a_long_sequence_when_nothing_else_fits(long_gpt):
    cluster = planner.Cluster.preset("dgx-a100-80gb", nodes=1)
    # runtime=None: a what-if search over everything the cost model prices, on a 16-bit stack (Megatron-LM's:
    # bf16 layer inputs; under meshplan's autocast the residual stream is fp32, twice these bytes); sequence
    # parallelism (which also divides these activations, by the tensor degree) is left out: a stack without it.
    # The loss is the fused chunked one: at 256K tokens a sequence's fp32 logits alone take 32 GiB.
    no_sp = {"sequence_parallel": False}
    stack = {"overlap": Overlap.preset("megatron"), "execution": Execution(loss="chunked")}
    plan = planner.optimize(long_gpt, cluster, global_batch_size=BATCH, progress=False, runtime=None,
                            constraints=no_sp, **stack)
    assert plan.config.context > 1
    assert plan.prediction.fits
    try:
        plain = planner.optimize(long_gpt, cluster, global_batch_size=BATCH, progress=False, runtime=None,
                                 constraints={**no_sp, "context": 1}, **stack)
    except NoFeasiblePlan:
        plain = None
    assert plain is None or plain.prediction.step_time > plan.prediction.step_time
    # with every dimension open the search does at least as well as without sequence parallelism
    both = planner.optimize(long_gpt, cluster, global_batch_size=BATCH, progress=False, runtime=None, **stack)
    assert both.prediction.fits
    assert both.prediction.step_time <= plan.prediction.step_time * (1 + 1e-9)


def test_the_constraints_pin_the_context_degree_and_attention(long_gpt):
    cluster = planner.Cluster.preset("dgx-a100-80gb", nodes=1)
    plan = planner.optimize(long_gpt, cluster, global_batch_size=BATCH, progress=False, runtime=None,
                            constraints={"context": 2, "context_attention": "ulysses"},
                            overlap=Overlap.preset("megatron"), execution=Execution(loss="chunked"))
    assert (plan.config.context, plan.config.context_attention) == (2, "ulysses")
    assert all(a.config.context == 2 and a.config.context_attention == "ulysses" for a in plan.alternatives)
