"""planner.evaluate on small models: breakdowns, monotonicity, exact memory, bad input."""

import dataclasses

import pytest
import torch

import planner
from cost_models.overlap import Overlap
from planner.evaluator import Evaluator
from cost_models.hardware import Cluster, Device, Link
from cost_models.prediction import Prediction
from examples.models import gpt, mlp
from planner import ConfigError, ParallelConfig
from planner.strategies.tensor.sharding import find_sharding


def _graph(mod=gpt, batch=4, **kw):
    kw = kw or dict(preset="tiny")
    with torch.device("meta"):
        model = mod.build(**kw)
    return planner.capture(model, mod.example_inputs(batch_size=batch, device="meta", **kw))


@pytest.fixture(scope="module")
def tiny():
    return _graph()


def _cpu_cluster(devices: int) -> Cluster:
    """A CPU cluster with fixed figures (no measurement), for exact-value tests."""
    dev = Device(name="cpu", peak_flops={"fp32": 50e9}, memory_bytes=8 * 2**30, memory_bandwidth=10e9,
                 active_watts=10.0, idle_watts=2.0, kind="cpu")
    link = Link(bandwidth=2e9, latency=20e-6)
    return Cluster(name="cpus", num_nodes=1, devices_per_node=devices, device=dev, intra_node=link, inter_node=link)


A100 = Cluster.preset("dgx-a100-80gb")  # 8 GPUs


def test_breakdowns_add_up(tiny):
    cfg = ParallelConfig(data=2, tensor=2, pipeline=2, micro_batch_size=2)
    pred = planner.evaluate(tiny, A100, cfg, global_batch_size=16, sharding="all")
    assert pred.step_time == pytest.approx(pred.time.total)
    assert pred.peak_memory == pytest.approx(pred.memory.total)
    assert pred.num_micro_batches == 4
    assert pred.time.bubble > 0 and pred.time.tensor_comm > 0 and pred.time.pipeline_comm > 0
    assert pred.samples_per_s == pytest.approx(16 / pred.step_time)
    assert pred.tokens_per_s == pytest.approx(pred.samples_per_s * gpt.make_config("tiny").seq_len)
    assert 0 < pred.mfu < 1 and pred.fits
    assert len(pred.stages) == 2 and pred.stages[0].first_layer == tiny.layers[0].name
    assert Prediction.from_dict(pred.to_dict()) == pred


def test_more_tensor_parallelism_never_increases_parameter_memory(tiny):
    for mode in ("all", "ilp"):
        mems = []
        for t in (1, 2, 4):
            cfg = ParallelConfig(data=8 // t, tensor=t)
            mems.append(planner.evaluate(tiny, A100, cfg, global_batch_size=16, sharding=mode).memory.parameters)
        assert mems[0] >= mems[1] >= mems[2]
        if mode == "all":
            assert mems[0] > mems[1] > mems[2]


def test_zero_and_recompute_trade_memory_for_time(tiny):
    base = ParallelConfig(data=8)
    # ZeRO as DeepSpeed shards it (meshplan's runtime keeps whole gradients and gathers a stage whole:
    # tests/unit/test_autocast_memory.py)
    preds = [planner.evaluate(tiny, A100, base.replace(zero=z), global_batch_size=16,
                              overlap=Overlap.preset("deepspeed")) for z in range(4)]
    totals = [p.peak_memory for p in preds]
    assert totals[0] > totals[1] > totals[2] > totals[3]
    assert preds[3].time.zero_comm > 0
    none = planner.evaluate(tiny, A100, base, global_batch_size=16)
    full = planner.evaluate(tiny, A100, base.replace(recompute="full"), global_batch_size=16)
    assert full.memory.activations < none.memory.activations
    assert full.step_time > none.step_time and full.time.recompute > 0


def test_schedules_memory_and_bubble(tiny):
    p = ParallelConfig(data=4, pipeline=2, micro_batch_size=1)
    gpipe = planner.evaluate(tiny, A100, p.replace(schedule="gpipe"), global_batch_size=32)
    f1b = planner.evaluate(tiny, A100, p, global_batch_size=32)
    inter = planner.evaluate(tiny, A100, p.replace(schedule="interleaved", virtual_stages=2), global_batch_size=32)
    assert gpipe.memory.activations > f1b.memory.activations
    assert inter.bubble_fraction < f1b.bubble_fraction
    assert inter.time.pipeline_comm > f1b.time.pipeline_comm  # v times the p2p traffic


def test_single_device_memory_equals_what_torch_holds():
    """Parameters, gradients and Adam state predicted for a tiny fp32 model equal the real bytes."""
    kw = dict(in_features=16, hidden=32, num_layers=3, out_features=10)
    torch.manual_seed(0)
    model = mlp.build(**kw)
    graph = planner.capture(model, mlp.example_inputs(batch_size=4, **kw))
    pred = planner.evaluate(graph, _cpu_cluster(1), ParallelConfig(dtype="fp32"), global_batch_size=4)
    opt = torch.optim.Adam(model.parameters())
    x, y = mlp.example_batch(4, seed=0, **kw)
    torch.nn.functional.cross_entropy(model(*x), y).backward()
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
                if k in ("exp_avg", "exp_avg_sq"))
    assert pred.memory.parameters == weights
    assert pred.memory.gradients == grads
    assert pred.memory.optimizer == state


def test_tensor_parallel_parameter_split_matches_megatron_layout(tiny):
    """t=2 holds half of every Megatron-split weight (embedding, qkv, proj, fc, lm_head) and all of the rest."""
    with torch.device("meta"):
        model = gpt.build(preset="tiny")
    split = ("wte.", ".attn.qkv.", ".attn.proj.weight", ".mlp.fc.", ".mlp.proj.weight", "lm_head.")
    expected = sum(p.numel() / 2 if any(s in "." + n for s in split) else p.numel()
                   for n, p in model.named_parameters())
    pred = planner.evaluate(tiny, A100, ParallelConfig(data=4, tensor=2, dtype="fp32"), global_batch_size=16,
                            sharding="all")
    assert pred.memory.parameters == pytest.approx(expected * 4)


def test_sharding_roles_for_gpt(tiny):
    roles = {n: r.role for n, r in find_sharding(tiny).roles.items()}
    assert roles["wte"] == "vocab" and roles["wpe"] == "replicate"
    assert roles["blocks_0_attn_qkv"] == "column" and roles["blocks_0_attn_proj"] == "row"
    assert roles["scaled_dot_product_attention"] == "inner"
    assert roles["blocks_1_mlp_fc"] == "column" and roles["blocks_1_mlp_proj"] == "row"
    assert roles["lm_head"] == "column_out" and roles["blocks_0_ln1"] == "replicate"


def test_module_and_example_inputs_are_accepted():
    with torch.device("meta"):
        model = mlp.build()
    pred = planner.evaluate(model, A100, ParallelConfig(data=8), global_batch_size=64,
                            example_inputs=mlp.example_inputs(batch_size=1, device="meta"))
    assert pred.tokens_per_s is None and pred.step_time > 0
    with pytest.raises(ValueError, match="pass example_inputs"):
        planner.evaluate(model, A100, ParallelConfig(data=8), global_batch_size=64)


@pytest.mark.parametrize("cfg,batch,needle", [
    (ParallelConfig(data=2, tensor=2), 16, r"data 2 x tensor 2 x pipeline 1 = 4 devices, but cluster .* has 8"),
    (ParallelConfig(tensor=8), 16, r"tensor degree 8 does not divide the .* = (4|16|96|128)"),
    (ParallelConfig(data=8, micro_batch_size=3), 16, "global batch 16 is not a multiple of micro_batch_size 3"),
    (ParallelConfig(pipeline=8), 16, "8 pipeline stages but the model has only 6 layers"),
])
def test_bad_configs_name_the_numbers(tiny, cfg, batch, needle):
    with pytest.raises(ConfigError, match=needle):
        planner.evaluate(tiny, A100, cfg, global_batch_size=batch)


def test_tensor_degree_that_does_not_divide_heads():
    g = _graph(preset="tiny", num_heads=4, hidden=48)  # 4 heads, hidden 48
    cl = Cluster.preset("dgx-a100-80gb", devices=3)
    with pytest.raises(ConfigError, match="tensor degree 3 does not divide .* = (4|128)"):
        planner.evaluate(g, cl, ParallelConfig(tensor=3), global_batch_size=4)


def test_dtype_the_device_lacks():
    g = _graph(mlp, batch=2, in_features=8, hidden=8, num_layers=2, out_features=4)
    with pytest.raises(ConfigError, match="bf16"):
        planner.evaluate(g, _cpu_cluster(1), ParallelConfig(), global_batch_size=2)


def test_stage_boundaries_by_name(tiny):
    names = [layer.name for layer in tiny.layers]
    cfg = ParallelConfig(data=4, pipeline=2, stage_boundaries=("blocks.1",))
    pred = planner.evaluate(tiny, A100, cfg, global_batch_size=8)
    assert pred.stages[1].first_layer == "blocks.1" and pred.stages[0].last_layer == names[names.index("blocks.1") - 1]
    with pytest.raises(ConfigError, match="'nope' is not a layer"):
        planner.evaluate(tiny, A100, dataclasses.replace(cfg, stage_boundaries=("nope",)), global_batch_size=8)


def test_conv_pairs_in_a_resnet_block():
    from examples.models import resnet

    g = _graph(resnet, batch=2, depth=20)
    roles = {n.module_path: r.role for n, r in ((g.node(k), v) for k, v in find_sharding(g).roles.items())
             if n.kind == "conv"}
    assert roles["stages.0.0.conv1"] == "column" and roles["stages.0.0.conv2"] == "row"
    assert roles["stem.0"] == "replicate"


def test_ilp_shards_big_layers_and_replicates_tiny_ones(tiny):
    """Comm-dominated tiny layers stay replicated; compute-dominated wide layers are split."""
    ev_small = Evaluator(tiny, A100)
    cfg = ParallelConfig(data=4, tensor=2)
    assert ev_small.node_roles(cfg) == {}
    wide = _graph(batch=8, preset="tiny", hidden=2048, num_heads=16, seq_len=512)
    roles = Evaluator(wide, A100).node_roles(cfg)
    assert roles["blocks_0_attn_qkv"] == "column" and roles["blocks_0_mlp_proj"] == "row"
    forced = planner.evaluate(tiny, A100, cfg, global_batch_size=16, sharding="all")
    chosen = planner.evaluate(tiny, A100, cfg, global_batch_size=16)
    assert chosen.step_time <= forced.step_time


def test_repeated_blocks_share_the_ilp_decision_but_keep_their_own_regions():
    """The decision cached for blocks.0 applies to blocks.1, blocks.2 ... by position, not by region id."""
    wide = _graph(batch=8, preset="tiny", hidden=2048, num_heads=16, seq_len=512)
    roles = Evaluator(wide, A100).node_roles(ParallelConfig(data=4, tensor=2))
    blocks = sorted({n.split("_")[1] for n in roles if n.startswith("blocks_")})
    assert len(blocks) == sum(1 for layer in wide.layers if layer.name.startswith("blocks")) >= 2
    for b in blocks:
        assert roles[f"blocks_{b}_attn_qkv"] == "column" and roles[f"blocks_{b}_mlp_proj"] == "row"
