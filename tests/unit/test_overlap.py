"""cost_models/overlap.py: the exposure formulas on hand-computed cases, the presets, and the
Evaluator priced with each switch on a tiny GPT (cluster figures chosen so every number can be
worked out by hand)."""

import json

import pytest
import torch

import planner
from cost_models.comm import GPU_INTER_NODE_EFFICIENCY, collective_time
from cost_models.hardware import Cluster, Device, Link
from cost_models.overlap import (GPU_CONTENTION, DeviceWork, Overlap, OverlapPreset, bucketed_exposed,
                                 chunked_sync_exposed, p2p_exposed, prefetched_exposed, tp_exposed)
from examples.models import gpt
from planner import ParallelConfig
from planner.evaluator import Evaluator
from runtime.vocab import DType

MS = 1e-3


# --- the formulas ------------------------------------------------------------------------


def test_tp_overlap_is_bounded_by_the_gemm_time():
    # comm 3 ms under 2 ms of GEMMs, all of it overlappable: 2 ms hidden, 1 ms exposed
    assert tp_exposed(3 * MS, 2 * MS, 1.0, 0.0) == pytest.approx(1 * MS)
    # half overlappable: 1.5 ms hidden (below the 2 ms bound), 1.5 ms exposed
    assert tp_exposed(3 * MS, 2 * MS, 0.5, 0.0) == pytest.approx(1.5 * MS)
    # GEMMs longer than the comm: all hidden
    assert tp_exposed(1 * MS, 2 * MS, 1.0, 0.0) == 0.0
    # nothing overlapped: the whole comm, exactly
    assert tp_exposed(3 * MS, 2 * MS, 0.0, 0.0) == 3 * MS
    # contention 0.15: the 2 ms hidden still cost 0.3 ms -> 1.3 ms
    assert tp_exposed(3 * MS, 2 * MS, 1.0, 0.15) == pytest.approx(1.3 * MS)


def test_bucketed_sync_exposes_at_least_one_bucket():
    # 10 ms of sync, 1 ms buckets, under 4 ms of backward: 6 ms exposed
    assert bucketed_exposed(10 * MS, 1 * MS, 4 * MS, 0.0) == pytest.approx(6 * MS)
    # a long backward hides all but the last bucket
    assert bucketed_exposed(10 * MS, 1 * MS, 20 * MS, 0.0) == pytest.approx(1 * MS)
    # no window (after the flush): all of it
    assert bucketed_exposed(10 * MS, 1 * MS, 0.0, 0.0) == pytest.approx(10 * MS)
    # contention 0.1 on the 4 ms hidden: 6 + 0.4
    assert bucketed_exposed(10 * MS, 1 * MS, 4 * MS, 0.1) == pytest.approx(6.4 * MS)


def test_chunked_sync_hides_each_chunk_behind_the_later_chunks_passes():
    # One chunk: the bucketed formula (6 ms sync, 0.5 ms bucket, 4 ms backward -> 2 ms).
    assert chunked_sync_exposed([(4 * MS, 6 * MS, 0.5 * MS)], 1, 0.0) == pytest.approx(2 * MS)
    # Two chunks of 2 ms passes, 3 ms sync each, 2 passes per chunk in the last group:
    # chunk 1's last pass ends at 2, its sync runs 0..3; chunk 0's last pass is 4..6 (after
    # one more pass 2..4), its sync runs 4..7: exposed 7 - 6 = 1 ms. The device's backward of one
    # micro-batch (4 ms) alone would leave max(0.5, 6 - 4) = 2 ms.
    chunks = [(2 * MS, 3 * MS, 0.5 * MS), (2 * MS, 3 * MS, 0.5 * MS)]
    assert chunked_sync_exposed(chunks, 2, 0.0) == pytest.approx(1 * MS)
    # contention 0.5 on the 5 ms hidden: 1 + 2.5
    assert chunked_sync_exposed(chunks, 2, 0.5) == pytest.approx(3.5 * MS)


def test_prefetched_gathers_expose_the_first_layer_and_what_outlasts_the_previous_compute():
    # gathers 1, 1, 1 ms behind computes 0.5, 2 ms: 1 + (1 - 0.5) + 0 = 1.5 ms
    assert prefetched_exposed([1 * MS] * 3, [0.5 * MS, 2 * MS, 2 * MS], 0.0) == pytest.approx(1.5 * MS)
    assert prefetched_exposed([], [], 0.0) == 0.0


def test_p2p_send_exposes_what_outlasts_the_next_compute():
    assert p2p_exposed(3 * MS, 2 * MS, 0.0) == pytest.approx(1 * MS)
    assert p2p_exposed(1 * MS, 2 * MS, 0.0) == 0.0
    assert p2p_exposed(1 * MS, 2 * MS, 0.2) == pytest.approx(0.2 * MS)


def test_device_work_splits_params_by_chunk_highest_first():
    work = DeviceWork(layers=((10.0, 1.0, 2.0), (30.0, 1.0, 3.0), (60.0, 1.0, 4.0)), chunk_sizes=(1, 2))
    assert work.forward == 3.0
    # chunk 0 = layer 0 (10 params, 2 s), chunk 1 = layers 1-2 (90 params, 7 s); the last pass of
    # chunk 1 runs first; 200 parameters split 10:90
    assert work.chunks(200.0) == [(7.0, 180.0), (2.0, 20.0)]


# --- the presets -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OverlapPreset))
def test_presets_round_trip_through_json(name):
    ov = Overlap.preset(name)
    d = json.loads(json.dumps(ov.to_dict()))
    assert Overlap.from_dict(d) == ov
    assert d["grad_reduce_dtype"] is None or type(d["grad_reduce_dtype"]) is str


def test_presets_say_what_each_stack_overlaps():
    assert Overlap.preset("meshplan") == Overlap(tp_comm=0.0, grad_reduce=True, param_gather=False, p2p=False)
    old = Overlap.preset("megatron-2021")
    assert (old.tp_comm, old.grad_reduce, old.param_gather, old.grad_reduce_dtype) == (0.0, False, False, DType.FP32)
    mcore = Overlap.preset("megatron")
    assert (mcore.tp_comm, mcore.grad_reduce, mcore.param_gather, mcore.p2p) == (1.0, True, True, True)
    for name in ("deepspeed", "torchtitan"):
        ov = Overlap.preset(name)
        assert ov.param_gather and ov.grad_reduce and ov.tp_comm == 0.0
        assert ov.contention == GPU_CONTENTION


def test_bad_overlaps_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown overlap preset 'megatrn'.*megatron-2021"):
        Overlap.preset("megatrn")
    with pytest.raises(ValueError, match="tp_comm must be a number in"):
        Overlap(tp_comm=1.5)
    with pytest.raises(ValueError, match="p2p must be true or false"):
        Overlap(p2p="yes")
    with pytest.raises(ValueError, match="grad_reduce_dtype 'fp64'"):
        Overlap(grad_reduce_dtype="fp64")
    with pytest.raises(ValueError, match="unknown Overlap field"):
        Overlap.from_dict({"tp": 1.0})
    assert Overlap(grad_reduce_dtype="fp32").grad_reduce_dtype is DType.FP32


# --- the Evaluator with each switch ----------------------------------------------------------

ALPHA, BANDWIDTH = 20e-6, 2e9


@pytest.fixture(scope="module")
def tiny():
    with torch.device("meta"):
        model = gpt.build(preset="tiny")
    return planner.capture(model, gpt.example_inputs(batch_size=4, device="meta", preset="tiny"))


def _cluster(devices: int, flops: float = 50e9, memory_bandwidth: float = 10e9, nodes: int = 1) -> Cluster:
    """CPUs with fixed figures, one link for both levels (CPU links are priced at their full bandwidth)."""
    dev = Device(name="cpu", peak_flops={"fp32": flops, "fp16": flops, "bf16": flops}, memory_bytes=8 * 2**30,
                 memory_bandwidth=memory_bandwidth, active_watts=10.0, idle_watts=2.0, kind="cpu")
    link = Link(bandwidth=BANDWIDTH, latency=ALPHA)
    return Cluster(name="cpus", num_nodes=nodes, devices_per_node=devices // nodes, device=dev, intra_node=link,
                   inter_node=link)


def _params(ev, config):
    return [ev.layer_cost(layer, config).params for layer in ev.graph.layers]


def test_default_overlap_is_meshplans_and_the_old_switch_maps_onto_it(tiny):
    assert Evaluator(tiny, _cluster(2)).overlap == Overlap.preset("meshplan")
    assert Evaluator(tiny, _cluster(2), overlap_grad_reduce=False).overlap.grad_reduce is False
    ev = Evaluator(tiny, _cluster(2), overlap=Overlap.preset("megatron-2021"))
    assert ev.grad_reduce_bytes == 4


def test_fp32_gradients_after_the_flush_cost_the_whole_all_reduce(tiny):
    # data 2, one micro-batch: a ring all-reduce of P gradients over 2 ranks costs 2a + n/bandwidth.
    config = ParallelConfig(data=2, micro_batch_size=2, dtype="fp16")
    for preset, elem in (("megatron-2021", 4), ("meshplan", 2)):
        ev = Evaluator(tiny, _cluster(2), overlap=Overlap.preset(preset))
        total = sum(_params(ev, config))
        # the tiny GPT's gradients fit in one bucket, so meshplan's overlap hides none of them either
        assert ev.evaluate(config, 4).time.data_comm == pytest.approx(2 * ALPHA + total * elem / BANDWIDTH)


def test_tp_comm_under_slow_gemms_is_hidden_but_for_contention(tiny):
    config = ParallelConfig(tensor=2, micro_batch_size=4, dtype="fp32")
    slow = _cluster(2, flops=1e3)   # GEMMs of seconds: every all-reduce they feed fits under them
    raw = planner.evaluate(tiny, slow, config, global_batch_size=4, sharding="all").time.tensor_comm
    # The vocabulary-parallel embedding's all-reduce feeds no GEMM and stays exposed: its
    # 4 x 16 x 32 fp32 outputs (8192 bytes) in a ring over 2 ranks, 2a + n/bandwidth.
    embedding = 2 * ALPHA + 8192 / BANDWIDTH
    assert raw > embedding
    hidden = planner.evaluate(tiny, slow, config, global_batch_size=4, sharding="all",
                              overlap=Overlap(tp_comm=1.0)).time.tensor_comm
    assert hidden == pytest.approx(embedding)
    charged = planner.evaluate(tiny, slow, config, global_batch_size=4, sharding="all",
                               overlap=Overlap(tp_comm=1.0, contention=0.5)).time.tensor_comm
    assert charged == pytest.approx(embedding + 0.5 * (raw - embedding))


def test_zero3_prefetch_leaves_the_first_gather_of_each_pass_and_the_last_reduce(tiny):
    # ZeRO-3 over 2 ranks, one micro-batch, every op taking seconds: the forward exposes the first
    # layer's gather, the backward the last layer's, the reduce-scatters leave layer 0's. A ring
    # all-gather / reduce-scatter of n > 0 bytes over 2 ranks costs a + n/2/bandwidth.
    config = ParallelConfig(data=2, micro_batch_size=2, zero=3, dtype="fp32")
    slow = _cluster(2, flops=1e3, memory_bandwidth=1e3)
    ev = Evaluator(tiny, slow, overlap=Overlap(param_gather=True, grad_reduce=True))
    params = _params(ev, config)

    def one_pass(n):
        return ALPHA + n * 4 / 2 / BANDWIDTH if n else 0.0

    expected = one_pass(params[0]) + one_pass(params[-1]) + one_pass(params[0])
    assert ev.evaluate(config, 4).time.zero_comm == pytest.approx(expected)
    # without the overlap: two whole gathers and one whole reduce-scatter
    plain = Evaluator(tiny, slow, overlap=Overlap(grad_reduce=False))
    assert plain.evaluate(config, 4).time.zero_comm == pytest.approx(3 * one_pass(sum(params)))


def test_zero3_prefetch_bound_gathers_the_rest_of_a_layer_when_it_starts(tiny):
    # The same case with a prefetch bound of p parameters (DeepSpeed's stage3_prefetch_bucket_size):
    # each layer gathers min(n, p) ahead and the rest, one_pass(n) - one_pass(min(n, p)), exposed
    # in both passes. A bound above every layer changes nothing.
    config = ParallelConfig(data=2, micro_batch_size=2, zero=3, dtype="fp32")
    slow = _cluster(2, flops=1e3, memory_bandwidth=1e3)
    ev = Evaluator(tiny, slow, overlap=Overlap(param_gather=True, grad_reduce=True))
    params = _params(ev, config)
    whole = ev.evaluate(config, 4).time.zero_comm

    def one_pass(n):
        return ALPHA + n * 4 / 2 / BANDWIDTH if n else 0.0

    p = max(params) / 2
    bounded = Evaluator(tiny, slow, overlap=Overlap(param_gather=True, grad_reduce=True, prefetch_params=p))
    late = sum(one_pass(n) - one_pass(min(n, p)) for n in params)
    expected = one_pass(min(params[0], p)) + one_pass(min(params[-1], p)) + 2 * late + one_pass(params[0])
    assert bounded.evaluate(config, 4).time.zero_comm == pytest.approx(expected)
    assert expected > whole
    roomy = Evaluator(tiny, slow, overlap=Overlap(param_gather=True, grad_reduce=True, prefetch_params=1e18))
    assert roomy.evaluate(config, 4).time.zero_comm == pytest.approx(whole)
    assert Overlap.preset("deepspeed").prefetch_params == 5e7
    assert Overlap.from_dict(Overlap.preset("deepspeed").to_dict()) == Overlap.preset("deepspeed")
    with pytest.raises(ValueError, match="prefetch_params"):
        Overlap(prefetch_params=0)


def test_overlapped_sends_leave_the_fill_and_drain_hops(tiny):
    # pipeline 2, compute of seconds: each send hides under the next compute; the first
    # activation and the last gradient still cross the cut: 2 x (a + boundary/bandwidth).
    config = ParallelConfig(pipeline=2, micro_batch_size=2, dtype="fp32")
    ev = Evaluator(tiny, _cluster(2, flops=1e3, memory_bandwidth=1e3), overlap=Overlap(p2p=True))
    pred = ev.evaluate(config, 4)
    cut = next(layer for layer in tiny.layers if layer.name == pred.stages[0].last_layer)
    boundary = ev.layer_cost(cut, config).boundary
    assert pred.time.pipeline_comm == pytest.approx(2 * (ALPHA + boundary / BANDWIDTH))
    synchronous = Evaluator(tiny, _cluster(2, flops=1e3, memory_bandwidth=1e3)).evaluate(config, 4).time.pipeline_comm
    assert synchronous > pred.time.pipeline_comm


def test_gradient_sync_hides_behind_tensor_collectives_only_on_another_link():
    # data 2 x tensor 2, one micro-batch, gradients (~50 MB per rank) far longer than the backward.
    # On 2 nodes of 2 the tensor pairs stay in a node and the data pairs cross nodes: the sync
    # also runs during the tensor all-reduces. On 1 node of 4 both share the link and take turns.
    # Both levels have the same link, so every collective costs the same on both clusters and the
    # exposed sync differs by exactly the backward's tensor-parallel seconds.
    with torch.device("meta"):
        model = gpt.build(preset="tiny", hidden=1024)
    graph = planner.capture(model, gpt.example_inputs(batch_size=4, device="meta", preset="tiny", hidden=1024))
    config = ParallelConfig(data=2, tensor=2, micro_batch_size=2, dtype="fp32")
    fast = dict(flops=1e13, memory_bandwidth=1e12)
    apart = Evaluator(graph, _cluster(4, nodes=2, **fast), sharding="all")
    shared = Evaluator(graph, _cluster(4, nodes=1, **fast), sharding="all")
    tp_backward = sum(apart.layer_cost(layer, config).on("tensor").backward for layer in graph.layers)
    assert tp_backward > 0
    gap = shared.evaluate(config, 4).time.data_comm - apart.evaluate(config, 4).time.data_comm
    assert gap == pytest.approx(tp_backward)


# --- link efficiency by scale ----------------------------------------------------------------


def test_link_efficiency_falls_with_the_number_of_nodes():
    """Achieved algorithm bandwidth of an all-reduce with one rank per node, over the inter-node
    link's nominal rate: it falls with every doubling of the node count (the ring's latency grows
    as alpha * (g - 1), the tree's as alpha * log2 g) and stays below the NCCL efficiency."""
    for nbytes in (2**20, 64 * 2**20, 2**30):
        effs = []
        for nodes in (2, 4, 8, 16, 32, 64, 128, 256):
            cluster = Cluster.preset("dgx-a100-80gb", nodes=nodes)
            cost = collective_time(cluster, "all_reduce", nbytes, range(0, cluster.num_devices, 8))
            # ring and tree move at least ~2n bytes per rank: algbw = n / t, bus bandwidth 2n / t
            effs.append(2 * nbytes / cost.seconds / cluster.inter_node.bandwidth)
        assert all(a > b for a, b in zip(effs, effs[1:])), (nbytes, effs)
        assert max(effs) < 2 * GPU_INTER_NODE_EFFICIENCY


def test_search_bound_stays_below_the_step_when_sends_are_hidden(tiny):
    # The search prunes with a compute-only bound; where the stack hides pipeline sends it must
    # not count them (planner/strategies/pipeline/strategy.py lower_bound). On this cluster each send about
    # matches the compute it hides under, so a bound that charged them would exceed the step.
    from planner.search import _lower_bound

    ev = Evaluator(tiny, _cluster(2, flops=1e10, memory_bandwidth=1e10), overlap=Overlap(p2p=True))
    config = ParallelConfig(pipeline=2, micro_batch_size=1, dtype="fp32")
    assert _lower_bound(ev, config, 8, "time") <= ev.evaluate(config, 8).step_time


def test_inter_node_bandwidth_falls_per_doubling_as_nccl_1229_measured():
    """NVIDIA/nccl#1229: H100 reduce-scatter bus bandwidth 360 GB/s on 4 nodes and 260 GB/s on 128;
    the geometric fit gives each point in between within 3% of its published figure."""
    from cost_models.comm import inter_node_scale

    published = {4: 360, 8: 345, 16: 320, 32: 300, 64: 280, 128: 260}
    for nodes, gbps in published.items():
        assert 360 * inter_node_scale("gpu", nodes) == pytest.approx(gbps, rel=0.03), nodes
    assert inter_node_scale("gpu", 128) == pytest.approx(260 / 360)
    assert inter_node_scale("gpu", 2) == inter_node_scale("gpu", 4) == 1.0
    assert inter_node_scale("cpu", 4096) == 1.0


def test_a_reduce_scatter_over_many_nodes_runs_at_the_scaled_rate():
    # one rank per node over 128 DGX A100 nodes: beta / (260/360) on the inter link; 1 GiB
    from cost_models.comm import link_models
    from cost_models.comm_formulas import ring_reduce_scatter_time

    cluster = Cluster.preset("dgx-a100-80gb", nodes=128)
    _, inter = link_models(cluster)
    scaled = type(inter)(alpha=inter.alpha, beta=inter.beta * 360 / 260)
    cost = collective_time(cluster, "reduce_scatter", 2**30, range(0, cluster.num_devices, 8))
    assert cost.seconds == pytest.approx(ring_reduce_scatter_time(scaled, 2**30, 128))
    # a caller's own efficiencies describe the achieved rate already: no further scaling
    given = collective_time(cluster, "reduce_scatter", 2**30, range(0, cluster.num_devices, 8),
                            efficiency={"inter": 0.9})
    assert given.seconds == pytest.approx(ring_reduce_scatter_time(inter, 2**30, 128))


def test_cli_optimize_prices_the_named_stack(tmp_path, capsys):
    # every config costs no more where the stack hides more, so the best plan is no slower
    from planner import Plan
    from planner.app.cli import main

    times = {}
    for stack in ("megatron-2021", "megatron"):
        out = tmp_path / f"{stack}.json"
        assert main(["optimize", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--cluster", "dgx-a100-80gb",
                     "--nodes", "2", "--batch", "32", "--quiet", "--stack", stack, "-o", str(out)]) == 0
        times[stack] = Plan.load(out).prediction.step_time
    assert times["megatron"] <= times["megatron-2021"]
    with pytest.raises(SystemExit):
        main(["optimize", "examples/models/gpt.py:build", "--cluster", "dgx-a100-80gb", "--batch", "8",
              "--stack", "megatorn"])
    assert "invalid choice: 'megatorn'" in capsys.readouterr().err


def test_each_stack_names_its_selective_recompute():
    from cost_models.activations import SelectivePolicy
    from cost_models.overlap import stack_selective

    assert stack_selective("torchtitan") is SelectivePolicy.ALTERNATE_MATMULS
    assert {stack_selective(s) for s in OverlapPreset if s != "torchtitan"} == {SelectivePolicy.ATTENTION_CORE}
    with pytest.raises(ValueError):
        stack_selective("megatorn")
