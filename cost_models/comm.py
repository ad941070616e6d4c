"""Alpha-beta communication model: what a collective over a group of ranks costs.

A link level is priced as ``alpha + n * beta`` for one message of ``n`` bytes, where
``alpha`` is the per-message latency (seconds) and ``beta`` the seconds per byte at
the bandwidth a collective library actually achieves (a fraction, the *efficiency*,
of the hardware :class:`~cost_models.hardware.Link` bandwidth).

Collective formulas (docs/STRATEGIES.md, "Communication cost"), for ``n`` bytes over ``g``
ranks on one :class:`LinkModel`:

==========================  ================================================
p2p (direct)                ``alpha + n*beta``
all-reduce, ring            ``2(g-1)*alpha + 2(g-1)/g * n*beta``
all-reduce, tree            ``2*ceil(log2 g)*alpha + 2*n*beta``
all-gather, ring            ``(g-1)*alpha + (g-1)/g * n*beta``  (n = gathered output)
reduce-scatter, ring        ``(g-1)*alpha + (g-1)/g * n*beta``  (n = input)
broadcast, chain            ``(g-2+c)*(alpha + n*beta/c)``, ``c`` chunks, best ``c``
broadcast, binomial         ``ceil(log2 g)*(alpha + n*beta)``
all-to-all, pairwise        ``(g-1)*alpha + (g-1)/g * n*beta``  (n = what one rank sends)
==========================  ================================================

A group of one rank, or zero bytes, costs 0 for every collective.

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
from cost_models.hardware import Cluster, Link
from runtime.vocab import Collective

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
    "gpu": (GPU_INTRA_NODE_EFFICIENCY, GPU_INTER_NODE_EFFICIENCY),
    "cpu": (CPU_EFFICIENCY, CPU_EFFICIENCY),
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


# --- small value types --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkModel:
    """One link level as the alpha-beta model sees it.

    Attributes:
        alpha: seconds of fixed cost per message (latency).
        beta: seconds per byte at the achieved bandwidth (1 / bytes/s).
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        for field, value, allow_zero in (("alpha", self.alpha, True), ("beta", self.beta, False)):
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value < 0
                or (value == 0 and not allow_zero)
            ):
                sign = ">= 0" if allow_zero else "> 0"
                raise ValueError(f"LinkModel.{field} must be a finite number {sign}, got {value!r}")
            object.__setattr__(self, field, float(value))

    @classmethod
    def from_link(cls, link: Link, efficiency: float) -> LinkModel:
        """The model of a hardware ``link`` run at ``efficiency`` of its bandwidth.

        ``alpha = link.latency`` (s); ``beta = 1 / (link.bandwidth * efficiency)`` (s/byte).
        ``efficiency`` must be in (0, 1].
        """
        return cls(alpha=link.latency, beta=1.0 / (link.bandwidth * _efficiency(efficiency)))

    @property
    def bandwidth(self) -> float:
        """Achieved bandwidth in bytes/s (``1 / beta``)."""
        return 1.0 / self.beta


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


# --- checks ---------------------------------------------------------------------------------


def _efficiency(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < value <= 1
    ):
        raise ValueError(f"efficiency must be a number in (0, 1], got {value!r}")
    return float(value)


def _check_bytes(nbytes: Any) -> None:
    if type(nbytes) in (int, float) and 0 <= nbytes < math.inf:  # fast path
        return
    if (
        isinstance(nbytes, bool)
        or not isinstance(nbytes, numbers.Real)
        or not 0 <= nbytes < math.inf
    ):
        raise ValueError(f"nbytes must be a finite number of bytes >= 0, got {nbytes!r}")


def _check_size(group_size: Any) -> None:
    if type(group_size) is int and group_size >= 1:  # fast path
        return
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, numbers.Integral)
        or group_size < 1
    ):
        raise ValueError(f"group size must be an integer >= 1, got {group_size!r}")


def _ceil_log2(g: int) -> int:
    """``ceil(log2 g)`` for an integer ``g >= 1``, exactly."""
    return (int(g) - 1).bit_length()


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
    return _efficiency(intra_eff), _efficiency(inter_eff)


@functools.lru_cache(maxsize=1024)
def inter_node_scale(kind: str, num_nodes: int) -> float:
    """Fraction of the inter-node link's achieved bandwidth left when a collective spans
    `num_nodes` nodes (1.0 up to GPU_INTER_NODE_SCALE_BASE_NODES; falling per doubling beyond,
    see GPU_INTER_NODE_LOSS_PER_DOUBLING). CPUs (measured loopback rates) keep 1.0."""
    if kind != "gpu" or num_nodes <= GPU_INTER_NODE_SCALE_BASE_NODES:
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


# --- collective formulas on one link level ---------------------------------------------------
# Each takes (link, nbytes, group_size) and returns seconds. nbytes is the full buffer
# per rank (see each docstring); a one-rank group or zero bytes costs 0.


def p2p_time(link: LinkModel, nbytes: float) -> float:
    """Seconds to send ``nbytes`` bytes from one rank to another: ``alpha + n*beta``."""
    _check_bytes(nbytes)
    if nbytes == 0:
        return 0.0
    return link.alpha + nbytes * link.beta


def ring_all_reduce_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """Ring all-reduce of ``nbytes`` bytes per rank over ``group_size`` ranks (seconds).

    ``2(g-1)*alpha + 2(g-1)/g * n*beta``: a reduce-scatter then an all-gather ring.
    """
    _check_bytes(nbytes)
    _check_size(group_size)
    g = group_size
    if g == 1 or nbytes == 0:
        return 0.0
    return 2 * (g - 1) * link.alpha + 2 * (g - 1) / g * nbytes * link.beta


def tree_all_reduce_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """Tree all-reduce of ``nbytes`` bytes per rank over ``group_size`` ranks (seconds).

    ``2*ceil(log2 g)*alpha + 2*n*beta``: a reduce up a (pipelined) binary tree, then a
    broadcast down it. Cheaper than the ring for small messages over many ranks.
    """
    _check_bytes(nbytes)
    _check_size(group_size)
    g = group_size
    if g == 1 or nbytes == 0:
        return 0.0
    return 2 * _ceil_log2(g) * link.alpha + 2 * nbytes * link.beta


def _one_pass(link: LinkModel, nbytes: float, group_size: int) -> float:
    """(g-1) rounds, each moving n/g bytes: ring all-gather, reduce-scatter, pairwise all-to-all."""
    _check_bytes(nbytes)
    _check_size(group_size)
    g = group_size
    if g == 1 or nbytes == 0:
        return 0.0
    return (g - 1) * link.alpha + (g - 1) / g * nbytes * link.beta


def ring_all_gather_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """Ring all-gather over ``group_size`` ranks (seconds).

    ``nbytes`` is the size of the gathered OUTPUT (each rank contributes n/g bytes):
    ``(g-1)*alpha + (g-1)/g * n*beta``.
    """
    return _one_pass(link, nbytes, group_size)


def ring_reduce_scatter_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """Ring reduce-scatter over ``group_size`` ranks (seconds).

    ``nbytes`` is the size of the INPUT on each rank (each ends with n/g bytes):
    ``(g-1)*alpha + (g-1)/g * n*beta``.
    """
    return _one_pass(link, nbytes, group_size)


def _chain_time(alpha: float, beta: float, nbytes: float, g: int, chunks: int) -> float:
    return (g - 2 + chunks) * (alpha + nbytes * beta / chunks)


def optimal_broadcast_chunks(link: LinkModel, nbytes: float, group_size: int) -> int:
    """The chunk count ``c >= 1`` that minimizes the pipelined chain broadcast.

    The time ``(g-2+c)*(alpha + n*beta/c)`` is convex in ``c`` with its real minimum at
    ``c* = sqrt((g-2)*n*beta/alpha)``, so the best integer is the floor or the ceiling
    of ``c*`` (the smaller count on a tie). A chunk holds at least one byte, so ``c``
    is at most ``max(1, floor(n))``; with ``alpha == 0`` that bound is the optimum.
    """
    _check_bytes(nbytes)
    _check_size(group_size)
    g = group_size
    if g <= 2 or nbytes == 0:
        return 1
    cap = max(1, int(nbytes))
    if link.alpha == 0:
        return cap
    best = math.sqrt((g - 2) * nbytes * link.beta / link.alpha)
    lo = min(cap, max(1, math.floor(best)))
    hi = min(cap, max(1, math.ceil(best)))
    if lo == hi:
        return lo
    t_lo = _chain_time(link.alpha, link.beta, nbytes, g, lo)
    t_hi = _chain_time(link.alpha, link.beta, nbytes, g, hi)
    return lo if t_lo <= t_hi else hi


def chain_broadcast_time(
    link: LinkModel, nbytes: float, group_size: int, chunks: int | None = None
) -> float:
    """Pipelined chain broadcast of ``nbytes`` bytes from one rank to ``group_size``.

    ``(g-2+c)*(alpha + n*beta/c)`` seconds with ``c`` chunks; ``chunks=None`` uses
    :func:`optimal_broadcast_chunks`.
    """
    _check_bytes(nbytes)
    _check_size(group_size)
    g = group_size
    if g == 1 or nbytes == 0:
        return 0.0
    if chunks is None:
        chunks = optimal_broadcast_chunks(link, nbytes, g)
    elif isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    return _chain_time(link.alpha, link.beta, nbytes, g, int(chunks))


def binomial_broadcast_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """Binomial-tree broadcast: ``ceil(log2 g)*(alpha + n*beta)`` seconds."""
    _check_bytes(nbytes)
    _check_size(group_size)
    g = group_size
    if g == 1 or nbytes == 0:
        return 0.0
    return _ceil_log2(g) * (link.alpha + nbytes * link.beta)


def broadcast_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """The cheaper of :func:`chain_broadcast_time` (best chunks) and
    :func:`binomial_broadcast_time`, in seconds."""
    return min(
        chain_broadcast_time(link, nbytes, group_size),
        binomial_broadcast_time(link, nbytes, group_size),
    )


def pairwise_all_to_all_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """Pairwise-exchange all-to-all over ``group_size`` ranks (seconds).

    ``nbytes`` is what one rank holds before the exchange (n/g to each peer):
    ``(g-1)*alpha + (g-1)/g * n*beta`` (g-1 rounds, one peer each).
    """
    return _one_pass(link, nbytes, group_size)


def all_reduce_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """The cheaper of ring and tree all-reduce on one link level (seconds)."""
    return min(
        ring_all_reduce_time(link, nbytes, group_size),
        tree_all_reduce_time(link, nbytes, group_size),
    )


def hierarchical_all_reduce_time(
    intra: LinkModel, inter: LinkModel, nbytes: float, per_node: int, num_nodes: int
) -> float:
    """Hierarchical all-reduce of ``nbytes`` bytes per rank (seconds).

    For a group of ``per_node`` ranks on each of ``num_nodes`` nodes: a ring
    reduce-scatter of the ``n`` bytes inside each node over ``per_node`` ranks (intra
    link), then ``per_node`` concurrent all-reduces of ``n/per_node`` bytes across the
    ``num_nodes`` nodes (inter link, ring or tree, whichever is cheaper), then a ring
    all-gather of the ``n`` bytes inside each node.
    """
    _check_bytes(nbytes)
    _check_size(per_node)
    _check_size(num_nodes)
    return (
        ring_reduce_scatter_time(intra, nbytes, per_node)
        + all_reduce_time(inter, nbytes / per_node, num_nodes)
        + ring_all_gather_time(intra, nbytes, per_node)
    )


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
    _check_bytes(nbytes)
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
    _check_bytes(nbytes)
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
    "LinkModel",
    "all_reduce_time",
    "binomial_broadcast_time",
    "broadcast_time",
    "chain_broadcast_time",
    "collective_candidates",
    "collective_time",
    "hierarchical_all_reduce_time",
    "inter_node_scale",
    "link_models",
    "optimal_broadcast_chunks",
    "p2p_time",
    "pairwise_all_to_all_time",
    "ring_all_gather_time",
    "ring_all_reduce_time",
    "ring_reduce_scatter_time",
    "tree_all_reduce_time",
]
