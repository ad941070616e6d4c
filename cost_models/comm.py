"""Alpha-beta communication model: what a collective over a group of ranks costs.

A link level is priced as ``alpha + n * beta`` for one message of ``n`` bytes, where
``alpha`` is the per-message latency (seconds) and ``beta`` the seconds per byte at
the bandwidth a collective library actually achieves (a fraction, the *efficiency*,
of the hardware :class:`~cost_models.hardware.Link` bandwidth).

The formulas of each collective on one link level (ring, tree, chain, ...) are
:mod:`cost_models.comm_formulas`; this module chooses among them for a group of ranks.

:func:`collective_time` prices an operation over concrete ranks of a
:class:`~cost_models.hardware.Cluster`: a group inside one node runs on the intra-node
link, a group spanning nodes is limited by the inter-node link, and an all-reduce
over a group that spans nodes with several members on each node may also run
hierarchically. It returns the cheapest algorithm as a :class:`CollectiveCost`.

:func:`axis_groups` and :func:`axis_collective_time` do the same for a named axis of a
device mesh (ranks laid out row-major, last axis innermost).

Units everywhere: bytes, seconds, bytes/s. Everything here is a pure function of its
arguments; results that depend only on the topology are cached, since the planner's
search calls these thousands of times.
"""

from __future__ import annotations

import difflib
import functools
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from cost_models.calibrated import fitted_collective, measured_collective
from cost_models.comm_formulas import (LinkModel, binomial_broadcast_time, chain_broadcast_time, check_bytes,
                                       checked_efficiency, hierarchical_all_reduce_time, p2p_time,
                                       pairwise_all_to_all_time, ring_all_gather_time, ring_all_reduce_time,
                                       ring_reduce_scatter_time, tree_all_reduce_time)
from cost_models.hardware import Cluster, Link
from runtime.vocab import Collective, DeviceKind

# --- achievable-bandwidth efficiencies ---------------------------------------------------

# GPU, intra-node (NVLink / NVSwitch): PUBLISHED.md quotes a measured H100 NVLink
# bandwidth of about 376-380 GB/s one way (NCCL issue #1264) against 450 GB/s nominal:
# 378 / 450 = 0.84. The same fraction is applied to the other NVLink generations
# (A100, V100), for which PUBLISHED.md has no measured figure.
GPU_INTRA_NODE_EFFICIENCY = 0.84

# GPU, inter-node (InfiniBand): ASSUMPTION, not measured here. NCCL over InfiniBand
# typically reaches about 90% of the line rate for large messages. Calibrate it against
# nccl-tests bus bandwidth on a real cluster.
GPU_INTER_NODE_EFFICIENCY = 0.90

# GPU, inter-node, by scale: NCCL's achieved bus bandwidth falls as a ring spans more nodes
# (each step's latency and the fabric's congestion add up). NVIDIA/nccl issue #1229 reports
# reduce-scatter bus bandwidth on H100 clusters of 4, 8, 16, 32, 64 and 128 nodes as 360, 345,
# 320, 300, 280 and 260 GB/s: a steady loss per doubling of the node count. Geometric fit over
# the whole range: (260 / 360) ** (1 / 5) = 0.937 per doubling past 4 nodes (it reproduces the
# middle points within 3%: 337, 316, 296, 277 GB/s); groups of up to 4 nodes keep
# GPU_INTER_NODE_EFFICIENCY, and larger groups are extrapolated at the same rate.
GPU_INTER_NODE_SCALE_BASE_NODES = 4
GPU_INTER_NODE_LOSS_PER_DOUBLING = (260 / 360) ** (1 / 5)

# CPU (the ``local`` preset): its link figures are measured loopback TCP rates, i.e.
# already what is achieved, so no further discount applies.
CPU_EFFICIENCY = 1.0

# device kind -> (intra-node efficiency, inter-node efficiency)
DEFAULT_EFFICIENCIES: Mapping[str, tuple[float, float]] = MappingProxyType({
    DeviceKind.GPU: (GPU_INTRA_NODE_EFFICIENCY, GPU_INTER_NODE_EFFICIENCY),
    DeviceKind.CPU: (CPU_EFFICIENCY, CPU_EFFICIENCY),
})

# --- operations and algorithms -----------------------------------------------------------

# op -> the algorithms that may run it, in order of preference when two cost the same
# (e.g. for a one-rank group or zero bytes, where every algorithm costs 0).
# "hierarchical" is only offered for all-reduce: in our runtime (as in NCCL) all-gather
# and reduce-scatter run as flat rings, so they are priced only as flat rings.
ALGORITHMS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    Collective.ALL_REDUCE: ("ring", "tree", "hierarchical"),
    Collective.ALL_GATHER: ("ring",),
    Collective.REDUCE_SCATTER: ("ring",),
    Collective.BROADCAST: ("chain", "binomial"),
    Collective.ALL_TO_ALL: ("pairwise",),
    Collective.P2P: ("direct",),
})
COLLECTIVE_OPS: tuple[str, ...] = tuple(op.value for op in ALGORITHMS)   # plain text: messages, documents

_EFFICIENCY_KEYS = ("intra", "inter")
_CACHE_SIZE = 1 << 16


# --- the price of a collective -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """The price of one collective.

    Attributes:
        op: the operation (one of :data:`COLLECTIVE_OPS`).
        seconds: its time in seconds.
        algorithm: the algorithm that gives that time (see :data:`ALGORITHMS`).
        group_size: number of ranks in the group.
        spans_nodes: whether the group spans more than one node.
    """

    op: str
    seconds: float
    algorithm: str
    group_size: int
    spans_nodes: bool


# --- link models for a cluster ----------------------------------------------------------------


def link_models(
    cluster: Cluster, efficiency: Mapping[str, float] | None = None
) -> tuple[LinkModel, LinkModel]:
    """``(intra, inter)`` link models of ``cluster``.

    Efficiencies default by ``cluster.device.kind`` (:data:`DEFAULT_EFFICIENCIES`);
    ``efficiency`` may override either or both: ``{"intra": 0.8, "inter": 0.85}``.
    Raises ValueError for an unknown key or an efficiency outside (0, 1].
    """
    intra_eff, inter_eff = _resolve_efficiency(cluster.device.kind, efficiency)
    return _link_models(cluster.intra_node, cluster.inter_node, intra_eff, inter_eff)


def _resolve_efficiency(
    kind: str, efficiency: Mapping[str, float] | None
) -> tuple[float, float]:
    try:
        intra_eff, inter_eff = DEFAULT_EFFICIENCIES[kind]
    except KeyError:
        known = ", ".join(DEFAULT_EFFICIENCIES)
        raise ValueError(
            f"no default link efficiency for device kind {kind!r} (known: {known}); "
            f"pass efficiency={{'intra': ..., 'inter': ...}}"
        ) from None
    if efficiency is not None:
        if not isinstance(efficiency, Mapping):
            raise ValueError(
                f"efficiency must be a mapping like {{'intra': 0.84, 'inter': 0.9}}, "
                f"got {efficiency!r}"
            )
        for key in efficiency:
            if key not in _EFFICIENCY_KEYS:
                raise ValueError(
                    f"unknown efficiency key {key!r}; known keys: {', '.join(_EFFICIENCY_KEYS)}"
                )
        intra_eff = efficiency.get("intra", intra_eff)
        inter_eff = efficiency.get("inter", inter_eff)
    return checked_efficiency(intra_eff), checked_efficiency(inter_eff)


@functools.lru_cache(maxsize=1024)
def inter_node_scale(kind: str, num_nodes: int) -> float:
    """Fraction of the inter-node link's achieved bandwidth left when a collective spans
    `num_nodes` nodes (1.0 up to GPU_INTER_NODE_SCALE_BASE_NODES; falling per doubling beyond,
    see GPU_INTER_NODE_LOSS_PER_DOUBLING). CPUs (measured loopback rates) keep 1.0."""
    if kind != DeviceKind.GPU or num_nodes <= GPU_INTER_NODE_SCALE_BASE_NODES:
        return 1.0
    return GPU_INTER_NODE_LOSS_PER_DOUBLING ** math.log2(num_nodes / GPU_INTER_NODE_SCALE_BASE_NODES)


def _scaled_links(cluster: Cluster, shape: "_GroupShape",
                  efficiency: Mapping[str, float] | None) -> tuple[LinkModel, LinkModel]:
    """The link models for a collective over a group of `shape`: the inter-node link slowed by
    the group's node count (inter_node_scale), unless the caller gave its own efficiencies
    (those describe the achieved rate already)."""
    intra, inter = link_models(cluster, efficiency)
    scale = inter_node_scale(cluster.device.kind, shape.num_nodes) if efficiency is None else 1.0
    if scale < 1.0:
        inter = LinkModel(alpha=inter.alpha, beta=inter.beta / scale)
    return intra, inter


def _link_models(
    intra: Link, inter: Link, intra_eff: float, inter_eff: float
) -> tuple[LinkModel, LinkModel]:
    return LinkModel.from_link(intra, intra_eff), LinkModel.from_link(inter, inter_eff)


# --- groups of ranks on a cluster ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _GroupShape:
    """What the price of a collective depends on about a group of ranks.

    ``per_node`` is the members on each node when every node the group touches holds
    the same number of them, else 0.
    """

    size: int
    num_nodes: int
    per_node: int

    @property
    def spans_nodes(self) -> bool:
        return self.num_nodes > 1


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _group_shape(devices_per_node: int, num_devices: int, ranks: tuple[int, ...]) -> _GroupShape:
    if not ranks:
        raise ValueError("a collective needs a group of at least one rank, got an empty group")
    counts: dict[int, int] = {}
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise ValueError(f"ranks must be integers, got {rank!r} in {list(ranks)}")
        if not 0 <= rank < num_devices:
            raise ValueError(
                f"rank {rank} is outside the cluster, whose ranks are 0..{num_devices - 1}"
            )
        node = int(rank) // devices_per_node
        counts[node] = counts.get(node, 0) + 1
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"a group must not repeat a rank, got {list(ranks)}")
    sizes = set(counts.values())
    per_node = sizes.pop() if len(sizes) == 1 else 0
    return _GroupShape(size=len(ranks), num_nodes=len(counts), per_node=per_node)


def _check_op(op: Any) -> None:
    if op not in ALGORITHMS:
        close = difflib.get_close_matches(str(op), COLLECTIVE_OPS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown collective op {op!r}.{hint} Known ops: {', '.join(COLLECTIVE_OPS)}"
        )


def _candidates(
    op: str, nbytes: float, shape: _GroupShape, intra: LinkModel, inter: LinkModel
) -> list[tuple[str, float]]:
    """(algorithm, seconds) for every algorithm available to ``op`` on this group."""
    g = shape.size
    link = inter if shape.spans_nodes else intra
    if op == Collective.ALL_REDUCE:
        out = [
            ("ring", ring_all_reduce_time(link, nbytes, g)),
            ("tree", tree_all_reduce_time(link, nbytes, g)),
        ]
        if shape.spans_nodes and shape.per_node > 1:
            out.append((
                "hierarchical",
                hierarchical_all_reduce_time(intra, inter, nbytes, shape.per_node, shape.num_nodes),
            ))
        return out
    if op == Collective.ALL_GATHER:
        return [("ring", ring_all_gather_time(link, nbytes, g))]
    if op == Collective.REDUCE_SCATTER:
        return [("ring", ring_reduce_scatter_time(link, nbytes, g))]
    if op == Collective.BROADCAST:
        return [
            ("chain", chain_broadcast_time(link, nbytes, g)),
            ("binomial", binomial_broadcast_time(link, nbytes, g)),
        ]
    if op == Collective.ALL_TO_ALL:
        return [("pairwise", pairwise_all_to_all_time(link, nbytes, g))]
    # p2p
    if g > 2:
        raise ValueError(f"p2p is between 2 ranks, got a group of {g}")
    return [("direct", 0.0 if g == 1 else p2p_time(link, nbytes))]


def _cheapest(
    op: str, nbytes: float, shape: _GroupShape, intra: LinkModel, inter: LinkModel
) -> CollectiveCost:
    best_name, best_time = "", math.inf
    for name, seconds in _candidates(op, nbytes, shape, intra, inter):
        if seconds < best_time:  # strict: ties keep the earlier (preferred) algorithm
            best_name, best_time = name, seconds
    return CollectiveCost(op, best_time, best_name, shape.size, shape.spans_nodes)


def _as_tuple(ranks: Iterable[int]) -> tuple[int, ...]:
    return ranks if type(ranks) is tuple else tuple(ranks)


def collective_candidates(
    cluster: Cluster,
    op: str,
    nbytes: float,
    group_ranks: Iterable[int],
    *,
    efficiency: Mapping[str, float] | None = None,
) -> tuple[CollectiveCost, ...]:
    """Every algorithm available for ``op`` on ``group_ranks``, priced, in preference order.

    Same arguments as :func:`collective_time`, which returns the cheapest of these.
    """
    _check_op(op)
    check_bytes(nbytes)
    shape = _group_shape(cluster.devices_per_node, cluster.num_devices, _as_tuple(group_ranks))
    intra, inter = _scaled_links(cluster, shape, efficiency)
    return tuple(
        CollectiveCost(op, seconds, name, shape.size, shape.spans_nodes)
        for name, seconds in _candidates(op, nbytes, shape, intra, inter)
    )


def collective_time(
    cluster: Cluster,
    op: str,
    nbytes: float,
    group_ranks: Iterable[int],
    *,
    efficiency: Mapping[str, float] | None = None,
) -> CollectiveCost:
    """The cheapest way to run collective ``op`` over ``group_ranks`` of ``cluster``.

    Args:
        cluster: the cluster the ranks belong to (ranks are node-major).
        op: one of :data:`COLLECTIVE_OPS`: ``all_reduce``, ``all_gather``,
            ``reduce_scatter``, ``broadcast``, ``all_to_all``, ``p2p`` (a group of 2).
        nbytes: bytes per rank: the buffer reduced (all-reduce), the gathered output
            (all-gather), the input (reduce-scatter), the message (broadcast, p2p), what
            one rank sends in all (all-to-all).
        group_ranks: the ranks taking part (distinct, at least one).
        efficiency: optional ``{"intra": ..., "inter": ...}`` overriding the default
            achieved-bandwidth fractions (see :func:`link_models`).

    A group inside one node uses the intra-node link. A group that spans nodes runs its
    flat algorithms at the pace of the inter-node link (docs/STRATEGIES.md; conservative
    next to NCCL's node-aware rings). All-reduce over a group that spans nodes with the
    same number ``k > 1`` of members on every node may also run hierarchically
    (:func:`hierarchical_all_reduce_time`). Ties go to the first algorithm of
    :data:`ALGORITHMS` ``[op]``.

    Returns:
        The :class:`CollectiveCost` of the cheapest available algorithm (seconds).

    Raises:
        ValueError: unknown op (naming the known ones), empty group, repeated or
            out-of-range ranks, negative bytes, p2p over more than 2 ranks, bad efficiency.
    """
    _check_op(op)
    check_bytes(nbytes)
    shape = _group_shape(cluster.devices_per_node, cluster.num_devices, _as_tuple(group_ranks))
    measured = _measured(cluster, op, nbytes, shape, efficiency)
    if measured is not None:
        return measured
    intra, inter = _scaled_links(cluster, shape, efficiency)
    return _cheapest(op, nbytes, shape, intra, inter)


def _measured(cluster: Cluster, op: str, nbytes: float, shape: _GroupShape,
              efficiency: Mapping[str, float] | None) -> CollectiveCost | None:
    """The measured cost when a calibrated cluster measured `op` at this group size inside one
    node (cost_models/calibrated.py: its table interpolated, else its alpha-beta fit), else None
    (no efficiency override given)."""
    if shape.spans_nodes or shape.size < 2 or efficiency is not None:
        return None
    table = measured_collective(cluster, op, shape.size, nbytes) if nbytes else None
    if table is not None:
        return CollectiveCost(op, table, "measured", shape.size, False)
    fit = fitted_collective(cluster, op, shape.size)
    if fit is None:
        return None
    return CollectiveCost(op, fit[0] + fit[1] * nbytes if nbytes else 0.0, "measured", shape.size, False)


__all__ = [
    "ALGORITHMS",
    "COLLECTIVE_OPS",
    "CPU_EFFICIENCY",
    "DEFAULT_EFFICIENCIES",
    "GPU_INTER_NODE_EFFICIENCY",
    "GPU_INTER_NODE_LOSS_PER_DOUBLING",
    "GPU_INTER_NODE_SCALE_BASE_NODES",
    "GPU_INTRA_NODE_EFFICIENCY",
    "CollectiveCost",
    "collective_candidates",
    "collective_time",
    "inter_node_scale",
    "link_models",
]
