"""Sequence parallelism (Megatron, Korthikanti et al. 2022, section 4.2.2): where the split stream lives
in a graph, what it costs (hand-computed on a fixed CPU cluster), what the search and the CLI offer,
how the plan stores it, and the refusals."""

import pytest

import planner
from cost_models.mesh_axes import axis_collective_time
from examples.models import resnet
from planner import ConfigError, ParallelConfig, Plan
from codegen.partition import partition
from planner.app.cli import build_parser
from planner.app.cli_args import check_constraints
from planner.evaluator import Evaluator
from planner.strategies.tensor.sharding import find_sharding
from planner.strategies.tensor.split.sequence import SequenceSplitError, sequence_stream
from runtime.parallel.tensor.layers import FeatureSplit, ModuleShard
from runtime.vocab import MeshAxis, ShardRole
from tests.unit.test_evaluate import _cpu_cluster, _graph
from tests.fixed_machine import local_cluster

# The tiny GPT captured at batch 4: (B, T, C) = (4, 16, 32) in fp32 is 8192 bytes per stream value.
STREAM_BYTES = 4 * 16 * 32 * 4
# _cpu_cluster's link: 2e9 B/s and 20 us. On 2 ranks a ring reduce-scatter or all-gather of N bytes
# takes one step: 20 us + (N / 2) / 2e9 s; a ring all-reduce takes two.
ONE_STEP = 20e-6 + STREAM_BYTES / 2 / 2e9


@pytest.fixture(scope="module")
def tiny():
    return _graph()


def _roles(graph) -> dict[str, str]:
    return {name: s.role for name, s in find_sharding(graph).roles.items() if s.sharded}


def _cfg(sp: bool, micro: int = 4) -> ParallelConfig:
    return ParallelConfig(tensor=2, micro_batch_size=micro, dtype="fp32", sequence_parallel=sp)


def test_the_split_stream_of_gpt(tiny):
    seq = sequence_stream(tiny, _roles(tiny), 2)
    assert seq.length == 16
    # the row projections and the vocabulary-parallel token embedding reduce-scatter their output
    assert seq.starts == ("wte", "blocks_0_attn_proj", "blocks_0_mlp_proj", "blocks_1_attn_proj", "blocks_1_mlp_proj")
    # between them: the position add, dropouts, residual adds and LayerNorms, up to the final norm
    assert seq.nodes == ("add", "drop", "blocks_0_ln1", "blocks_0_attn_resid_drop", "add_1", "blocks_0_ln2",
                         "blocks_0_mlp_drop", "add_2", "blocks_1_ln1", "blocks_1_attn_resid_drop", "add_3",
                         "blocks_1_ln2", "blocks_1_mlp_drop", "add_4", "ln_f")
    # every column op (the vocabulary head too) gathers its input; nothing else reads a split value
    assert seq.columns == ("blocks_0_attn_qkv", "blocks_0_mlp_fc", "blocks_1_attn_qkv", "blocks_1_mlp_fc", "lm_head")
    assert seq.gathers == ()
    # the position embeddings (T, C) meet the split tokens on their dimension 0
    assert seq.scatters == (("add", "wpe", 0),)
    assert seq.params == ("blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f")


def test_a_ring_all_reduce_moves_a_reduce_scatter_and_an_all_gather():
    cluster, mesh = _cpu_cluster(2), {MeshAxis.TENSOR: 2}

    def t(op):
        return axis_collective_time(cluster, mesh, MeshAxis.TENSOR, op, STREAM_BYTES).seconds
    assert t("reduce_scatter") == pytest.approx(ONE_STEP, rel=1e-12)
    assert t("all_gather") == pytest.approx(ONE_STEP, rel=1e-12)
    assert t("all_reduce") == pytest.approx(2 * ONE_STEP, rel=1e-12)


def test_collectives_of_a_region_become_reduce_scatters_and_all_gathers(tiny):
    ev = Evaluator(tiny, _cpu_cluster(2), sharding="all")
    qkv, proj = ev.node("blocks_0_attn_qkv"), ev.node("blocks_0_attn_proj")
    plain_col, sp_col = (ev.node_cost(qkv, ShardRole.COLUMN, _cfg(sp)) for sp in (False, True))
    plain_row, sp_row = (ev.node_cost(proj, ShardRole.ROW, _cfg(sp)) for sp in (False, True))
    # plain: the column op all-reduces its input's gradient, the row op its output
    assert (plain_col.on("tensor").forward, plain_col.on("tensor").backward) == (0.0, pytest.approx(2 * ONE_STEP, rel=1e-12))
    assert (plain_row.on("tensor").forward, plain_row.on("tensor").backward) == (pytest.approx(2 * ONE_STEP, rel=1e-12), 0.0)
    # SP: the column op all-gathers its input and reduce-scatters its gradient; the row op
    # reduce-scatters its output and all-gathers its gradient: the same bytes, split both ways.
    # The row op's bias (32 fp32 = 128 bytes), added after the reduce-scatter, meets this rank's tokens
    # only: its gradient is all-reduced too, 2 x 20 us + 128 / 2e9 s on 2 ranks; so are a LayerNorm's
    # weight and bias.
    bias = 2 * 20e-6 + 128 / 2e9
    assert (sp_col.on("tensor").forward, sp_col.on("tensor").backward) == (pytest.approx(ONE_STEP, rel=1e-12), pytest.approx(ONE_STEP, rel=1e-12))
    assert (sp_row.on("tensor").forward, sp_row.on("tensor").backward) == (pytest.approx(ONE_STEP, rel=1e-12),
                                              pytest.approx(ONE_STEP + bias, rel=1e-12))
    ln = ev.node_cost(ev.node("blocks_0_ln1"), "replicate", _cfg(True))
    assert (ln.on("tensor").forward, ln.on("tensor").backward) == (0.0, pytest.approx(2 * bias, rel=1e-12))
    block = tiny.layers[2]
    assert block.name == "blocks.0"
    plain, sp = ev.layer_cost(block, _cfg(False)), ev.layer_cost(block, _cfg(True))
    # 2 regions, each a gather in and a scatter out; 2 row biases and 2 LayerNorms' partial gradients
    assert sp.on("tensor").forward == pytest.approx(4 * ONE_STEP, rel=1e-12)
    assert sp.on("tensor").forward + sp.on("tensor").backward == pytest.approx(plain.on("tensor").forward + plain.on("tensor").backward + 6 * bias, rel=1e-12)


def test_replicated_ops_between_regions_do_a_tth_of_the_work(tiny):
    ev = Evaluator(tiny, _cpu_cluster(2), sharding="all")
    ln = ev.node("blocks_0_ln1")
    # LayerNorm of (4, 16, 32) fp32: reads 8192 bytes of tokens and 256 of weight and bias, writes 8192
    assert (ln.bytes_read, ln.bytes_written) == (STREAM_BYTES + 256, STREAM_BYTES)
    # on 8 of the 16 tokens it does the work of the whole sequence at half the batch (the weights whole)
    sp = ev.node_cost(ln, "replicate", _cfg(True, micro=4))
    half = ev.node_cost(ln, "replicate", _cfg(False, micro=2))
    whole = ev.node_cost(ln, "replicate", _cfg(False, micro=4))
    assert (sp.fwd, sp.bwd) == (half.fwd, half.bwd)
    assert sp.fwd < whole.fwd
    # its saved activations are the memory part's business: unchanged here
    assert sp.saved == whole.saved
    # a column op's own work is split by features, not again by the sequence
    qkv = ev.node("blocks_0_attn_qkv")
    assert ev.node_cost(qkv, ShardRole.COLUMN, _cfg(True)).fwd == ev.node_cost(qkv, ShardRole.COLUMN, _cfg(False)).fwd


def test_a_pipeline_cut_sends_a_tth_of_a_split_value(tiny):
    ev = Evaluator(tiny, _cpu_cluster(2), sharding="all")
    block = tiny.layers[2]
    assert ev.layer_cost(block, _cfg(False)).boundary == STREAM_BYTES
    assert ev.layer_cost(block, _cfg(True)).boundary == STREAM_BYTES / 2


def test_a_sequence_the_tensor_degree_does_not_divide_is_refused():
    graph = _graph(batch=2, preset="tiny", seq_len=6)
    cfg = ParallelConfig(tensor=4, micro_batch_size=2, dtype="fp32", sequence_parallel=True)
    with pytest.raises(ConfigError) as e:
        planner.evaluate(graph, _cpu_cluster(4), cfg, global_batch_size=2)
    assert str(e.value) == ("sequence parallelism splits the sequence of 6 tokens ('wte') over the tensor degree 4, "
                            "which does not divide it; choose a tensor degree that divides 6 or "
                            "sequence_parallel=False")


def test_values_that_are_not_batch_sequence_features_are_refused():
    graph = _graph(resnet, batch=2, depth=8, width=4, image_size=8)
    with pytest.raises(SequenceSplitError, match=r"sequence parallelism splits \(batch, sequence, features\) values, "
                                                 r"but the output of '.*' \(.*\) has shape \(2, 4, 8, 8\); use "
                                                 r"sequence_parallel=False for this model"):
        sequence_stream(graph, _roles(graph), 2)


def test_the_search_offers_both_and_a_constraint_pins_it(tiny):
    cluster = _cpu_cluster(2)
    kw = dict(global_batch_size=4, progress=False, sharding="all")
    pinned_on = planner.optimize(tiny, cluster, constraints={"tensor": 2, "sequence_parallel": True}, **kw)
    pinned_off = planner.optimize(tiny, cluster, constraints={"tensor": 2, "sequence_parallel": False}, **kw)
    assert pinned_on.config.sequence_parallel and not pinned_off.config.sequence_parallel
    free = planner.optimize(tiny, cluster, constraints={"tensor": 2}, **kw)
    cheaper = min((pinned_on, pinned_off), key=lambda p: p.prediction.step_time)
    assert free.config == cheaper.config


def test_the_plan_stores_the_sequence_split_and_it_round_trips(tiny, tmp_path):
    graph = _graph(batch=2)
    cfg = ParallelConfig(tensor=2, micro_batch_size=2, dtype="fp32", sequence_parallel=True)
    # every region is split under SP (the ILP, which replicates this tiny model's, is not asked)
    plan = planner.make_plan(graph, local_cluster(2), cfg, global_batch_size=4)
    splits = plan.tensor_splits
    assert splits.sequence == sequence_stream(graph, dict(plan.shardings), 2)
    modules = {m.path: m for m in splits.modules}
    assert modules["blocks.0.attn.proj"].sequence_dim == 1 and modules["wte"].sequence_dim == 1
    assert modules["blocks.0.attn.qkv"].sequence_dim == 1
    assert modules["ln_f"] == ModuleShard("ln_f", ShardRole.SEQUENCE, FeatureSplit((16,), 0))
    assert plan.format_version == 2
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    plain = planner.make_plan(graph, local_cluster(2),
                              cfg.replace(sequence_parallel=False), global_batch_size=4, sharding="all")
    assert "sequence" not in plain.tensor_splits.to_dict()
    assert all(m.sequence_dim is None for m in plain.tensor_splits.modules)


def test_the_constraint_and_the_codegen_flag():
    assert check_constraints({"sequence_parallel": True}) == {"sequence_parallel": True}
    with pytest.raises(ValueError, match="sequence_parallel takes True or False"):
        check_constraints({"sequence_parallel": "yes"})
    args = build_parser().parse_args(["codegen", "examples/models/gpt.py:build", "--tensor", "2",
                                      "--sequence-parallel", "--batch", "4"])
    assert args.sequence_parallel is True


def test_a_pipeline_stage_sends_its_block_of_the_sequence():
    graph = _graph(batch=2)
    cfg = ParallelConfig(pipeline=2, tensor=2, micro_batch_size=2, dtype="fp32", sequence_parallel=True)
    plan = planner.make_plan(graph, local_cluster(4), cfg, global_batch_size=4)
    first = partition(plan, graph).stages[0].spec
    # (B, T, C) = (2, 16, 32) at micro-batch 2: each tensor rank sends its 8 tokens to its peer
    assert [tuple(b.shape) for b in first.outputs] == [(2, 8, 32)]


def test_a_plan_whose_split_and_config_disagree_on_sp_is_refused(tmp_path):
    graph = _graph(batch=2)
    cfg = ParallelConfig(tensor=2, micro_batch_size=2, dtype="fp32", sequence_parallel=True)
    plan = planner.make_plan(graph, local_cluster(2), cfg, global_batch_size=4)
    doc = plan.to_dict()
    del doc["tensor_splits"]["sequence"]
    with pytest.raises(ValueError, match=r"the plan's tensor-parallel split is without sequence parallelism, its "
                                         r"config has sequence_parallel=True; make the plan again"):
        partition(Plan.from_dict(doc), graph)
