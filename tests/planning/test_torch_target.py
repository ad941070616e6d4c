"""Targets: the torch target (PyTorch's DeviceMesh/DTensor/FSDP2/pipelining stack) runs fewer strategies than
meshplan's runtime; the search for it picks only those, its refusals name the target and the strategy, and a
plan records the target it was made for."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import planner
from examples.models import gpt, resnet
from planner.app.cli import main
from planner.capabilities import (MESHPLAN_RUNTIME, TORCH_RUNTIME, RuntimeSupport, TargetError, as_target,
                                  check_target)
from planner.config import ConfigError, ParallelConfig
from planner.plan import PlanFileError
from runtime.vocab import Target
from tests.real_models import HF, graph_of
from tests.fixed_machine import local_cluster


def _gpt(**kw):
    with torch.device("meta"):
        model = gpt.build(**kw)
    return planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", **kw))


@pytest.fixture(scope="module")
def small_gpt():
    return _gpt(preset="small")


@pytest.fixture(scope="module")
def long_gpt():
    """A GPT at 4096 tokens: with attention's (T x T) scores stored (fused_attention=False), recomputing
    only them (selective) is the cheapest way to fit a 4-sample micro-batch in 10% of an A100."""
    return _gpt(seq_len=4096, hidden=512, num_layers=4, num_heads=16, vocab_size=512)


def _summit_node():
    """One Summit node: 6 V100s, which have fp16 tensor cores and no bf16."""
    return dataclasses.replace(planner.Cluster.preset("summit"), num_nodes=1)


# ---- the vocabulary --------------------------------------------------------------------------


def test_target_names_round_trip_and_pick_their_runtime_support():
    assert [str(t) for t in Target] == ["meshplan", "torch"]
    for t in Target:
        assert Target(str(t)) is t and as_target(str(t)) is t and as_target(t) is t
    assert RuntimeSupport.for_target("torch") is TORCH_RUNTIME and TORCH_RUNTIME.target == Target.TORCH
    assert RuntimeSupport.for_target(Target.MESHPLAN) is MESHPLAN_RUNTIME
    with pytest.raises(TargetError, match=r"target 'pytorch' is not one of meshplan, torch"):
        RuntimeSupport.for_target("pytorch")
    assert issubclass(TargetError, ConfigError) and issubclass(TargetError, ValueError)


# ---- what the torch target runs, and its refusals ------------------------------------------------

TORCH_RUNS = (
    dict(data=2),
    dict(data=2, zero=1), dict(data=2, zero=2), dict(data=2, zero=3),
    dict(tensor=2, sequence_parallel=True),
    dict(data=2, tensor=2, zero=3, recompute="full"),
    dict(pipeline=2, schedule="gpipe", micro_batch_size=4),          # 2 micro-batches of batch 8
    dict(pipeline=2, schedule="1f1b", micro_batch_size=4),           # 2 micro-batches on 2 stages
    dict(pipeline=2, schedule="interleaved", virtual_stages=2, data=2),
    dict(tensor=2, dtype="fp32"),
)


@pytest.mark.parametrize("fields", TORCH_RUNS, ids=lambda f: ParallelConfig(**f).short())
def test_torch_runs_data_zero_tensor_sequence_pipelines_and_full_recompute(fields):
    assert TORCH_RUNTIME.why_not(ParallelConfig(**fields), 8) is None


REFUSED = (
    (dict(pipeline=2, bidirectional=True),
     "the torch target does not run bidirectional (GEMS) pipelines: torch.distributed.pipelining has no schedule "
     "that runs a second pipeline replica's stages in reverse over the same devices; use bidirectional=False, "
     "or plan for the meshplan target"),
    (dict(spatial=2, spatial_until="conv1"),
     "the torch target does not run spatial parallelism: PyTorch has no tiling of convolutions over devices "
     "with halo exchange; use spatial=1, or plan for the meshplan target"),
    (dict(subgraph=2),
     "the torch target does not run sub-graph parallelism: PyTorch places no fork/join branches of a model on "
     "sub-grids of one data replica; use subgraph=1, or plan for the meshplan target"),
    (dict(context=2, context_attention="ulysses"),
     "the torch target does not run context parallelism: torch.distributed.tensor.experimental.context_parallel "
     "swaps in ring attention only for the CUDA flash, memory-efficient and cuDNN scaled_dot_product_attention "
     "kernels (not the CPU kernel, nor attention written as matmul and softmax) and has no Ulysses head split, "
     "so it does not carry out meshplan's context-parallel plans; use context=1, or plan for the meshplan target"),
    (dict(recompute="selective"),
     "the torch target does not run recompute='selective': a selective torch.utils.checkpoint policy that keeps "
     "the matrix products (the closest torch has to Megatron's selective recompute) still keeps attention's "
     "(batch, heads, T, T) scores where attention runs as matmuls, which Megatron's selective recompute frees "
     "and the cost model counts as freed; use recompute='none' or recompute='full', or plan for the meshplan "
     "target"),
    (dict(data=2, dtype="fp16"),
     "the torch target does not run fp16 training: fp16 needs dynamic loss scaling whose overflow check agrees "
     "on every rank, and torch.amp.GradScaler checks only this rank's gradient shards (FSDP's ShardedGradScaler "
     "is not proven with tensor-parallel DTensor gradients); use dtype='fp32' or dtype='bf16', or plan for the "
     "meshplan target"),
    (dict(pipeline=2, tensor=2, micro_batch_size=2),
     "the torch target does not run pipeline 2 with tensor 2 inside its stages: its pipeline stages "
     "(codegen/torch_target/pipeline.py) take no tensor-parallel styles yet; use pipeline=1 or tensor=1, or plan "
     "for the meshplan target"),
    # batch 8 / (micro-batch 2 x data 2) = 2 micro-batches for 4 stages
    (dict(pipeline=4, data=2, micro_batch_size=2),
     "the torch target does not run 1f1b with 2 micro-batches (global batch 8 / (micro_batch_size 2 x data 2)) "
     "on pipeline 4: torch.distributed.pipelining's Schedule1F1B needs at least as many micro-batches as "
     "pipeline stages; use schedule='gpipe', a smaller micro-batch or a larger batch, or plan for the meshplan "
     "target"),
)


@pytest.mark.parametrize("fields, text", REFUSED, ids=[str(next(iter(f))) + "/" + str(len(t)) for f, t in REFUSED])
def test_torch_refusals_name_the_target_and_the_strategy(fields, text):
    cfg = ParallelConfig(**fields)
    assert TORCH_RUNTIME.why_not(cfg, 8) == text
    assert MESHPLAN_RUNTIME.why_not(cfg, 8) is None   # each is one meshplan's runtime runs


def test_a_refusal_offers_another_target_only_where_that_target_runs_it():
    # context parallelism with sequence parallelism: neither target runs it
    both = ParallelConfig(context=2, tensor=2, sequence_parallel=True)
    assert TORCH_RUNTIME.why_not(both).endswith("use context=1")
    # a meshplan runtime limited to fp32 refuses bf16, which the torch target runs
    assert RuntimeSupport(dtypes=("fp32",)).why_not(ParallelConfig(dtype="bf16")) == (
        "the meshplan target does not run bf16 training; use dtype='fp32', or plan for the torch target")
    # without the global batch the micro-batch count is unknown: only the configuration is checked
    assert TORCH_RUNTIME.why_not(ParallelConfig(pipeline=4, data=2, micro_batch_size=2)) is None


def test_the_torch_target_runs_on_gloo_and_nccl_not_mpi():
    assert TORCH_RUNTIME.why_not_backend("gloo") is None and TORCH_RUNTIME.why_not_backend("nccl") is None
    assert TORCH_RUNTIME.why_not_backend("mpi") == (
        "the torch target does not run on the mpi backend: meshplan's MPI path (mpi4py) belongs to its own "
        "runtime; PyTorch's stack runs on gloo or NCCL process groups; use backend='gloo' or backend='nccl', "
        "or plan for the meshplan target")
    assert MESHPLAN_RUNTIME.why_not_backend("mpi") is None


# ---- the search --------------------------------------------------------------------------------


def _both(graph, cluster, batch, **kw):
    """(meshplan's plan, the torch target's plan) of the same search."""
    return (planner.optimize(graph, cluster, global_batch_size=batch, progress=False, **kw),
            planner.optimize(graph, cluster, global_batch_size=batch, progress=False, target="torch", **kw))


def _runs_on_torch(plan):
    assert plan.target == Target.TORCH
    assert TORCH_RUNTIME.why_not(plan.config, plan.global_batch_size) is None
    assert all(TORCH_RUNTIME.allows(a.config, plan.global_batch_size) for a in plan.alternatives)


def test_on_v100s_meshplan_trains_fp16_and_the_torch_target_fp32(small_gpt):
    mesh, tor = _both(small_gpt, _summit_node(), 32)
    # the torch target refuses the plan's fp16 whatever else it refuses (selective recompute, tensor splits
    # inside pipeline stages, ...): the plan's degrees without those still meet the fp16 refusal
    assert mesh.config.dtype == "fp16"
    c = mesh.config
    assert "fp16 training" in TORCH_RUNTIME.why_not(dataclasses.replace(c, recompute="full", data=c.data * c.tensor,
                                                                        tensor=1))
    assert tor.config.dtype == "fp32"   # a V100 has no bf16
    _runs_on_torch(tor)
    assert mesh.target == Target.MESHPLAN


def test_the_hugging_face_llama_on_v100s_searches_only_what_torch_runs():
    llama = graph_of(HF, (("arch", "llama"),))   # shared with the real-model tests' capture
    mesh, tor = _both(llama, _summit_node(), 32)
    assert mesh.config.dtype == "fp16" and tor.config.dtype == "fp32"
    _runs_on_torch(tor)


def test_where_meshplan_recomputes_selectively_the_torch_target_recomputes_fully(long_gpt):
    cluster = planner.Cluster.preset("dgx-a100-80gb", devices=2)
    cons = {"micro_batch_size": 4, "data": 2, "max_memory_fraction": 0.1}
    mesh, tor = _both(long_gpt, cluster, 8, constraints=cons, fused_attention=False)
    assert mesh.config.recompute == "selective"
    assert tor.config.recompute == "full" and tor.prediction.fits
    _runs_on_torch(tor)


@pytest.fixture(scope="module")
def resnet_1k():
    model = resnet.build(depth=8, width=16, image_size=1024)
    return planner.capture(model, resnet.example_inputs(1, "meta", image_size=1024))


def _split_weight_kinds(plan, graph) -> set[str]:
    """The op kinds of the nodes whose weights the plan splits over the tensor axis."""
    kinds = {n.name: n.kind for n in graph.nodes}
    return {kinds[name] for name, role in plan.shardings if role in ("column", "column_out", "row", "vocab")}


def test_where_meshplan_tiles_an_image_the_torch_target_does_not(resnet_1k):
    """One 1024^2 image per step on 8 H100s: meshplan's runtime splits it into spatial tiles; the torch
    target has no tiles, and no convolution split either (torch's tensor-parallel styles are for Linear
    and Embedding modules)."""
    mesh, tor = _both(resnet_1k, planner.Cluster.preset("dgx-h100"), 1)
    assert mesh.config.spatial == 8
    assert tor.config.spatial == 1 and tor.config.num_devices == 8
    assert _split_weight_kinds(tor, resnet_1k) == set()
    _runs_on_torch(tor)


def test_the_torch_target_splits_linear_and_embedding_weights_only(resnet_1k, small_gpt):
    cluster = local_cluster(2)
    cfg = ParallelConfig(tensor=2, dtype="fp32")
    assert _split_weight_kinds(planner.make_plan(resnet_1k, cluster, cfg, global_batch_size=2, target="meshplan"),
                               resnet_1k) == {"conv"}
    assert _split_weight_kinds(planner.make_plan(resnet_1k, cluster, cfg, global_batch_size=2, target="torch"),
                               resnet_1k) == set()
    gpt_plan = planner.make_plan(small_gpt, cluster, cfg, global_batch_size=2, target="torch")
    kinds = _split_weight_kinds(gpt_plan, small_gpt)
    assert "linear" in kinds and kinds <= {"linear", "embedding"}


@pytest.mark.parametrize("pinned, strategy", [
    ({"bidirectional": True, "pipeline": 4}, "bidirectional (GEMS) pipelines"),
    ({"context": 2}, "context parallelism"),
    ({"recompute": "selective"}, "recompute='selective'"),
])
def test_a_constraint_pinning_a_refused_strategy_fails_naming_the_target(small_gpt, pinned, strategy):
    cluster = planner.Cluster.preset("dgx-a100-80gb", devices=4)
    with pytest.raises(planner.NoFeasiblePlan, match=r"the torch target cannot run \(the torch target does not run "
                                                     + re.escape(strategy)):
        planner.optimize(small_gpt, cluster, global_batch_size=16, progress=False, target="torch",
                         constraints=pinned)


def test_optimize_refuses_an_unknown_target_and_a_target_beside_a_runtime(small_gpt):
    cluster = local_cluster(2)
    with pytest.raises(TargetError, match="target 'TORCH' is not one of meshplan, torch"):
        planner.optimize(small_gpt, cluster, global_batch_size=8, progress=False, target="TORCH")
    with pytest.raises(TargetError, match="give one"):
        planner.optimize(small_gpt, cluster, global_batch_size=8, progress=False, target="torch", runtime=None)


# ---- the plan: its target, make_plan, check_target ----------------------------------------------------


def test_a_plan_records_a_target_other_than_meshplan_and_old_plans_read_as_meshplan(small_gpt):
    cluster = local_cluster(2)
    cfg = ParallelConfig(data=2, dtype="fp32")
    tor = planner.make_plan(small_gpt, cluster, cfg, global_batch_size=8, target=Target.TORCH)
    doc = tor.to_dict()
    assert doc["target"] == "torch" and json.loads(json.dumps(doc))["target"] == "torch"
    assert planner.Plan.from_dict(doc) == tor
    assert "for the torch target" in tor.summary().splitlines()[0]
    plain = planner.make_plan(small_gpt, cluster, cfg, global_batch_size=8)
    assert "target" not in plain.to_dict() and plain.target == Target.MESHPLAN
    assert planner.Plan.from_dict(plain.to_dict()) == plain
    with pytest.raises(PlanFileError, match=r"target.*'jax'.*known targets: meshplan, torch"):
        planner.Plan.from_dict({**doc, "target": "jax"})


def test_make_plan_for_a_target_that_does_not_run_the_config_is_refused(small_gpt):
    cluster = local_cluster(2)
    with pytest.raises(TargetError, match=r"make_plan for d2 t1 p1 mb1 1f1b rc=selective z0 fp32: the torch target "
                                          r"does not run recompute='selective'"):
        planner.make_plan(small_gpt, cluster, ParallelConfig(data=2, recompute="selective", dtype="fp32"),
                          global_batch_size=8, target="torch")


def test_check_target_refuses_a_plan_its_target_does_not_run(small_gpt):
    cluster = local_cluster(2)
    selective = planner.make_plan(small_gpt, cluster, ParallelConfig(data=2, recompute="selective", dtype="fp32"),
                                  global_batch_size=8)
    check_target(selective)   # made for meshplan's runtime, which runs it
    with pytest.raises(TargetError, match=r"plan d2 t1 p1 mb1 1f1b rc=selective z0 fp32: the torch target does "
                                          r"not run recompute='selective'"):
        check_target(selective, "torch")
    tor = planner.make_plan(small_gpt, cluster, ParallelConfig(data=2, dtype="fp32"), global_batch_size=8,
                            target="torch")
    check_target(tor)
    check_target(tor, backend="gloo")
    with pytest.raises(TargetError, match="the torch target does not run on the mpi backend"):
        check_target(tor, backend="mpi")


def test_zero_with_a_fused_projection_split_by_parts_is_refused_for_torch_and_searched_around(small_gpt):
    """The example GPT's fused qkv splits by parts (rank r holds q_r, k_r, v_r), which fully_shard cannot
    shard further: the torch target refuses ZeRO >= 1 beside it, make_plan says so, and the search picks
    ZeRO 0 where the shape is pinned; meshplan's runtime runs it."""
    cluster = local_cluster(4)
    cfg = ParallelConfig(data=2, tensor=2, zero=3, dtype="fp32")
    with pytest.raises(TargetError, match=r"make_plan for d2 t2 .* z3 fp32: the torch target does not run ZeRO 3 "
                                          r"with module 'blocks.0.attn.qkv' split by parts over 2 tensor ranks: "
                                          r"FSDP2's fully_shard cannot shard .*; use zero=0, or write the fused "
                                          r"projection as separate Linears"):
        planner.make_plan(small_gpt, cluster, cfg, global_batch_size=8, target="torch")
    meshplan_plan = planner.make_plan(small_gpt, cluster, cfg, global_batch_size=8, target="meshplan")
    assert meshplan_plan.tensor_splits.part_splits()[0] == "blocks.0.attn.qkv"
    with pytest.raises(TargetError, match="split by parts"):
        check_target(meshplan_plan, "torch")
    assert TORCH_RUNTIME.why_not_splits(cfg.replace(zero=0), meshplan_plan.tensor_splits) is None
    assert MESHPLAN_RUNTIME.why_not_splits(cfg, meshplan_plan.tensor_splits) is None
    pinned = dict(data=2, tensor=2, pipeline=1, micro_batch_size=1, dtype="fp32")
    plan = planner.optimize(small_gpt, cluster, global_batch_size=8, progress=False, target="torch",
                            constraints=pinned)
    assert plan.config.zero == 0 and plan.tensor_splits.part_splits()
    with pytest.raises(planner.NoFeasiblePlan, match="split by parts"):
        planner.optimize(small_gpt, cluster, global_batch_size=8, progress=False, target="torch",
                         constraints={**pinned, "zero": 3})


# ---- the command line ----------------------------------------------------------------------------


def test_optimize_target_flag(tmp_path, capsys):
    out = tmp_path / "plan.json"
    base = ["optimize", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--cluster", "summit", "--nodes", "1",
            "--batch", "12", "--quiet", "-o", str(out)]
    assert main([*base, "--target", "torch"]) == 0
    assert "for the torch target" in capsys.readouterr().out
    plan = planner.Plan.load(out)
    assert plan.target == Target.TORCH and plan.config.dtype == "fp32"
    assert main([*base, "--force"]) == 0 and planner.Plan.load(out).target == Target.MESHPLAN
    capsys.readouterr()
    assert main([*base, "--force", "--target", "torch", "--what-if"]) == 2
    assert "drop --target torch or --what-if" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--target", "jax"])
    assert "invalid choice: 'jax'" in capsys.readouterr().err
