"""GEMS bi-directional pipelines on real processes (gloo): MAST (T=1) and MASTER (T=2) on 2 and 4
pipeline positions, and data 2 x pipeline 2, train exactly like the single process.

Same math as the reference: the step is gradient accumulation over the 2T micro-batches of
each data rank (replica A takes the even ones, replica B the odd ones), so after 3 steps every
rank's loss and every parameter it holds equal the single-process run (fp32, rtol 1e-4).
"""

import pytest

import planner
from codegen.emit import emit
from runtime.launch.launcher import run_many
from tests.parallel_cases import MODELS, SGD, assert_exact, emit_case, graph_of

# name -> (model, config, micro-batch); the global batch is micro-batch x data x 2T.
TWO = {
    "mlp_p2_mast": ("mlp", dict(pipeline=2), 2),
    "gpt_p2_mast": ("gpt", dict(pipeline=2), 2),
    "gpt_p2_master": ("gpt", dict(pipeline=2, replicas_per_direction=2), 2),
    "resnet_p2_master": ("resnet", dict(pipeline=2, replicas_per_direction=2), 2),
}
FOUR = {
    "mlp_p4_mast": ("mlp", dict(pipeline=4), 2),
    "gpt_p4_master": ("gpt", dict(pipeline=4, replicas_per_direction=2), 2),
    "gpt_d2p2_mast": ("gpt", dict(data=2, pipeline=2), 2),
    "mlp_d2p2_master": ("mlp", dict(data=2, pipeline=2, replicas_per_direction=2), 1),
}


def _builds(root, cases):
    out = {}
    for name, (model, cfg, mb) in cases.items():
        batch = mb * cfg.get("data", 1) * 2 * cfg.get("replicas_per_direction", 1)
        out[name] = emit_case(root, model, name, dict(cfg, bidirectional=True), global_batch=batch, micro_batch=mb)
    return out


def _searched(root):
    """The plan planner.optimize returns when asked for a bidirectional pipeline on 2 local ranks."""
    graph = graph_of("gpt")
    plan = planner.optimize(graph, planner.Cluster.preset("local", devices=2), global_batch_size=8, progress=False,
                            constraints={"bidirectional": True, "dtype": "fp32"})
    assert plan.config.bidirectional and plan.config.pipeline == 2
    ref, kw = MODELS["gpt"]
    return emit(plan, ref, None, root / "gpt_optimized", model_kwargs=kw, graph=graph, optimizer=SGD,
                bucket_bytes=2048).path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bidirectional")
    results = {}
    for cases in (TWO, FOUR):
        builds = _builds(root, cases)
        if cases is TWO:
            builds["gpt_optimized"] = _searched(root)
        results.update(zip(builds, run_many(list(builds.values()), steps=3, backend="gloo", timeout=60,
                                            verify=True)))
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted({**TWO, **FOUR, "gpt_optimized": None}))
def test_bidirectional_pipeline_equals_single_process(runs, name):
    res = runs[name]
    assert_exact(res, name)
    per_rank = list(res.losses.values())
    assert all(x == per_rank[0] for x in per_rank), f"{name}: ranks disagree on the loss {res.losses}"


@pytest.mark.timeout(600)
def test_pair_all_reduce_runs_over_both_directions(runs):
    """Position 0 runs stage 0 for even micro-batches and the last stage for odd ones, and
    reduces the gradients of both stages with its mirror position."""
    tl = runs["gpt_p4_master"].timeline
    r0 = [e.name for e in tl.events if e.rank == 0 and e.step == 0]
    assert "F s0 m0" in r0 and "F s3 m1" in r0 and "F s0 m2" in r0 and "F s3 m3" in r0
    reduces = [n for n in r0 if n.startswith("ALLREDUCE grads")]
    assert reduces and all("@pair" in n for n in reduces)
    stages = [int(n.split()[2][1:]) for n in reduces]
    assert stages == sorted(stages, reverse=True), "higher stage first"
