"""Alpha-beta formulas of the collectives on one link level: what a collective of ``n`` bytes over
``g`` ranks costs on one :class:`LinkModel` (cost_models/comm.py prices them over a cluster's ranks).

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

Units everywhere: bytes, seconds, bytes/s. Every function here is pure.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from cost_models.hardware import Link

# --- the link level ---------------------------------------------------------------------------


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
        return cls(alpha=link.latency, beta=1.0 / (link.bandwidth * checked_efficiency(efficiency)))

    @property
    def bandwidth(self) -> float:
        """Achieved bandwidth in bytes/s (``1 / beta``)."""
        return 1.0 / self.beta


# --- checks ---------------------------------------------------------------------------------


def checked_efficiency(value: Any) -> float:
    """`value` as a float, when it is a fraction of a bandwidth in (0, 1]; else ValueError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < value <= 1
    ):
        raise ValueError(f"efficiency must be a number in (0, 1], got {value!r}")
    return float(value)


def check_bytes(nbytes: Any) -> None:
    """ValueError unless `nbytes` is a finite number of bytes >= 0."""
    if type(nbytes) in (int, float) and 0 <= nbytes < math.inf:  # fast path
        return
    if (
        isinstance(nbytes, bool)
        or not isinstance(nbytes, numbers.Real)
        or not 0 <= nbytes < math.inf
    ):
        raise ValueError(f"nbytes must be a finite number of bytes >= 0, got {nbytes!r}")


def check_size(group_size: Any) -> None:
    """ValueError unless `group_size` is an integer number of ranks >= 1."""
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


# --- collective formulas on one link level ---------------------------------------------------
# Each takes (link, nbytes, group_size) and returns seconds. nbytes is the full buffer
# per rank (see each docstring); a one-rank group or zero bytes costs 0.


def p2p_time(link: LinkModel, nbytes: float) -> float:
    """Seconds to send ``nbytes`` bytes from one rank to another: ``alpha + n*beta``."""
    check_bytes(nbytes)
    if nbytes == 0:
        return 0.0
    return link.alpha + nbytes * link.beta


def ring_all_reduce_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """Ring all-reduce of ``nbytes`` bytes per rank over ``group_size`` ranks (seconds).

    ``2(g-1)*alpha + 2(g-1)/g * n*beta``: a reduce-scatter then an all-gather ring.
    """
    check_bytes(nbytes)
    check_size(group_size)
    g = group_size
    if g == 1 or nbytes == 0:
        return 0.0
    return 2 * (g - 1) * link.alpha + 2 * (g - 1) / g * nbytes * link.beta


def tree_all_reduce_time(link: LinkModel, nbytes: float, group_size: int) -> float:
    """Tree all-reduce of ``nbytes`` bytes per rank over ``group_size`` ranks (seconds).

    ``2*ceil(log2 g)*alpha + 2*n*beta``: a reduce up a (pipelined) binary tree, then a
    broadcast down it. Cheaper than the ring for small messages over many ranks.
    """
    check_bytes(nbytes)
    check_size(group_size)
    g = group_size
    if g == 1 or nbytes == 0:
        return 0.0
    return 2 * _ceil_log2(g) * link.alpha + 2 * nbytes * link.beta


def _one_pass(link: LinkModel, nbytes: float, group_size: int) -> float:
    """(g-1) rounds, each moving n/g bytes: ring all-gather, reduce-scatter, pairwise all-to-all."""
    check_bytes(nbytes)
    check_size(group_size)
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
    check_bytes(nbytes)
    check_size(group_size)
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
    check_bytes(nbytes)
    check_size(group_size)
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
    check_bytes(nbytes)
    check_size(group_size)
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
    check_bytes(nbytes)
    check_size(per_node)
    check_size(num_nodes)
    return (
        ring_reduce_scatter_time(intra, nbytes, per_node)
        + all_reduce_time(inter, nbytes / per_node, num_nodes)
        + ring_all_gather_time(intra, nbytes, per_node)
    )
