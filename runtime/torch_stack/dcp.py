"""Distributed Checkpoint (torch.distributed.checkpoint) for a parallelized model and its optimizer.

The state dicts come from torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict):
parameters and optimizer state as DTensors under their canonical names (wrapper prefixes removed), so
that every rank writes its own shards and a checkpoint written under one plan loads under another
(DCP reshards each tensor from the saved shards to the loading rank's placement).

DCP describes a rank's shard as one block of the whole tensor, which a _StridedShard placement (a
fused qkv split q_r, k_r, v_r: runtime/torch_stack/tensor.py) is not: such tensors are written and read
replicated over the dimensions that stride them, and placed back after reading.

Nothing in a checkpoint runs code when it is read. torch's FileSystemReader unpickles .metadata with
pickle.load, and its planner reads non-tensor items (optimizer hyper-parameters, the `extra` state) with
torch.load(weights_only=False): here .metadata goes through an unpickler that admits only the types
torch.distributed.checkpoint's Metadata is made of (`read_metadata`), and every item through
torch.load(weights_only=True). `file_digests` / `check_digests`: the sha256 of every file of a
checkpoint, recorded at save time by the caller and checked before anything is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim import Optimizer

from runtime.checkpoint import CheckpointError

METADATA = ".metadata"
# (module, name) of every global a DCP .metadata pickle holds (torch 2.11 to 2.13): the metadata
# dataclasses, torch.Size, a dtype (any torch.dtype attribute of torch), a layout, the checkpoint path.
_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
       ("torch", "Size")]
    + [("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")])


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds nothing but checkpoint-metadata types."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not a checkpoint metadata type")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which checkpoint metadata never does")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """A checkpoint's .metadata, read without running anything it names; CheckpointError naming the file
    when it holds anything but DCP's metadata types."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            md = _MetadataUnpickler(f).load()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - whatever a damaged or crafted pickle raises
        raise CheckpointError(f"checkpoint file {path} is not a Distributed Checkpoint's metadata ({e}); it was "
                              "damaged or replaced: resume from another checkpoint") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"checkpoint file {path} holds a {type(md).__name__}, not a Distributed Checkpoint's "
                              "metadata; resume from another checkpoint")
    return md


class SafeReader(FileSystemReader):
    """FileSystemReader whose .metadata goes through `read_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        md = read_metadata(Path(self.path) / (METADATA if rank is None else f"__{rank}{METADATA}"))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _safe_bytes(value: io.BytesIO, fqn: str) -> io.BytesIO:
    """A non-tensor item read with weights_only=True, re-serialized for the planner's own torch.load."""
    try:
        item = torch.load(value, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever a crafted item raises: it is refused, not run
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else type(e).__name__)[:200]
        raise CheckpointError(f"checkpoint item {fqn} is not plain data (numbers, strings, lists, dicts, tensors): "
                              f"{first}; it was damaged or replaced: resume from another checkpoint") from None
    out = io.BytesIO()
    torch.save(item, out)
    out.seek(0)
    return out


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor items with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        super().load_bytes(read_item, _safe_bytes(value, read_item.dest_index.fqn))


class _SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    """torch's planner that loads a whole checkpoint into an empty dict, with SafePlanner's items."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        super().load_bytes(read_item, _safe_bytes(value, read_item.dest_index.fqn))


@contextlib.contextmanager
def _own_errors():
    """DCP gathers each rank's exception into one CheckpointException: our own refusal (a CheckpointError) comes
    out as itself, one line naming the file, instead of every rank's traceback."""
    try:
        yield
    except CheckpointException as e:
        ours = next((exc for exc, _trace in e.failures.values() if isinstance(exc, CheckpointError)), None)
        if ours is None:
            raise
        raise ours from None


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The files of a DCP checkpoint directory: .metadata (and __R.metadata) and the *.distcp shards."""
    return sorted(f for f in Path(path).iterdir() if f.is_file() and (f.name.endswith(METADATA)
                                                                     or f.suffix == ".distcp"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(path: str | os.PathLike) -> dict[str, dict]:
    """name -> {"sha256", "bytes"} of every file of the checkpoint directory `path`."""
    return {f.name: {"sha256": _sha256(f), "bytes": f.stat().st_size} for f in checkpoint_files(path)}


def check_digests(path: str | os.PathLike, digests: dict[str, dict], record: str) -> None:
    """CheckpointError naming the first file of checkpoint `path` that is missing, extra, or differs from
    `digests` (what `record`, the file that holds them, says was saved)."""
    path = Path(path)
    names = {f.name for f in checkpoint_files(path)}
    for name in sorted(names | set(digests)):
        f = path / name
        if name not in digests:
            raise CheckpointError(f"checkpoint file {f} is not among the files {record} lists: it was added after "
                                  "the save; resume from another checkpoint")
        want = digests[name]
        if name not in names:
            raise CheckpointError(f"checkpoint file {f} is missing; resume from another checkpoint")
        if f.stat().st_size != want["bytes"] or _sha256(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint file {f} does not match the sha256 {record} recorded at save time: "
                                  "it was damaged or replaced; resume from another checkpoint")


def _states(model: nn.Module, optimizer: Optimizer | None) -> dict:
    if optimizer is None:
        msd, _ = get_state_dict(model, [])
        return {"model": msd}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def _unstrided(state):
    """`state` with every DTensor that has a _StridedShard placement replicated over that dimension."""
    if isinstance(state, dict):
        return {k: _unstrided(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_unstrided(v) for v in state]
    if isinstance(state, DTensor) and any(isinstance(p, _StridedShard) for p in state.placements):
        return state.redistribute(placements=[Replicate() if isinstance(p, _StridedShard) else p
                                              for p in state.placements])
    return state


def _restrided(loaded, like):
    """`loaded` (as _unstrided gave it, now read) placed back as `like` is."""
    if isinstance(like, dict):
        return {k: _restrided(loaded[k], v) for k, v in like.items()}
    if isinstance(like, list):
        return [_restrided(a, b) for a, b in zip(loaded, like)]
    if isinstance(like, DTensor) and loaded is not like:
        return loaded.redistribute(placements=like.placements)
    return loaded


def save(path: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None,
         extra: dict | None = None) -> None:
    """Write the model's (and optimizer's) state under directory `path`, every rank its shards;
    `extra`: more state saved alongside (an LR scheduler's state_dict(), a step count)."""
    state = _states(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    dcp.save(_unstrided(state), checkpoint_id=os.fspath(path))


def load(path: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None,
         extra: dict | None = None) -> dict | None:
    """Read a checkpoint written by `save` (under any plan) into the model (and optimizer), each tensor
    resharded to this rank's placement. `extra`: the same keys as saved, filled in and returned."""
    state = _states(model, optimizer)
    if extra is not None:
        state["extra"] = dict(extra)
    readable = _unstrided(state)
    with _own_errors():
        dcp.load(readable, storage_reader=SafeReader(os.fspath(path)), planner=SafePlanner())
    state = _restrided(readable, state)
    set_state_dict(model, [] if optimizer is None else optimizer, model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
    return state.get("extra")


def load_whole(path: str | os.PathLike) -> dict:
    """Every item of a checkpoint written by `save`, whole (unsharded) on CPU, in this process alone
    (no process group): {"model": {name: tensor}, "optimizer": ..., "extra": ...}."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # as torch's dcp_to_torch_save

    state: dict = {}
    with _own_errors():
        _load_state_dict(state, storage_reader=SafeReader(os.fspath(path)), planner=_SafeEmptyPlanner(),
                         no_dist=True)
    return state
