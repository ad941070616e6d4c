"""The cluster file: its layout (:meth:`cost_models.hardware.Cluster.to_dict`'s), its field
descriptions for the reader's messages, and reading and writing it as YAML or JSON::

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

A file's value errors are raised by the hardware types' constructors (cost_models/field_checks.py);
:func:`built` names the file and the dotted field in them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import yaml

from cost_models.field_checks import FieldProblem
from runtime.documents import FieldError, Fields, read_document

FORMAT_VERSION = 1


class ClusterFileError(ValueError):
    """A cluster file (or dict) that cannot be used.

    The message names the file, the field (dotted, e.g. ``device.memory_bytes``) and
    what to do. ``path`` and ``field`` hold the same for programs (either may be None).
    """

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None):
        super().__init__(message)
        self.path = path
        self.field = field


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


def check_layout(data: Mapping[str, Any], origin: str | os.PathLike[str] | None) -> tuple[str | None, str]:
    """(the file's path or None, how messages name it) after checking that `data` has the file's sections and
    fields, each known (or the closest known name suggested) and the format version this meshplan reads.
    Raises ClusterFileError naming the file and the field. `origin` only goes into messages."""
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
    return path, where


def built(kind: Callable[..., Any], fields: Mapping[str, Any], prefix: str, where: str, path: str | None) -> Any:
    """kind(**fields); the constructor's complaint (FieldProblem) gets the file (`where`, `path`: from
    check_layout) and the dotted field, `prefix` (the section, "device.") before the field's name."""
    try:
        return kind(**fields)
    except FieldProblem as e:
        error = FieldError(where, prefix + e.field, f"{e.problem}. Correct it in the file.")
        raise ClusterFileError(str(error), path=path, field=error.field) from None


def cluster_text(data: Mapping[str, Any], path: Path) -> str:
    """`data` (the to_dict layout) as the text of a file at `path`: YAML for .yaml/.yml, JSON for .json.

    Floats are written with ``repr`` (both by json and by PyYAML), so reading the text back gives
    the same numbers, bit for bit.
    """
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        text = yaml.dump(
            data, Dumper=yaml.SafeDumper, sort_keys=False, allow_unicode=True
        )
    elif suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        raise ValueError(
            f"cannot tell the format of {path} from its suffix {path.suffix!r}; "
            f"name it .yaml, .yml or .json"
        )
    return text


def read_cluster_file(path: Path, presets: str) -> Any:
    """The document in the file at `path`: JSON for .json, YAML for .yaml/.yml, else JSON then YAML.
    Raises ClusterFileError naming the file if it is missing (suggesting the `presets`) or does not parse."""
    return read_document(path, "cluster file", yaml=True,
                         error=lambda message: ClusterFileError(f"{message}.", path=str(path)),
                         missing_hint=f". Check the path, or use a preset: {presets}")
