"""The alpha-beta communication model: formulas, algorithm choice, mesh axes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cost_models import Cluster, Device, Link
from cost_models import comm, comm_formulas
from cost_models.comm import COLLECTIVE_OPS, CollectiveCost, collective_candidates, collective_time, link_models
from cost_models.comm_formulas import (
    LinkModel,
    binomial_broadcast_time,
    chain_broadcast_time,
    hierarchical_all_reduce_time,
    optimal_broadcast_chunks,
    p2p_time,
    pairwise_all_to_all_time,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
    tree_all_reduce_time,
)
from cost_models.mesh_axes import axis_collective_time, axis_groups
from runtime.vocab import default_mesh_order
from runtime.vocab import MeshAxis

GB = 1e9

# Hand-computed link figures (hardware.py presets x the default efficiencies).
# DGX H100 NVLink: 450e9 B/s x 0.84 = 378e9 B/s, 3 us.
H100_NVLINK = (3e-6, 1 / 378e9)
# DGX A100 NVLink: 300e9 B/s x 0.84 = 252e9 B/s, 3 us.
A100_NVLINK = (3e-6, 1 / 252e9)
# DGX A100 HDR InfiniBand: 25e9 B/s per GPU x 0.90 = 22.5e9 B/s, 6 us.
A100_IB = (6e-6, 1 / 22.5e9)


@pytest.fixture(scope="module")
def h100():
    return Cluster.preset("dgx-h100")


@pytest.fixture(scope="module")
def a100x2():
    return Cluster.preset("dgx-a100-80gb", nodes=2)


def cpu_cluster(devices: int = 4) -> Cluster:
    return Cluster(
        name="cpu-test",
        num_nodes=1,
        devices_per_node=devices,
        device=Device(
            name="cpu",
            kind="cpu",
            peak_flops={"fp32": 1e11},
            memory_bytes=2**33,
            memory_bandwidth=1e10,
            active_watts=10.0,
            idle_watts=2.0,
        ),
        intra_node=Link(bandwidth=5e9, latency=2e-5),
        inter_node=Link(bandwidth=5e9, latency=2e-5),
    )


# --- link models ----------------------------------------------------------------------


def test_link_model_from_link():
    model = LinkModel.from_link(Link(bandwidth=100e9, latency=5e-6), 0.5)
    assert model.alpha == 5e-6
    assert model.beta == pytest.approx(1 / 50e9, rel=1e-15)
    assert model.bandwidth == pytest.approx(50e9)


@pytest.mark.parametrize("eff", [0, -0.1, 1.5, math.nan, True, "0.9"])
def test_link_model_rejects_bad_efficiency(eff):
    with pytest.raises(ValueError, match="efficiency"):
        LinkModel.from_link(Link(bandwidth=1e9, latency=1e-6), eff)


def test_link_model_is_frozen_and_validated():
    model = LinkModel(alpha=1e-6, beta=1e-9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.alpha = 2.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="beta"):
        LinkModel(alpha=1e-6, beta=0.0)
    with pytest.raises(ValueError, match="alpha"):
        LinkModel(alpha=-1.0, beta=1e-9)


def test_gpu_default_efficiencies(a100x2):
    intra, inter = link_models(a100x2)
    assert (intra.alpha, intra.beta) == pytest.approx(A100_NVLINK, rel=1e-12)
    assert (inter.alpha, inter.beta) == pytest.approx(A100_IB, rel=1e-12)
    assert comm.GPU_INTRA_NODE_EFFICIENCY == pytest.approx(378 / 450)


def test_cpu_efficiency_is_one():
    intra, inter = link_models(cpu_cluster())
    assert intra.beta == pytest.approx(1 / 5e9) and inter.beta == pytest.approx(1 / 5e9)
    assert intra.alpha == 2e-5


def test_efficiency_override(a100x2):
    intra, inter = link_models(a100x2, {"inter": 0.5})
    assert intra.beta == pytest.approx(A100_NVLINK[1])
    assert inter.beta == pytest.approx(1 / 12.5e9)
    intra, _ = link_models(a100x2, {"intra": 1.0, "inter": 1.0})
    assert intra.beta == pytest.approx(1 / 300e9)
    with pytest.raises(ValueError, match="unknown efficiency key 'intre'"):
        link_models(a100x2, {"intre": 0.5})
    with pytest.raises(ValueError, match="efficiency"):
        link_models(a100x2, {"inter": 2.0})
    cost = collective_time(a100x2, "p2p", GB, [0, 8], efficiency={"inter": 0.5})
    assert cost.seconds == pytest.approx(6e-6 + GB / 12.5e9)


# --- formulas on one link level ---------------------------------------------------------


def test_ring_all_reduce_8_ranks_1gb_nvlink(h100):
    alpha, beta = H100_NVLINK
    expected = 2 * 7 * alpha + 2 * 7 / 8 * GB * beta  # = 4.6716 ms
    assert expected == pytest.approx(4.6716e-3, rel=1e-4)
    intra, _ = link_models(h100)
    assert ring_all_reduce_time(intra, GB, 8) == pytest.approx(expected, rel=1e-12)
    cost = collective_time(h100, "all_reduce", GB, range(8))
    seconds = pytest.approx(expected, rel=1e-12)
    expected_cost = CollectiveCost("all_reduce", seconds, "ring", 8, False)
    assert cost == expected_cost


def test_tree_ring_crossover(h100):
    # 8 ranks in one node: ring 14a + 1.75 n b, tree 6a + 2 n b; equal at n = 32 a / b.
    alpha, beta = H100_NVLINK
    crossover = 32 * alpha / beta  # 36.288 MB
    assert crossover == pytest.approx(36.288e6)
    intra, _ = link_models(h100)
    assert tree_all_reduce_time(intra, crossover, 8) == pytest.approx(
        ring_all_reduce_time(intra, crossover, 8), rel=1e-12
    )
    assert tree_all_reduce_time(intra, 1024, 8) == pytest.approx(6 * alpha + 2 * 1024 * beta)
    small = collective_time(h100, "all_reduce", crossover / 2, range(8))
    large = collective_time(h100, "all_reduce", crossover * 2, range(8))
    assert small.algorithm == "tree" and large.algorithm == "ring"
    assert small.seconds == pytest.approx(6 * alpha + 2 * (crossover / 2) * beta)
    assert collective_time(h100, "all_reduce", 8, range(8)).algorithm == "tree"


def test_tree_uses_ceil_log2():
    link = LinkModel(alpha=1.0, beta=1e-30)
    for g, levels in [(2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (16, 4)]:
        assert tree_all_reduce_time(link, 1, g) == pytest.approx(2 * levels)
        assert binomial_broadcast_time(link, 1, g) == pytest.approx(levels)


@pytest.mark.parametrize(
    "alpha,beta,nbytes,g",
    [
        (3e-6, 1 / 378e9, 1e9, 8),
        (3e-6, 1 / 378e9, 4096, 8),
        (6e-6, 1 / 22.5e9, 1e8, 16),
        (1e-5, 1e-9, 1e6, 3),
        (1e-3, 1e-9, 10, 64),
        (2e-5, 2e-10, 123_457, 5),
    ],
)
def test_broadcast_chunks_match_brute_force(alpha, beta, nbytes, g):
    link = LinkModel(alpha=alpha, beta=beta)
    chosen = optimal_broadcast_chunks(link, nbytes, g)
    c_star = math.sqrt((g - 2) * nbytes * beta / alpha)
    upper = int(min(nbytes, max(50, 4 * c_star)))
    times = {c: (g - 2 + c) * (alpha + nbytes * beta / c) for c in range(1, upper + 1)}
    best = min(times.values())
    assert times[chosen] == pytest.approx(best, rel=1e-12)
    assert abs(chosen - c_star) <= 1 or chosen == 1
    assert chain_broadcast_time(link, nbytes, g) == pytest.approx(best, rel=1e-12)
    assert chain_broadcast_time(link, nbytes, g, chunks=1) == pytest.approx(times[1])


def test_broadcast_picks_cheaper_of_chain_and_binomial(h100):
    intra, _ = link_models(h100)
    big = collective_time(h100, "broadcast", GB, range(8))
    assert big.algorithm == "chain"  # ~ n*b, against log2(8) * n*b for the tree
    assert big.seconds == pytest.approx(chain_broadcast_time(intra, GB, 8))
    tiny = collective_time(h100, "broadcast", 1, range(8))
    assert tiny.algorithm == "binomial"  # 3 latencies against 7
    assert tiny.seconds == pytest.approx(3 * (3e-6 + 1 / 378e9))
    assert comm_formulas.broadcast_time(intra, 1, 8) == pytest.approx(tiny.seconds)


def test_broadcast_two_ranks_is_p2p():
    link = LinkModel(alpha=1e-5, beta=1e-9)
    assert optimal_broadcast_chunks(link, 1e6, 2) == 1
    assert chain_broadcast_time(link, 1e6, 2) == pytest.approx(p2p_time(link, 1e6))


def test_all_gather_reduce_scatter_all_to_all_formula(a100x2):
    alpha, beta = A100_NVLINK
    intra, _ = link_models(a100x2)
    n, g = 3.5e8, 4
    expected = (g - 1) * alpha + (g - 1) / g * n * beta
    assert ring_all_gather_time(intra, n, g) == pytest.approx(expected, rel=1e-12)
    assert ring_reduce_scatter_time(intra, n, g) == pytest.approx(expected, rel=1e-12)
    assert pairwise_all_to_all_time(intra, n, g) == pytest.approx(expected, rel=1e-12)
    for op, algorithm in [("all_gather", "ring"), ("reduce_scatter", "ring"),
                          ("all_to_all", "pairwise")]:
        cost = collective_time(a100x2, op, n, [0, 1, 2, 3])
        assert (cost.algorithm, cost.group_size, cost.spans_nodes) == (algorithm, 4, False)
        assert cost.seconds == pytest.approx(expected, rel=1e-12)
    # Across nodes the flat ring runs on InfiniBand.
    ib_alpha, ib_beta = A100_IB
    cost = collective_time(a100x2, "all_gather", n, [0, 8])
    assert cost.spans_nodes and cost.seconds == pytest.approx(ib_alpha + n / 2 * ib_beta)


def test_p2p(a100x2):
    assert collective_time(a100x2, "p2p", GB, [0, 1]).seconds == pytest.approx(3e-6 + GB / 252e9)
    cross = collective_time(a100x2, "p2p", GB, (7, 8))
    assert cross == CollectiveCost("p2p", pytest.approx(6e-6 + GB / 22.5e9), "direct", 2, True)


# --- trivial cases ------------------------------------------------------------------------


@pytest.mark.parametrize("op", COLLECTIVE_OPS)
def test_single_rank_and_zero_bytes_cost_nothing(a100x2, op):
    cost = collective_time(a100x2, op, GB, [5])
    assert cost.seconds == 0.0 and cost.group_size == 1 and not cost.spans_nodes
    assert cost.algorithm == comm.ALGORITHMS[op][0]
    group = [0, 8] if op == "p2p" else list(range(16))
    assert collective_time(a100x2, op, 0, group).seconds == 0.0


def test_formulas_zero_for_g1_and_n0():
    link = LinkModel(alpha=1e-5, beta=1e-9)
    fns = [ring_all_reduce_time, tree_all_reduce_time, ring_all_gather_time,
           ring_reduce_scatter_time, chain_broadcast_time, binomial_broadcast_time,
           pairwise_all_to_all_time]
    for fn in fns:
        assert fn(link, 1e6, 1) == 0.0
        assert fn(link, 0, 8) == 0.0
    assert p2p_time(link, 0) == 0.0
    assert hierarchical_all_reduce_time(link, link, 0, 8, 2) == 0.0


# --- hierarchical all-reduce ---------------------------------------------------------------


def test_hierarchical_all_reduce_over_two_dgx_nodes(a100x2):
    n = GB
    a, b = A100_NVLINK
    ia, ib = A100_IB
    reduce_scatter = 7 * a + 7 / 8 * n * b
    across = min(2 * 1 * ia + 2 * 1 / 2 * (n / 8) * ib, 2 * 1 * ia + 2 * (n / 8) * ib)
    all_gather = 7 * a + 7 / 8 * n * b
    expected = reduce_scatter + across + all_gather  # ~12.55 ms
    assert expected == pytest.approx(12.554e-3, rel=1e-3)

    cost = collective_time(a100x2, "all_reduce", n, range(16))
    assert cost.algorithm == "hierarchical"
    assert cost.group_size == 16 and cost.spans_nodes
    assert cost.seconds == pytest.approx(expected, rel=1e-12)

    candidates = collective_candidates(a100x2, "all_reduce", n, range(16))
    flat = {c.algorithm: c.seconds for c in candidates}
    assert set(flat) == {"ring", "tree", "hierarchical"}
    assert flat["ring"] == pytest.approx(30 * ia + 2 * 15 / 16 * n * ib)
    assert flat["hierarchical"] < flat["ring"]


def test_hierarchical_only_for_all_reduce(a100x2):
    for op in ("all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        names = {c.algorithm for c in collective_candidates(a100x2, op, GB, range(16))}
        assert "hierarchical" not in names


def test_hierarchical_needs_equal_members_per_node(a100x2):
    names = {c.algorithm for c in collective_candidates(a100x2, "all_reduce", GB, [0, 1, 2, 8])}
    assert names == {"ring", "tree"}
    names = {c.algorithm for c in collective_candidates(a100x2, "all_reduce", GB, [0, 1, 8, 9])}
    assert "hierarchical" in names


def test_flat_ring_for_data_axis_with_one_member_per_node(a100x2):
    mesh = {"data": 2, "tensor": 8}
    cost = axis_collective_time(a100x2, mesh, "data", "all_reduce", GB)
    ia, ib = A100_IB
    assert cost.algorithm == "ring"
    assert cost.spans_nodes and cost.group_size == 2
    assert cost.seconds == pytest.approx(2 * ia + GB * ib, rel=1e-12)
    names = {c.algorithm for c in collective_candidates(a100x2, "all_reduce", GB, [3, 11])}
    assert names == {"ring", "tree"}


# --- mesh axes ----------------------------------------------------------------------------


def test_axis_groups_examples():
    mesh = {MeshAxis.PIPELINE: 2, "data": 2, "tensor": 2}
    assert axis_groups(mesh, "tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(mesh, "data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(mesh, MeshAxis.PIPELINE) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_axis_groups_partition_the_ranks_for_any_axis_names():
    mesh = {"subgraph": 2, MeshAxis.PIPELINE: 3, "spatial": 2, "data": 1, "tensor": 2}
    for axis, size in mesh.items():
        groups = axis_groups(mesh, axis)
        assert len(groups) == 24 // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(24))
    assert axis_groups(mesh, "data") == [[r] for r in range(24)]
    assert axis_groups(mesh, "subgraph")[0] == [0, 12]


def test_axis_groups_result_is_a_fresh_copy():
    mesh = {"data": 2, "tensor": 2}
    axis_groups(mesh, "tensor")[0].append(99)
    assert axis_groups(mesh, "tensor") == [[0, 1], [2, 3]]


def test_default_mesh_order():
    assert default_mesh_order() == (MeshAxis.PIPELINE, "data", "tensor")
    mesh = dict(zip(default_mesh_order(), (2, 2, 2)))
    assert axis_groups(mesh, "tensor")[0] == [0, 1]


def test_tensor_axis_stays_in_node_data_axis_spans(a100x2):
    mesh = {MeshAxis.PIPELINE: 1, "data": 2, "tensor": 8}
    tensor = axis_collective_time(a100x2, mesh, "tensor", "all_reduce", 64e6)
    data = axis_collective_time(a100x2, mesh, "data", "all_reduce", 64e6)
    assert not tensor.spans_nodes and tensor.group_size == 8
    assert data.spans_nodes and data.group_size == 2
    in_node = collective_time(a100x2, "all_reduce", 64e6, range(8))
    assert tensor.seconds == pytest.approx(in_node.seconds)
    # Swapping the order puts the tensor axis across nodes.
    swapped = axis_collective_time(a100x2, {"tensor": 8, "data": 2}, "tensor", "all_reduce", 64e6)
    assert swapped.spans_nodes and swapped.seconds > tensor.seconds


def test_axis_cost_is_the_slowest_group():
    # Summit: 6 GPUs per node. Tensor groups of 4: [0-3] and [8-11] inside a node,
    # [4, 5 | 6, 7] across the two nodes.
    summit = Cluster.preset("summit", nodes=2)
    mesh = {"data": 3, "tensor": 4}
    cost = axis_collective_time(summit, mesh, "tensor", "all_reduce", 1e8)
    crossing = collective_time(summit, "all_reduce", 1e8, [4, 5, 6, 7])
    inside = collective_time(summit, "all_reduce", 1e8, [0, 1, 2, 3])
    assert cost.spans_nodes and crossing.spans_nodes and not inside.spans_nodes
    assert cost.seconds == pytest.approx(crossing.seconds) and cost.seconds > inside.seconds


def test_axis_p2p_is_slowest_neighbour_pair(a100x2):
    ia, ib = A100_IB
    cost = axis_collective_time(a100x2, {MeshAxis.PIPELINE: 4, "tensor": 4}, MeshAxis.PIPELINE, "p2p", 1e7)
    # pipe group [0, 4, 8, 12]: 4 -> 8 crosses nodes.
    assert cost.group_size == 2 and cost.spans_nodes
    assert cost.seconds == pytest.approx(ia + 1e7 * ib)
    inside = axis_collective_time(a100x2, {"tensor": 2, MeshAxis.PIPELINE: 8}, MeshAxis.PIPELINE, "p2p", 1e7)
    assert not inside.spans_nodes
    one = axis_collective_time(a100x2, {MeshAxis.PIPELINE: 1, "data": 16}, MeshAxis.PIPELINE, "p2p", 1e7)
    assert one.seconds == 0.0


def test_axis_collective_matches_every_op(a100x2):
    mesh = {MeshAxis.PIPELINE: 2, "data": 2, "tensor": 4}
    for op in COLLECTIVE_OPS:
        if op == "p2p":
            continue
        for axis in mesh:
            worst = max(
                (collective_time(a100x2, op, 1e7, g) for g in axis_groups(mesh, axis)),
                key=lambda c: c.seconds,
            )
            got = axis_collective_time(a100x2, mesh, axis, op, 1e7)
            assert got.seconds == pytest.approx(worst.seconds)
            assert got.spans_nodes == worst.spans_nodes


# --- monotonicity ------------------------------------------------------------------------


@pytest.mark.parametrize("op", COLLECTIVE_OPS)
@pytest.mark.parametrize("group", [list(range(8)), list(range(16)), [0, 8], [0, 1, 2, 8]])
def test_time_non_decreasing_in_bytes(a100x2, op, group):
    if op == "p2p":
        group = group[:2]
    sizes = [0] + [2.0**k for k in range(0, 41)]
    sizes += [36.288e6 * f for f in (0.9, 0.99, 1.0, 1.01, 1.1)]
    times = [collective_time(a100x2, op, n, group).seconds for n in sorted(sizes)]
    assert all(t1 <= t2 * (1 + 1e-12) for t1, t2 in zip(times, times[1:]))


def test_ring_bandwidth_term_non_decreasing_in_group_size(a100x2):
    bandwidth_only = LinkModel(alpha=0.0, beta=1e-9)
    terms = [ring_all_reduce_time(bandwidth_only, GB, g) for g in range(1, 65)]
    assert all(t1 <= t2 for t1, t2 in zip(terms, terms[1:]))
    assert terms[-1] < 2 * GB * 1e-9
    inside = [collective_time(a100x2, "all_reduce", GB, range(g)).seconds for g in range(1, 9)]
    assert all(t1 <= t2 for t1, t2 in zip(inside, inside[1:]))


# --- errors -------------------------------------------------------------------------------


def test_unknown_op_names_it_and_the_known_ones(a100x2):
    with pytest.raises(ValueError, match="allreduce") as info:
        collective_time(a100x2, "allreduce", GB, [0, 1])
    for op in COLLECTIVE_OPS:
        assert op in str(info.value)
    with pytest.raises(ValueError, match="gather_all"):
        axis_collective_time(a100x2, {"data": 16}, "data", "gather_all", GB)


def test_bad_groups_and_bytes(a100x2):
    with pytest.raises(ValueError, match="empty"):
        collective_time(a100x2, "all_reduce", GB, [])
    with pytest.raises(ValueError, match="nbytes"):
        collective_time(a100x2, "all_reduce", -1, [0, 1])
    with pytest.raises(ValueError, match="nbytes"):
        collective_time(a100x2, "all_reduce", math.inf, [0, 1])
    with pytest.raises(ValueError, match="rank 16"):
        collective_time(a100x2, "all_reduce", GB, [0, 16])
    with pytest.raises(ValueError, match="repeat"):
        collective_time(a100x2, "all_reduce", GB, [0, 1, 1])
    with pytest.raises(ValueError, match="p2p"):
        collective_time(a100x2, "p2p", GB, [0, 1, 2])
    with pytest.raises(ValueError, match="nbytes"):
        ring_all_reduce_time(LinkModel(1e-6, 1e-9), -5, 4)
    with pytest.raises(ValueError, match="group size"):
        ring_all_reduce_time(LinkModel(1e-6, 1e-9), 5, 0)
    with pytest.raises(ValueError, match="chunks"):
        chain_broadcast_time(LinkModel(1e-6, 1e-9), 5, 4, chunks=0)


def test_mesh_errors(a100x2):
    with pytest.raises(ValueError, match=r"8 ranks.*16 devices"):
        axis_collective_time(a100x2, {"data": 2, "tensor": 4}, "data", "all_reduce", GB)
    with pytest.raises(ValueError, match="unknown mesh axis 'expert'"):
        axis_collective_time(a100x2, {"data": 2, "tensor": 8}, "expert", "all_reduce", GB)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        axis_groups({"data": 2}, "tensor")
    with pytest.raises(ValueError, match="size"):
        axis_groups({"data": 0, "tensor": 2}, "tensor")


def test_collective_cost_is_frozen(a100x2):
    cost = collective_time(a100x2, "all_reduce", GB, range(16))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.seconds = 0.0  # type: ignore[misc]
