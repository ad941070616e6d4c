"""What the cost models price a plan on: devices, links and clusters.

A :class:`Cluster` is ``num_nodes`` nodes of ``devices_per_node`` identical
:class:`Device` s, joined by two levels of :class:`Link`: ``intra_node`` (NVLink,
shared memory) and ``inter_node`` (InfiniBand, Ethernet). Ranks are numbered
node-major: rank ``r`` lives on node ``r // devices_per_node``.

Every figure is in SI units: bytes, bytes/s, seconds, FLOP/s, watts. Link bandwidth is
per device and one direction (what one rank can send while it also receives).

Clusters come from presets (:meth:`Cluster.preset`: published DGX A100 / DGX H100 /
Summit figures, or ``local``, measured on this machine; cost_models/presets.py), or from YAML/JSON
files (:meth:`Cluster.load`) laid out like :meth:`Cluster.to_dict` (cost_models/cluster_file.py).
Each field's value is checked by cost_models/field_checks.py.

Nothing here runs at import time; the ``local`` preset measures (once, then cached)
only when asked for.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cost_models.cluster_file import FORMAT_VERSION, built, check_layout, cluster_text, read_cluster_file
from cost_models.field_checks import (KNOWN_DTYPES, FieldProblem, measurement_table, measurement_value, peak_table,
                                      positive_int, real_number, text_field)
from cost_models.presets import NodeSpec, preset_names, preset_spec
from runtime.vocab import DeviceKind

DEVICE_KINDS = tuple(k.value for k in DeviceKind)

# Other spellings of the dtype names, e.g. str(torch.bfloat16) == "torch.bfloat16".
_DTYPE_ALIASES = MappingProxyType(
    {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
)

_GiB = 2**30


# --- the value types ------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU process): what one rank runs on.

    Attributes:
        name: model name, e.g. ``"A100-SXM4-80GB"``.
        peak_flops: peak FLOP/s per dtype name (``"fp32"``, ``"tf32"``, ``"bf16"``,
            ``"fp16"``, ``"fp8"``), stored as sorted ``(dtype, FLOP/s)`` pairs so the
            device stays hashable; a dict is accepted and converted. Use :meth:`peak`.
        memory_bytes: device memory, bytes.
        memory_bandwidth: device memory bandwidth, bytes/s.
        active_watts: power drawn while computing, watts.
        idle_watts: power drawn while waiting, watts (at most ``active_watts``).
        kind: ``"gpu"`` or ``"cpu"``.
        compute_units: streaming multiprocessors (GPU) that a GEMM's tiles are spread
            over; 0 when unknown or not meaningful (CPU). Used for wave quantization.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    memory_bandwidth: float
    active_watts: float
    idle_watts: float
    kind: str
    compute_units: int = 0

    def __post_init__(self) -> None:
        # Frozen: check and normalize each field in place, once, here.
        set_, own = object.__setattr__, "Device"
        set_(self, "name", text_field(self.name, own, "name"))
        set_(self, "peak_flops", peak_table(self.peak_flops))
        set_(self, "memory_bytes", positive_int(self.memory_bytes, own, "memory_bytes", "bytes"))
        set_(
            self,
            "memory_bandwidth",
            real_number(self.memory_bandwidth, own, "memory_bandwidth", "bytes/s"),
        )
        set_(self, "active_watts", real_number(self.active_watts, own, "active_watts", "watts"))
        set_(
            self,
            "idle_watts",
            real_number(self.idle_watts, own, "idle_watts", "watts", allow_zero=True),
        )
        if self.idle_watts > self.active_watts:
            raise FieldProblem(
                own,
                "idle_watts",
                f"({self.idle_watts} W) must not exceed active_watts ({self.active_watts} W)",
            )
        if isinstance(self.compute_units, bool) or not isinstance(self.compute_units, int) \
                or self.compute_units < 0:
            raise FieldProblem(own, "compute_units", f"must be a whole number >= 0, got {self.compute_units!r}")
        if self.kind not in DEVICE_KINDS:
            kinds = ", ".join(DEVICE_KINDS)
            raise FieldProblem(own, "kind", f"must be one of {kinds}, got {self.kind!r}")
        set_(self, "kind", DeviceKind(self.kind).value)   # the plain text, as cluster files write it

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtype names this device has a peak for, sorted."""
        return tuple(dtype for dtype, _ in self.peak_flops)

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``: ``"bf16"`` (``"bfloat16"``, ``"torch.bfloat16"`` too).

        Raises ValueError naming the dtype and the ones this device knows.
        """
        key = str(dtype).removeprefix("torch.")
        key = _DTYPE_ALIASES.get(key, key)
        for name, flops in self.peak_flops:
            if name == key:
                return flops
        raise ValueError(
            f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; it knows "
            f"{', '.join(self.dtypes)}. Use one of those, or add the dtype to the "
            f"cluster's device.peak_flops (dtypes meshplan knows: {', '.join(KNOWN_DTYPES)})."
        )


@dataclass(frozen=True)
class Link:
    """One level of interconnect, as seen by one device.

    Attributes:
        bandwidth: bytes/s one device can send in one direction (while also receiving).
        latency: seconds of fixed cost per message.
    """

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        bandwidth = real_number(self.bandwidth, "Link", "bandwidth", "bytes/s")
        latency = real_number(self.latency, "Link", "latency", "seconds", allow_zero=True)
        object.__setattr__(self, "bandwidth", bandwidth)
        object.__setattr__(self, "latency", latency)

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` bytes point to point: latency + nbytes / bandwidth."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or nbytes < 0:
            raise ValueError(f"nbytes must be a number of bytes >= 0, got {nbytes!r}")
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` nodes x ``devices_per_node`` identical devices, two link levels.

    Attributes:
        name: cluster name.
        num_nodes: number of nodes.
        devices_per_node: devices per node.
        device: the device every rank runs on (all identical).
        intra_node: link between two devices of the same node.
        inter_node: link between devices of different nodes.
        source: free text saying where the figures came from.
        measurements: raw measured numbers (name -> int, float or text, or a table of records:
            a list of mappings of column -> number, text or null, kept as nested pairs) as sorted
            pairs; a dict is accepted and converted. Kept unchanged through save/load.
    """

    name: str
    num_nodes: int
    devices_per_node: int
    device: Device
    intra_node: Link
    inter_node: Link
    source: str = ""
    measurements: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        set_, own = object.__setattr__, "Cluster"
        set_(self, "name", text_field(self.name, own, "name"))
        set_(self, "num_nodes", positive_int(self.num_nodes, own, "num_nodes", "nodes"))
        set_(
            self,
            "devices_per_node",
            positive_int(self.devices_per_node, own, "devices_per_node", "devices"),
        )
        for field, kind in (("device", Device), ("intra_node", Link), ("inter_node", Link)):
            value = getattr(self, field)
            if not isinstance(value, kind):
                raise FieldProblem(own, field, f"must be a {kind.__name__}, got {value!r}")
        set_(self, "source", text_field(self.source, own, "source", allow_empty=True))
        set_(self, "measurements", measurement_table(self.measurements))

    # --- topology ---

    @property
    def num_devices(self) -> int:
        """Total devices (= ranks): ``num_nodes * devices_per_node``."""
        return self.num_nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        """The node that ``rank`` lives on (ranks are node-major)."""
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise ValueError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < self.num_devices:
            raise ValueError(
                f"rank {rank} is outside cluster {self.name!r}, "
                f"whose ranks are 0..{self.num_devices - 1}"
            )
        return int(rank) // self.devices_per_node

    def link_between(self, rank_a: int, rank_b: int) -> Link:
        """The link two ranks talk over: intra-node if they share a node, else inter-node."""
        same_node = self.node_of(rank_a) == self.node_of(rank_b)
        return self.intra_node if same_node else self.inter_node

    def link_for_group(self, ranks: Iterable[int]) -> Link:
        """The slowest link a group of ranks spans: inter-node if it spans nodes.

        A collective over the group runs at the pace of this link.
        """
        nodes = {self.node_of(rank) for rank in ranks}
        if not nodes:
            raise ValueError("link_for_group needs at least one rank")
        return self.intra_node if len(nodes) == 1 else self.inter_node

    # --- text ---

    def summary(self) -> str:
        """A few readable lines: size, device figures, links, source."""
        d = self.device
        peaks = ", ".join(f"{dtype} {_si(flops, 'FLOP/s')}" for dtype, flops in d.peak_flops)
        lines = [
            f"cluster {self.name!r}: {self.num_nodes} node(s) x {self.devices_per_node} "
            f"{d.kind.upper()} = {self.num_devices} device(s)",
            f"  device {d.name}: peak {peaks}",
            f"    memory {d.memory_bytes / _GiB:.3g} GiB at {_si(d.memory_bandwidth, 'B/s')}; "
            f"power {d.active_watts:.3g} W active, {d.idle_watts:.3g} W idle",
            f"  intra-node link: {_link_text(self.intra_node)}",
            f"  inter-node link: {_link_text(self.inter_node)}",
        ]
        if self.source:
            lines.append(f"  source: {self.source}")
        if self.measurements:
            lines.append(f"  measurements: {', '.join(name for name, _ in self.measurements)}")
        return "\n".join(lines)

    # --- dicts and files ---

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (the file layout); :meth:`from_dict` gives back an equal one."""
        d = self.device
        return {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": {
                "name": d.name,
                "kind": d.kind,
                "peak_flops": dict(d.peak_flops),
                "memory_bytes": d.memory_bytes,
                "memory_bandwidth": d.memory_bandwidth,
                "active_watts": d.active_watts,
                "idle_watts": d.idle_watts,
                "compute_units": d.compute_units,
            },
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
            "source": self.source,
            "measurements": {k: measurement_value(v) for k, v in self.measurements},
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, origin: str | os.PathLike[str] | None = None
    ) -> Cluster:
        """Build a Cluster from the :meth:`to_dict` layout.

        ``origin`` (the file it came from) only goes into error messages. Raises
        :class:`ClusterFileError` naming the field and the file for a missing, unknown
        (with the closest known name), mistyped or out-of-range field.
        """
        path, where = check_layout(data, origin)
        rest = {key: value for key, value in data.items() if key != "format_version"}
        rest["device"] = built(Device, data["device"], "device.", where, path)
        rest["intra_node"] = built(Link, data["intra_node"], "intra_node.", where, path)
        rest["inter_node"] = built(Link, data["inter_node"], "inter_node.", where, path)
        return built(cls, rest, "", where, path)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write this cluster to ``path``: YAML for .yaml/.yml, JSON for .json.

        Floats are written with ``repr`` (both by json and by PyYAML), so :meth:`load`
        gives back an equal Cluster, bit for bit.
        """
        path = Path(path)
        path.write_text(cluster_text(self.to_dict(), path))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a cluster file: JSON for .json, YAML for .yaml/.yml, else JSON then YAML.

        Raises :class:`ClusterFileError` naming the file if it is missing, does not parse,
        or describes no valid cluster.
        """
        path = Path(path)
        data = read_cluster_file(path, ", ".join(cls.preset_names()))
        return cls.from_dict(data, origin=path)

    # --- presets ---

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        """Names :meth:`preset` accepts, sorted."""
        return preset_names()

    @classmethod
    def preset(
        cls, name: str, *, nodes: int | None = None, devices: int | None = None,
        figures: Mapping[str, Any] | None = None,
    ) -> Cluster:
        """A named cluster.

        GPU presets (``dgx-a100-80gb``, ``dgx-h100``, ``summit``): ``nodes`` (default 1)
        full nodes; ``devices``, if given, is the GPUs used per node and must not exceed
        the node's GPU count (with ``nodes`` left out: one node of that many GPUs).

        ``local``: ``devices`` CPU processes (default: one per usable CPU) on this one
        machine (``nodes`` must be 1 or left out). Its figures are measured on first use
        and cached; see :mod:`cost_models.local_machine`. ``figures`` (``local`` only): use
        these instead, a record of that module's form (a fixed machine: tests, what-ifs,
        or a measurement taken with ``load_or_measure(remeasure=True)``).

        Raises ValueError for an unknown name (listing the known ones) or bad sizes.
        """
        num_nodes, per_node, spec = preset_spec(name, nodes, devices, figures)
        return cls._from_spec(name, num_nodes, per_node, spec)

    @classmethod
    def _from_spec(cls, name: str, num_nodes: int, devices_per_node: int, spec: NodeSpec) -> Cluster:
        return cls(
            name=name,
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            device=Device(**spec.device),
            intra_node=Link(**spec.intra_node),
            inter_node=Link(**spec.inter_node),
            source=spec.source,
            measurements=spec.measurements,
        )


# --- small helpers ----------------------------------------------------------------------


def _si(value: float, unit: str) -> str:
    """``312e12, 'FLOP/s'`` -> ``'312 TFLOP/s'``."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _link_text(link: Link) -> str:
    return (
        f"{_si(link.bandwidth, 'B/s')} per device each way, "
        f"{link.latency * 1e6:.3g} us latency"
    )


def _link_dict(link: Link) -> dict[str, float]:
    return {"bandwidth": link.bandwidth, "latency": link.latency}
