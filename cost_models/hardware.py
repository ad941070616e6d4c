"""What the cost models price a plan on: devices, links and clusters.

A :class:`Cluster` is ``num_nodes`` nodes of ``devices_per_node`` identical
:class:`Device` s, joined by two levels of :class:`Link`: ``intra_node`` (NVLink,
shared memory) and ``inter_node`` (InfiniBand, Ethernet). Ranks are numbered
node-major: rank ``r`` lives on node ``r // devices_per_node``.

Every figure is in SI units: bytes, bytes/s, seconds, FLOP/s, watts. Link bandwidth is
per device and one direction (what one rank can send while it also receives).

Clusters come from presets (:meth:`Cluster.preset`: published DGX A100 / DGX H100 /
Summit figures, or ``local``, measured on this machine), or from YAML/JSON files
(:meth:`Cluster.load`) laid out like :meth:`Cluster.to_dict`::

    format_version: 1                      # optional
    name: my-cluster
    num_nodes: 2
    devices_per_node: 8
    device: {name: A100, kind: gpu, peak_flops: {bf16: 312e12, fp32: 19.5e12},
             memory_bytes: 85899345920, memory_bandwidth: 2.0e12,
             active_watts: 400, idle_watts: 60}
    intra_node: {bandwidth: 300e9, latency: 3e-6}
    inter_node: {bandwidth: 25e9, latency: 6e-6}
    source: where the figures came from    # optional
    measurements: {}                       # optional raw measured numbers (or tables of records), kept as is

Nothing here runs at import time; the ``local`` preset measures (once, then cached)
only when asked for.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from cost_models.presets import GPU_PRESETS, NodeSpec, local_spec
from runtime.documents import FieldError, Fields, read_document


FORMAT_VERSION = 1
KNOWN_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
DEVICE_KINDS = ("gpu", "cpu")
LOCAL_PRESET = "local"

# Other spellings of the dtype names, e.g. str(torch.bfloat16) == "torch.bfloat16".
_DTYPE_ALIASES = MappingProxyType(
    {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
)

_GiB = 2**30


class ClusterFileError(ValueError):
    """A cluster file (or dict) that cannot be used.

    The message names the file, the field (dotted, e.g. ``device.memory_bytes``) and
    what to do. ``path`` and ``field`` hold the same for programs (either may be None).
    """

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None):
        super().__init__(message)
        self.path = path
        self.field = field


class _FieldError(ValueError):
    """A bad value for ``owner.field`` (``field`` may be dotted: ``peak_flops.bf16``)."""

    def __init__(self, owner: str, field: str, problem: str):
        super().__init__(f"{owner}.{field} {problem}")
        self.field = field
        self.problem = problem


# --- value checks, shared by the constructors and (through them) the file reader ------


def _text(value: Any, owner: str, field: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise _FieldError(owner, field, f"must be text, got {value!r} ({type(value).__name__})")
    if not allow_empty and not value.strip():
        raise _FieldError(owner, field, "must not be empty")
    return value


def _positive_int(value: Any, owner: str, field: str, unit: str) -> int:
    # A file may say 80e9 for a byte count: accept floats that are whole numbers.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        got = f"{value!r} ({type(value).__name__})"
        raise _FieldError(owner, field, f"must be a positive integer ({unit}), got {got}")
    return int(value)


def _number(value: Any, owner: str, field: str, unit: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        got = f"{value!r} ({type(value).__name__})"
        raise _FieldError(owner, field, f"must be a number ({unit}), got {got}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        sign = "zero or positive" if allow_zero else "positive"
        raise _FieldError(owner, field, f"must be {sign} and finite ({unit}), got {value!r}")
    return value


def _suggest(name: str, known: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest known name, or ``''``."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def _pairs(value: Any, owner: str, field: str, what: str) -> list[tuple[Any, Any]]:
    """The (key, value) pairs of a mapping or of an iterable of pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        return [(key, item) for key, item in items]
    except (TypeError, ValueError):
        raise _FieldError(owner, field, f"must map {what}, got {value!r}") from None


def _peak_table(value: Any) -> tuple[tuple[str, float], ...]:
    """A dtype -> FLOP/s mapping (or pairs) as sorted, hashable pairs."""
    pairs = _pairs(value, "Device", "peak_flops", "dtype names to FLOP/s")
    if not pairs:
        raise _FieldError("Device", "peak_flops", f"must give at least one of {KNOWN_DTYPES}")
    table: dict[str, float] = {}
    for dtype, flops in pairs:
        field = f"peak_flops.{dtype}"
        if dtype not in KNOWN_DTYPES:
            hint = _suggest(dtype, KNOWN_DTYPES)
            known = ", ".join(KNOWN_DTYPES)
            raise _FieldError("Device", field, f"is not a known dtype.{hint} Known: {known}")
        if dtype in table:
            raise _FieldError("Device", field, "is given twice")
        table[dtype] = _number(flops, "Device", field, "FLOP/s")
    return tuple(sorted(table.items()))


def _scalar(item: Any, field: str, *, allow_none: bool = False) -> int | float | str | None:
    """A measured value JSON and YAML both carry exactly: an int, a finite float, text (or None)."""
    if item is None and allow_none:
        return None
    if isinstance(item, bool) or not isinstance(item, (int, float, str)):
        raise _FieldError("Cluster", field, f"must be a number or text{' or null' if allow_none else ''}, "
                                            f"got {item!r}")
    if isinstance(item, float) and not math.isfinite(item):
        raise _FieldError("Cluster", field, f"must be finite, got {item!r}")
    return item


def _record_table(item: Any, field: str) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """A table of records (a list of mappings of column name -> number, text or null, e.g. the op rows
    of a GPU calibration, raw.gpu_ops) as hashable nested pairs, rows and columns in their order."""
    if not all(isinstance(row, (Mapping, tuple)) for row in item):
        raise _FieldError("Cluster", field, f"must be a number, text or a list of records (mappings of column "
                                            f"names to numbers, text or null), got {item!r}")
    rows = []
    for i, row in enumerate(item):
        pairs = _pairs(row, "Cluster", f"{field}[{i}]", "column names to numbers, text or null")
        if any(not isinstance(k, str) for k, _ in pairs) or len({k for k, _ in pairs}) != len(pairs):
            raise _FieldError("Cluster", f"{field}[{i}]", "must have unique text column names")
        rows.append(tuple((k, _scalar(v, f"{field}[{i}].{k}", allow_none=True)) for k, v in pairs))
    return tuple(rows)


def _measurement_table(value: Any) -> tuple[tuple[str, Any], ...]:
    """Raw measurements (mapping or pairs of name -> number, text, or a table of records) as sorted pairs."""
    pairs = _pairs(value, "Cluster", "measurements", "names to numbers, text or tables")
    table: dict[str, Any] = {}
    for key, item in pairs:
        field = f"measurements.{key}"
        if not isinstance(key, str) or key in table:
            raise _FieldError("Cluster", field, "must be a unique text name")
        table[key] = _record_table(item, field) if isinstance(item, (list, tuple)) else _scalar(item, field)
    return tuple(sorted(table.items()))


def _measurement_value(item: Any) -> Any:
    """A measurement as the file holds it: a table of records as a list of mappings."""
    return [dict(row) for row in item] if isinstance(item, tuple) else item


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
        set_(self, "name", _text(self.name, own, "name"))
        set_(self, "peak_flops", _peak_table(self.peak_flops))
        set_(self, "memory_bytes", _positive_int(self.memory_bytes, own, "memory_bytes", "bytes"))
        set_(
            self,
            "memory_bandwidth",
            _number(self.memory_bandwidth, own, "memory_bandwidth", "bytes/s"),
        )
        set_(self, "active_watts", _number(self.active_watts, own, "active_watts", "watts"))
        set_(
            self,
            "idle_watts",
            _number(self.idle_watts, own, "idle_watts", "watts", allow_zero=True),
        )
        if self.idle_watts > self.active_watts:
            raise _FieldError(
                own,
                "idle_watts",
                f"({self.idle_watts} W) must not exceed active_watts ({self.active_watts} W)",
            )
        if isinstance(self.compute_units, bool) or not isinstance(self.compute_units, int) \
                or self.compute_units < 0:
            raise _FieldError(own, "compute_units", f"must be a whole number >= 0, got {self.compute_units!r}")
        if self.kind not in DEVICE_KINDS:
            kinds = ", ".join(DEVICE_KINDS)
            raise _FieldError(own, "kind", f"must be one of {kinds}, got {self.kind!r}")

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
        bandwidth = _number(self.bandwidth, "Link", "bandwidth", "bytes/s")
        latency = _number(self.latency, "Link", "latency", "seconds", allow_zero=True)
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
        set_(self, "name", _text(self.name, own, "name"))
        set_(self, "num_nodes", _positive_int(self.num_nodes, own, "num_nodes", "nodes"))
        set_(
            self,
            "devices_per_node",
            _positive_int(self.devices_per_node, own, "devices_per_node", "devices"),
        )
        for field, kind in (("device", Device), ("intra_node", Link), ("inter_node", Link)):
            value = getattr(self, field)
            if not isinstance(value, kind):
                raise _FieldError(own, field, f"must be a {kind.__name__}, got {value!r}")
        set_(self, "source", _text(self.source, own, "source", allow_empty=True))
        set_(self, "measurements", _measurement_table(self.measurements))

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
            "measurements": {k: _measurement_value(v) for k, v in self.measurements},
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
        path = None if origin is None else str(origin)
        where = f"cluster file {path}" if path else "cluster description"
        try:
            top = Fields(data, where)
            top.known(_CLUSTER_FIELDS, _CLUSTER_OPTIONAL)
            version = top.raw("format_version", FORMAT_VERSION)
            if version != FORMAT_VERSION or isinstance(version, bool):
                raise top.error("format_version", f"is {version!r}, but this meshplan reads version "
                                f"{FORMAT_VERSION}. Write the file in format version {FORMAT_VERSION}, or "
                                "upgrade meshplan.")
            for section, fields, optional in (
                ("device", _DEVICE_FIELDS, _DEVICE_OPTIONAL),
                ("intra_node", _LINK_FIELDS, ()),
                ("inter_node", _LINK_FIELDS, ()),
            ):
                top.sub(section).known(fields, optional)
        except FieldError as e:
            raise ClusterFileError(f"{e}", path=path, field=e.field) from None

        def build(kind: type, fields: Mapping[str, Any], prefix: str) -> Any:
            """kind(**fields); the constructor's complaint gets the file and the dotted field."""
            try:
                return kind(**fields)
            except _FieldError as e:
                error = FieldError(where, prefix + e.field, f"{e.problem}. Correct it in the file.")
                raise ClusterFileError(str(error), path=path, field=error.field) from None

        rest = {key: value for key, value in data.items() if key != "format_version"}
        rest["device"] = build(Device, data["device"], "device.")
        rest["intra_node"] = build(Link, data["intra_node"], "intra_node.")
        rest["inter_node"] = build(Link, data["inter_node"], "inter_node.")
        return build(cls, rest, "")

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write this cluster to ``path``: YAML for .yaml/.yml, JSON for .json.

        Floats are written with ``repr`` (both by json and by PyYAML), so :meth:`load`
        gives back an equal Cluster, bit for bit.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".yaml", ".yml"):
            text = yaml.dump(
                self.to_dict(), Dumper=yaml.SafeDumper, sort_keys=False, allow_unicode=True
            )
        elif suffix == ".json":
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            raise ValueError(
                f"cannot tell the format of {path} from its suffix {path.suffix!r}; "
                f"name it .yaml, .yml or .json"
            )
        path.write_text(text)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a cluster file: JSON for .json, YAML for .yaml/.yml, else JSON then YAML.

        Raises :class:`ClusterFileError` naming the file if it is missing, does not parse,
        or describes no valid cluster.
        """
        path = Path(path)
        presets = ", ".join(cls.preset_names())
        data = read_document(path, "cluster file", yaml=True,
                             error=lambda message: ClusterFileError(f"{message}.", path=str(path)),
                             missing_hint=f". Check the path, or use a preset: {presets}")
        return cls.from_dict(data, origin=path)

    # --- presets ---

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        """Names :meth:`preset` accepts, sorted."""
        return tuple(sorted([*GPU_PRESETS, LOCAL_PRESET]))

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
        if name == LOCAL_PRESET:
            if nodes not in (None, 1):
                raise ValueError(
                    f"the 'local' preset is this one machine: nodes must be 1, got {nodes!r}"
                )
            spec = local_spec(None if devices is None else _count(devices, "devices"), figures)
            return cls._from_spec(name, 1, spec.devices_per_node, spec)
        if figures is not None:
            raise ValueError(f"figures describe this machine for the 'local' preset; preset {name!r} has "
                             "published figures (edit a saved cluster file to change them)")
        spec = GPU_PRESETS.get(name) if isinstance(name, str) else None
        if spec is None:
            known = cls.preset_names()
            raise ValueError(
                f"unknown cluster preset {name!r}.{_suggest(str(name), known)} "
                f"Known presets: {', '.join(known)}."
            )
        num_nodes = 1 if nodes is None else _count(nodes, "nodes")
        per_node = spec.devices_per_node
        if devices is not None:
            if _count(devices, "devices") > per_node:
                raise ValueError(
                    f"preset {name!r} has {per_node} GPUs per node, so devices={devices} "
                    f"does not fit one node; ask for nodes=N (with devices <= {per_node})."
                )
            per_node = devices
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


# --- reading files ----------------------------------------------------------------------

# Field descriptions for the reader's messages: name -> what it is, with its unit.
_CLUSTER_FIELDS = MappingProxyType({
    "name": "cluster name, text",
    "num_nodes": "number of nodes, integer >= 1",
    "devices_per_node": "devices per node, integer >= 1",
    "device": "the device description, a mapping",
    "intra_node": "link between devices of one node, a mapping",
    "inter_node": "link between devices of different nodes, a mapping",
})
_CLUSTER_OPTIONAL = MappingProxyType({
    "format_version": f"file format version, {FORMAT_VERSION}",
    "source": "where the figures came from, text",
    "measurements": "raw measured numbers (or lists of records), a mapping",
})
_DEVICE_FIELDS = MappingProxyType({
    "name": "device model name, text",
    "kind": "gpu or cpu",
    "peak_flops": "peak FLOP/s per dtype, a mapping like {bf16: 312e12}",
    "memory_bytes": "device memory in bytes",
    "memory_bandwidth": "memory bandwidth in bytes/s",
    "active_watts": "power while computing in watts",
    "idle_watts": "power while idle in watts",
})
_DEVICE_OPTIONAL = MappingProxyType({
    "compute_units": "streaming multiprocessors (GPU), 0 if unknown",
})
_LINK_FIELDS = MappingProxyType({
    "bandwidth": "bytes/s per device, one direction",
    "latency": "seconds per message",
})


# --- small helpers ----------------------------------------------------------------------


def _count(value: Any, what: str) -> int:
    """``value`` as an integer >= 1, else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return int(value)


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
