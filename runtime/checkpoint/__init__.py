"""Sharded checkpoints: every rank saves and restores only its own state.

Layout under a checkpoint root (`--checkpoint-dir`):

    ROOT/step_00000003/rank_0000.pt     rank 0's parameters (its stages, its tensor-parallel
                                        slices), buffers, optimizer state (whole parameters, or
                                        its flat ZeRO shards), RNG state and the data position
    ROOT/step_00000003/rank_0000.json   sha256 and size of rank_0000.pt, and its layout hash
    ROOT/step_00000003/manifest.json    written last, by rank 0, once every rank's file is in place

    ROOT/meshplan.lock                  rank 0's lock while a run writes ROOT (runtime/checkpoint/run_ids.py)

Every file is written through runtime/files.py: an exclusive temporary with an
unpredictable name, fsync'ed and renamed over its final name (os.replace is
atomic), so a crash in the middle of a save leaves at most a temporary file and
a step directory without a manifest: a checkpoint is complete iff its manifest
exists, and `resolve_checkpoint(ROOT)` takes the newest complete one. Earlier
checkpoints are never touched by a later save. A save that fails with an error
(a full disk, a file-size limit) removes what it wrote: each rank its own files
(and the step directory once it is empty), rank 0 the whole step directory if
the manifest cannot be written; the error names the file and the cause.

Each manifest records the run id of the run that saved it (runtime/checkpoint/run_ids.py
says what "the same run" means and when a run may write into ROOT).

The step stored is the next step to run: a checkpoint saved after steps 0..2
holds step 3, and a resumed run continues with step 3's batch (the data
factory is a pure function of data_seed + step, so the step is the whole
data position; the manifest also records the samples consumed).

Restoring on the same plan (every rank's layout hash unchanged) reads only the
rank's own file and is bit-exact. Restoring on another plan goes through the
model's logical state (runtime/checkpoint_reshard.py): whole tensors by the
original module names, re-sliced for the new layout.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from runtime.files import write_atomic
from runtime.execute.lr_schedule import scheduler_state
from runtime.execute.optim import optimizer_order
from runtime.documents import read_document

CHECKPOINT_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# a torch build's checkpoints (runtime/torch_script_checkpoint.py): ROOT/latest, and a record in each step directory
TORCH_LATEST = "latest"
TORCH_INFO = "torch_checkpoint.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# what a save writes before it is complete: runtime/files.py's temporaries (.NAME.XXXXXXXX.tmp) and DCP's
# metadata temporaries (.metadata.tmp, __R.metadata.tmp)
_TEMPORARY = re.compile(r"^(\..+|__\d+\.metadata)\.tmp$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged, or made for another model or setup."""


# ---- files ------------------------------------------------------------------------------------


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Step directories under `root` that have a manifest, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in root.iterdir()
             if (m := _STEP_DIR.match(d.name)) and (d / MANIFEST).is_file()]
    return [d for _, d in sorted(found)]


def is_torch_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a torch build's checkpoint (a step directory with its record, or a root with latest)."""
    p = Path(path)
    return (p / TORCH_LATEST).is_file() or (p / TORCH_INFO).is_file()


def enclosing_checkpoint(path: str | os.PathLike) -> Path | None:
    """The checkpoint directory (a step directory or a --checkpoint-dir root, of either runtime) that `path`
    lies in or is, or None: nothing is ever written there but by a run."""
    p = Path(path).expanduser().resolve()
    for d in [p, *p.parents]:
        try:
            if d.is_dir() and (_STEP_DIR.match(d.name) or any((d / f).is_file() for f in (MANIFEST, TORCH_INFO,
                                                                                          TORCH_LATEST))
                               or any(_STEP_DIR.match(c.name) and c.is_dir() for c in d.iterdir())):
                return d
        except OSError:   # a directory we may not list holds no checkpoint of ours
            continue
    return None


def sweep_interrupted_saves(root: str | os.PathLike) -> list[Path]:
    """Remove what interrupted saves left under the checkpoint root `root`, and return it: temporaries in
    `root` and in its step directories, and step directories that never became complete (neither a manifest
    nor a torch build's record: a save killed before its end). Only a run holding `root`'s lock may call it
    (runtime/checkpoint/run_ids.py): then no save is in progress there."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for d in [root, *(c for c in root.iterdir() if c.is_dir() and _STEP_DIR.match(c.name))]:
        if d != root and not (d / MANIFEST).is_file() and not (d / TORCH_INFO).is_file():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            continue
        for f in d.iterdir():
            if f.is_file() and _TEMPORARY.match(f.name):
                f.unlink(missing_ok=True)
                removed.append(f)
    return removed


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory: `path` itself if it has a manifest, else the newest complete one under it."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} does not exist; give a checkpoint directory (step_XXXXXXXX) "
                              "or the --checkpoint-dir of an earlier run")
    if is_torch_checkpoint(p):
        raise CheckpointError(f"{p} is a Distributed Checkpoint of a torch build (meshplan codegen --target torch); "
                              "meshplan's runtime reads its own checkpoints only: resume it with a torch build of "
                              "the model, or start this build without --resume")
    done = complete_checkpoints(p)
    if done:
        return done[-1]
    partial = sorted(d.name for d in p.iterdir() if _STEP_DIR.match(d.name))
    if _STEP_DIR.match(p.name):
        raise CheckpointError(f"checkpoint {p} has no {MANIFEST}: its save was interrupted; resume from an "
                              "earlier checkpoint of the same run")
    raise CheckpointError(f"{p} holds no complete checkpoint"
                          + (f" ({', '.join(partial)} have no {MANIFEST}: their save was interrupted)" if partial
                             else "") + "; run with --checkpoint-dir to make one")


# ---- manifest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds and what it was made for.

    step: the next step to run; samples: samples consumed (step x global batch).
    signature: runtime.materialize.model_signature of the model; layouts: rank -> layout hash
    (mesh, coordinates, stages, shards, buckets, ZeRO); files: rank -> {"sha256", "bytes"}.
    """

    step: int
    world_size: int
    mesh: tuple[tuple[str, int], ...]
    signature: str
    model_ref: str
    optimizer: str
    global_batch_size: int
    data_seed: int
    layouts: dict[int, str]
    files: dict[int, dict]
    format_version: int = CHECKPOINT_FORMAT_VERSION
    run_id: str = ""                # the run that saved it ("": saved before run ids existed)

    @property
    def samples(self) -> int:
        return self.step * self.global_batch_size

    def to_dict(self) -> dict:
        return {"format_version": self.format_version, "step": self.step, "samples": self.samples,
                "world_size": self.world_size, "mesh": [list(m) for m in self.mesh], "signature": self.signature,
                "model_ref": self.model_ref, "optimizer": self.optimizer,
                "global_batch_size": self.global_batch_size, "data_seed": self.data_seed,
                "layouts": {str(r): h for r, h in self.layouts.items()},
                "files": {str(r): f for r, f in self.files.items()}, "run_id": self.run_id}

    @classmethod
    def load(cls, ckpt: Path) -> "Manifest":
        try:
            d = json.loads((ckpt / MANIFEST).read_text())
            version = d.get("format_version")
            if version != CHECKPOINT_FORMAT_VERSION:
                raise CheckpointError(f"{ckpt / MANIFEST}: format_version {version!r} is not supported "
                                      f"(this runtime reads {CHECKPOINT_FORMAT_VERSION})")
            m = cls(step=int(d["step"]), world_size=int(d["world_size"]),
                    mesh=tuple((str(a), int(s)) for a, s in d["mesh"]), signature=str(d["signature"]),
                    model_ref=str(d["model_ref"]), optimizer=str(d["optimizer"]),
                    global_batch_size=int(d["global_batch_size"]), data_seed=int(d["data_seed"]),
                    layouts={int(r): str(h) for r, h in d["layouts"].items()},
                    files={int(r): {"sha256": str(f["sha256"]), "bytes": int(f["bytes"])}
                           for r, f in d["files"].items()}, run_id=str(d.get("run_id", "")))
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{ckpt / MANIFEST} is damaged ({type(e).__name__}: {e}); "
                                  "resume from another checkpoint") from None
        if sorted(m.files) != list(range(m.world_size)) or sorted(m.layouts) != list(range(m.world_size)):
            raise CheckpointError(f"{ckpt / MANIFEST} lists ranks {sorted(m.files)}, not 0..{m.world_size - 1}")
        return m


def read_rank_file(ckpt: Path, rank: int, manifest: Manifest) -> dict:
    """One rank's saved state, checked against the manifest's size and sha256."""
    path = ckpt / f"rank_{rank:04d}.pt"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({e.strerror})") from None
    want = manifest.files[rank]
    if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise CheckpointError(f"checkpoint file {path} does not match its manifest (size or sha256 differ): "
                              "it was damaged or overwritten; resume from another checkpoint")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever a crafted file raises: refused, nothing in it runs
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint file {path} is not a rank's saved state ({first}); it was damaged or "
                              "replaced: resume from another checkpoint") from None


def check_rank_files(ckpt: Path) -> Manifest:
    """Every rank file of checkpoint `ckpt` against its manifest and readable as plain data (read_rank_file):
    what `meshplan run --resume` checks before any rank starts; returns the manifest."""
    manifest = Manifest.load(ckpt)
    for rank in range(manifest.world_size):
        read_rank_file(ckpt, rank, manifest)
    return manifest


# ---- what a rank saves --------------------------------------------------------------------------


def layout_hash(program, stage_specs: dict) -> str:
    """Everything that decides which slice of which tensor this rank holds, hashed."""
    d = program.to_dict()
    key = {"mesh": d["mesh"], "coords": d["coords"], "stages": d["stages"], "zero": d["zero"],
           "buckets": d["buckets"], "specs": {str(s): stage_specs[s].to_dict() for s in sorted(stage_specs)}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def optimizer_param_names(modules: dict, grads, order: list | None = None) -> list[str]:
    """What each optimizer parameter is, in optimizer order: "STAGE/NAME", or "bucket/I" (ZeRO shards).

    Mirrors GradSync.optimizer_params and rank_main.connect's parameter list; `order`: the
    optimizer's own parameter order (runtime.execute.optim.optimizer_order: its weight-decay groups one
    after the other), which the names then follow.
    """
    if grads is not None and grads.shards:
        out = [(f"bucket/{st.index}", st.shard) for st in grads.states]
    else:
        out, seen = [], set()
        for s in sorted(modules):
            for name, p in modules[s].named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{s}/{name}", p))
    if order:
        rank = {id(p): k for k, p in enumerate(order)}
        out.sort(key=lambda e: rank[id(e[1])])
    return [name for name, _p in out]


@dataclass
class RankState:
    """The pieces of a running rank a checkpoint reads and writes."""

    rank: int
    program: object                 # runtime.program.Program
    stage_specs: dict               # stage -> StageSpec
    modules: dict                   # stage -> nn.Module
    train: object                   # runtime.spec.TrainSpec
    signature: str
    grads: object = None            # GradSync or None
    optimizer: torch.optim.Optimizer | None = None
    barrier: Callable[[], None] = field(default=lambda: None)
    scheduler: object = None        # the optimizer's lr scheduler (runtime/execute/lr_schedule.py) or None
    run_id: str = ""                # rank 0: the run id its manifests record (runtime/checkpoint/run_ids.py)
    loss_scale: dict | None = None  # the fp16 loss scaler's state (runtime/execute/loss_scale.py), the same on every rank


def _order(optimizer) -> list | None:
    return optimizer_order(optimizer) if optimizer is not None else None


def save_checkpoint(root: str | os.PathLike, step: int, st: RankState, *,
                    interrupt: Callable[[], None] | None = None) -> Path:
    """Save this rank's state as checkpoint `step` (the next step to run); every rank calls it.

    Collective: ranks meet at a barrier once their files are in place, then rank 0
    writes the manifest. Returns the checkpoint directory. On an error (WriteError for a
    file that cannot be written, or a peer's failure at the barrier) this rank removes the
    files it wrote before re-raising; see the module docstring.
    """
    ckpt = step_dir(root, step)
    grads = st.grads
    if grads is not None:   # ZeRO-3: full (tensor-parallel local) parameters exist only in use
        grads.gather_all()
    state = {
        "format_version": CHECKPOINT_FORMAT_VERSION, "rank": st.rank, "step": step,
        "mesh": [list(m) for m in st.program.mesh], "coords": list(st.program.coords),
        "zero": st.program.zero, "buckets": [{"stage": b.stage, "params": list(b.params)} for b in st.program.buckets],
        "stage_specs": {str(s): json.dumps(st.stage_specs[s].to_dict()) for s in sorted(st.stage_specs)},
        "params": {str(s): {k: v.detach().cpu().clone() for k, v in m.named_parameters()}
                   for s, m in st.modules.items()},
        "buffers": {str(s): {k: v.detach().cpu().clone() for k, v in m.named_buffers()}
                    for s, m in st.modules.items()},
        "optimizer": st.optimizer.state_dict() if st.optimizer is not None else None,
        "optimizer_params": optimizer_param_names(st.modules, grads, _order(st.optimizer)),
        "schedule": scheduler_state(st.scheduler, st.optimizer) if st.scheduler is not None else None,
        "loss_scale": st.loss_scale,
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    if grads is not None:
        grads.release_params()
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    layout = layout_hash(st.program, st.stage_specs)
    own = [ckpt / f"rank_{st.rank:04d}.pt", ckpt / f"rank_{st.rank:04d}.json"]
    try:
        # make_parent: a peer whose own write failed removes the directory while it is empty
        write_atomic(own[0], data, interrupt=interrupt, make_parent=True)
        write_atomic(own[1], json.dumps(
            {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "layout": layout}).encode())
        st.barrier()
    except BaseException:
        # Other ranks may still be writing into ckpt: remove only this rank's files; the last
        # rank out removes the then empty directory.
        _discard(own, ckpt)
        raise
    if st.rank == 0:
        try:
            _write_manifest(ckpt, step, st)
        except BaseException:
            # Past the barrier every rank's files are in place and nobody writes here any more.
            shutil.rmtree(ckpt, ignore_errors=True)
            raise
    return ckpt


def _write_manifest(ckpt: Path, step: int, st: RankState) -> None:
    world = st.program.world_size
    sides = {}
    for r in range(world):
        f = ckpt / f"rank_{r:04d}.json"
        if not f.is_file():
            raise CheckpointError(f"rank {r} did not write {f.name} before the barrier")
        sides[r] = read_document(f, "checkpoint rank record", error=CheckpointError)
    tr = st.train
    man = Manifest(step=step, world_size=world, mesh=tuple(st.program.mesh), signature=st.signature,
                   model_ref=tr.model_ref, optimizer=tr.optimizer.name, global_batch_size=tr.global_batch_size,
                   data_seed=tr.data_seed, layouts={r: s["layout"] for r, s in sides.items()},
                   files={r: {"sha256": s["sha256"], "bytes": s["bytes"]} for r, s in sides.items()},
                   run_id=st.run_id)
    write_atomic(ckpt / MANIFEST, json.dumps(man.to_dict(), indent=1).encode())


def _discard(files: list[Path], ckpt: Path) -> None:
    """Remove `files` (those that exist), then `ckpt` if nothing else is left in it."""
    for f in files:
        try:
            f.unlink()
        except OSError:
            pass
    try:
        ckpt.rmdir()
    except OSError:  # other ranks' files are still there (they remove them), or it was never made
        pass
