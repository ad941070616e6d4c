"""Sub-graph parallelism (SUPER): region choice, plan recording, cost model, search, lowering."""

import functools

import pytest

import planner
from planner.evaluator import Evaluator
from codegen.emit import capture_ref
from codegen.lower import lower
from planner import ConfigError, ParallelConfig
from planner.strategies.subgraph.regions import SubgraphError, describe_regions, module_owners, split_regions
from runtime.vocab import MeshAxis
from tests.parallel_cases import graph_of
from tests.fixed_machine import local_cluster

KW = {"num_modules": 2, "channels": 8, "stem_channels": 8, "image_size": 8}


@functools.lru_cache(maxsize=None)
def inception():
    return capture_ref("examples/models/inception.py:build", KW, batch_size=2)


def _plan(B, d=1, p=1, cluster="local", mb=2, batch=8):
    cfg = ParallelConfig(subgraph=B, data=d, pipeline=p, micro_batch_size=mb, dtype="fp32")
    cl = local_cluster(cfg.num_devices) if cluster == "local" else planner.Cluster.preset(cluster, devices=cfg.num_devices)
    return planner.make_plan(inception(), cl, cfg, global_batch_size=batch)


def test_inception_modules_are_split_and_paths_dealt_longest_first():
    regions = split_regions(inception(), 2)
    assert [r.layer for r in regions] == ["blocks.0", "blocks.1"]
    for r in regions:
        assert len(r.paths) == 4 and len(r.exits) == 4 and r.join.startswith("cat")
        # the 3x3 branch (b2) is the longest: it gets a sub-grid to itself
        heavy = max(range(4), key=lambda k: r.cost[k])
        assert "b2" in r.exits[heavy] and r.owners.count(r.owners[heavy]) == 1
    four = split_regions(inception(), 4)
    assert all(sorted(r.owners) == [0, 1, 2, 3] for r in four)
    assert split_regions(inception(), 1) == ()


def test_models_without_independent_branches_cannot_be_split():
    assert split_regions(graph_of("mlp"), 2) == ()
    cfg = ParallelConfig(subgraph=2, micro_batch_size=2, dtype="fp32")
    with pytest.raises(SubgraphError, match="needs fork/join branches.*has none"):
        planner.make_plan(graph_of("mlp"), local_cluster(2), cfg, global_batch_size=4)
    # GPT tiny has 4 heads per attention: they split 2 or 4 ways, not 3
    with pytest.raises(SubgraphError, match="only heads branches that do not split 3 ways"):
        planner.make_plan(graph_of("gpt"), local_cluster(3),
                          cfg.replace(subgraph=3), global_batch_size=6)


def test_attention_heads_split_into_equal_groups():
    for B in (2, 4):
        regions = split_regions(graph_of("gpt"), B)
        assert [r.kind for r in regions] == ["heads", "heads"] and all(r.heads == 4 for r in regions)
        assert all(r.owners == tuple(range(B)) for r in regions)
    plan = planner.make_plan(graph_of("gpt"), local_cluster(2),
                             ParallelConfig(subgraph=2, micro_batch_size=2, dtype="fp32"), global_batch_size=8)
    assert "heads 0-1 on sub-grid 0; 2-3 on sub-grid 1" in plan.summary()
    assert planner.Plan.from_dict(plan.to_dict()) == plan
    ev = Evaluator(graph_of("gpt"), planner.Cluster.preset("dgx-a100-80gb", devices=2))
    layer = next(la for la in graph_of("gpt").layers if la.name == "blocks.0")
    one, two = (ev.layer_cost(layer, ParallelConfig(micro_batch_size=2, subgraph=b)) for b in (1, 2))
    assert two.forward < one.forward and two.on("subgraph").forward > 0 and two.params == one.params


@pytest.mark.parametrize("kwargs,needle", [
    (dict(subgraph=2, tensor=2), "tensor > 1"),
    (dict(subgraph=2, pipeline=2, bidirectional=True), "bidirectional"),
    (dict(subgraph=2, recompute="full"), "recompute='full'"),
    (dict(subgraph=0), "positive integer"),
])
def test_config_rules(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        ParallelConfig(**kwargs)


def test_config_mesh_and_json():
    cfg = ParallelConfig(subgraph=2, data=2)
    assert cfg.mesh == {MeshAxis.PIPELINE: 1, "data": 2, MeshAxis.SUBGRAPH: 2, "tensor": 1} and cfg.num_devices == 4
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg and "g2" in cfg.short()
    assert "subgraph" not in ParallelConfig(data=2).to_dict()   # neutral: old documents unchanged


def test_plan_records_the_sub_grid_of_every_path_and_round_trips():
    plan = _plan(2)
    assert plan.subgraph == split_regions(inception(), 2)
    text = plan.summary()
    assert "sub-graph parallelism: 2 sub-grids" in text and "blocks.0: sub-grid 0:" in text
    assert planner.Plan.from_dict(plan.to_dict()) == plan
    bad = plan.to_dict()
    bad["subgraph"][0]["paths"][0]["sub_grid"] = 5
    with pytest.raises(planner.PlanFileError, match=r"subgraph\[0\].*sub-grid 5"):
        planner.Plan.from_dict(bad)
    del bad["subgraph"]
    with pytest.raises(planner.PlanFileError, match="config.subgraph is 2"):
        planner.Plan.from_dict(bad)


def test_cost_model_splits_branch_compute_and_adds_the_region_collectives():
    ev = Evaluator(inception(), planner.Cluster.preset("dgx-a100-80gb", devices=2))
    one, two = ParallelConfig(micro_batch_size=4), ParallelConfig(micro_batch_size=4, subgraph=2)
    layer = next(la for la in inception().layers if la.name == "blocks.0")
    stem = inception().layers[0]
    base, split = ev.layer_cost(layer, one), ev.layer_cost(layer, two)
    assert split.forward < base.forward and split.backward < base.backward and split.params < base.params
    assert split.on("subgraph").forward > 0 and split.on("subgraph").backward > 0 and base.on("tensor").forward == 0
    assert ev.layer_cost(stem, two) == ev.layer_cost(stem, one)   # outside the regions: replicated
    # the busiest sub-grid holds the 3x3 branch alone: more than half of the branch compute
    assert split.forward > base.forward / 2


def test_search_considers_sub_graph_plans_where_branches_exist():
    cl = local_cluster(4)
    plan = planner.optimize(inception(), cl, global_batch_size=8, progress=False,
                            constraints={"subgraph": 2, "dtype": "fp32"})
    assert plan.config.subgraph == 2 and plan.config.data == 2 and plan.subgraph
    assert "sub-graph blocks.0" in planner.explain(plan)
    free = planner.optimize(inception(), cl, global_batch_size=8, progress=False, keep_alternatives=200)
    assert any(a.config.subgraph > 1 for a in free.alternatives) or free.config.subgraph > 1
    mlp = planner.optimize(graph_of("mlp"), local_cluster(2), global_batch_size=8,
                           progress=False, keep_alternatives=200)
    assert all(a.config.subgraph == 1 for a in mlp.alternatives)


@pytest.mark.parametrize("B,d", [(2, 1), (2, 2), (4, 1)])
def test_lowered_ranks_hold_only_their_sub_grids_parameters(B, d):
    plan = _plan(B, d)
    progs = lower(plan, inception())
    owners = module_owners(inception(), plan.subgraph)
    for prog in progs.values():
        assert dict(prog.mesh)[MeshAxis.SUBGRAPH] == B
        if d == 1:
            assert not prog.buckets
            continue
        mine = prog.coord(MeshAxis.SUBGRAPH)
        names = [n for b in prog.buckets for n in b.params]
        assert names and all(owners.get(n.rsplit(".", 1)[0], mine) == mine for n in names)
        assert "stem.conv.weight" in names and "fc.weight" in names


def test_describe_names_idle_sub_grids():
    r = split_regions(inception(), 8)[0]
    lines = describe_regions((r,), 8)
    assert "(idle)" in lines[0]

def test_codegen_command_takes_the_subgraph_degree(tmp_path, capsys):
    from planner.app.cli import main

    out = tmp_path / "build"
    args = ["codegen", "examples/models/inception.py:build", *[f"--arg={k}={v}" for k, v in KW.items()],
            "--batch", "8", "--data", "2", "--subgraph", "2", "--micro-batch", "2", "-o", str(out)]
    assert main(args) == 0
    plan = planner.Plan.load(out / "plan.json")
    assert plan.config.subgraph == 2 and plan.subgraph == split_regions(inception(), 2)
    assert "self.subgraph.region(" in (out / "rank_0001.py").read_text()
