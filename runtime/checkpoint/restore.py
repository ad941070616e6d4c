"""Restore a sharded checkpoint: on the same plan from the rank's own file, on another plan by re-slicing.

The logical state of a checkpoint is the whole model's tensors by their original
names (as in the nn.Module): parameters, buffers and, per parameter, its optimizer
state. `assemble` builds it from every rank's file: tensor-parallel slices are put
back where runtime.parallel.tensor.layers took them from, ZeRO flat shards are
concatenated over the data axis and cut back into parameters. `to_state_dict`
is what `meshplan checkpoint convert` writes; `Restore` slices the logical state
for any other plan (another mesh, pipeline cut, tensor split or ZeRO stage).

Order on a rank (runtime/rank_main.py): `open_restore` and `apply_params` before
the process groups start (every check that can refuse the checkpoint happens
there, the same on every rank), `apply_optimizer` and `apply_rng` once the
optimizer exists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.checkpoint import (CheckpointError, Manifest, layout_hash, optimizer_param_names, read_rank_file,
                                resolve_checkpoint)
from runtime.files import atomic_file, make_dirs
from runtime.execute.lr_schedule import load_scheduler_state
from runtime.execute.optim import optimizer_order
from runtime.reference import local_slice
from runtime.spec import StageSpec


@dataclass
class LogicalState:
    """A checkpoint as whole tensors by the model's own names."""

    step: int
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)  # param name -> state key -> value
    rng: dict[int, torch.Tensor] = field(default_factory=dict)          # old rank -> CPU RNG state
    aliases: dict[str, str] = field(default_factory=dict)               # other name of a tied weight -> canonical
    schedule: dict | None = None                                         # runtime.execute.lr_schedule.scheduler_state
    loss_scale: dict | None = None                                      # the loss scaler's state (any rank's)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under every name the model has for them (a tied weight under
        each of its names, one tensor): what model.load_state_dict(strict=True) reads."""
        sd = {**self.params, **self.buffers}
        sd.update({alias: sd[key] for alias, key in self.aliases.items() if key in sd})
        return sd


def _split_of(specs: dict[int, StageSpec], stage: int, name: str, ndim: int):
    """(dimension, FeatureSplit) of stage `stage`'s tensor `name`, or None (see StageSpec.split_of)."""
    return specs[stage].split_of(name, ndim)


def unshard(name: str, pieces: dict[int, torch.Tensor], split, num: int) -> torch.Tensor:
    """The whole tensor from each tensor rank's slice (the inverse of runtime.reference.local_slice;
    the padding of a padded split is dropped)."""
    p0 = pieces[0]
    if split is None or not isinstance(p0, torch.Tensor) or p0.dim() == 0 or (num == 1 and not split[1].padded(1)):
        return p0
    dim, fs = split
    missing = sorted(set(range(num)) - set(pieces))
    if missing:
        raise CheckpointError(f"{name}: the slices of tensor rank(s) {missing} are missing from the checkpoint")
    shape = list(p0.shape)
    shape[dim] = fs.size
    full = p0.new_empty(shape)
    for t in range(num):
        fs.put(full, dim, t, num, pieces[t])
    return full


def _local(value: Any, split, t: int, num: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return local_slice(value, split, t, num).clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def assemble(ckpt: Path, manifest: Manifest) -> LogicalState:
    """The logical state of a complete checkpoint (reads every rank's file), by the model's
    canonical names (a tied weight once, whichever stages held copies of it)."""
    return assemble_files([read_rank_file(ckpt, r, manifest) for r in range(manifest.world_size)],
                          manifest.mesh, manifest.step)


def assemble_files(files: list[dict], mesh, step: int = 0) -> LogicalState:
    """The logical state of every rank's saved state (a checkpoint's rank files, or the per-step
    records of a --verify run, runtime/verify/step_record.py): tensor-parallel slices joined, ZeRO flat
    shards concatenated over the data axis and cut back into parameters.

    Each file holds "coords", "stage_specs", "params" and "buffers" (stage -> name -> tensor),
    "optimizer" (a state_dict, or None), "optimizer_params" (checkpoint.optimizer_param_names),
    "buckets" and "rng"; "shapes" ("STAGE/NAME" -> local shape) where "params" is empty.
    """
    axes = [a for a, _ in mesh]
    tsize = dict(mesh).get("tensor", 1)
    params: dict[str, dict[int, torch.Tensor]] = {}
    buffers: dict[str, dict[int, torch.Tensor]] = {}
    opt: dict[str, dict[str, dict[int, Any]]] = {}
    splits: dict[str, Any] = {}
    flat: dict[tuple, dict[int, tuple]] = {}   # (coords but data, bucket) -> data coord -> optimizer state
    out = LogicalState(step)
    for r, f in enumerate(files):
        coords = dict(zip(axes, f["coords"]))
        d, t = coords.get("data", 0), coords.get("tensor", 0)
        specs = {int(s): StageSpec.from_dict(json.loads(x)) for s, x in f["stage_specs"].items()}
        for sp in specs.values():
            for grp in sp.shared:
                out.aliases.update({alias: grp[0] for alias in grp[1:]})
        if f.get("rng") is not None:
            out.rng[r] = f["rng"]
        if out.schedule is None and f.get("schedule") is not None:
            out.schedule = f["schedule"]
        if f.get("loss_scale") is not None:
            out.loss_scale = f["loss_scale"]
        local: dict[tuple[int, str], tuple[str, torch.Size]] = {}   # (stage, name) -> (canonical, local shape)
        for entry, shape in f.get("shapes", {}).items():
            s, _, name = entry.partition("/")
            local[(int(s), name)] = (specs[int(s)].canonical(name), torch.Size(shape))
            splits[specs[int(s)].canonical(name)] = _split_of(specs, int(s), name, len(shape))
        for s, named in f["params"].items():
            for name, v in named.items():
                key = specs[int(s)].canonical(name)
                local[(int(s), name)] = (key, v.shape)
                splits[key] = _split_of(specs, int(s), name, v.dim())
                if d == 0:
                    params.setdefault(key, {})[t] = v
        if d == 0:
            for s, named in f["buffers"].items():
                for name, v in named.items():
                    key = specs[int(s)].canonical(name)
                    splits.setdefault(key, _split_of(specs, int(s), name, v.dim()))
                    buffers.setdefault(key, {})[t] = v
        state = (f["optimizer"] or {}).get("state", {})
        for i, entry in enumerate(f["optimizer_params"]):
            kind, _, what = entry.partition("/")
            if kind != "bucket":
                if d == 0:
                    key = local[(int(kind), what)][0]
                    for k, v in state.get(i, {}).items():
                        opt.setdefault(key, {}).setdefault(k, {})[t] = v
                continue
            b = f["buckets"][int(what)]
            group = tuple(c for a, c in coords.items() if a != "data") + (int(what),)
            flat.setdefault(group, {})[d] = (state.get(i, {}), [local[(b["stage"], n)] for n in b["params"]], t)
    for group, by_data in flat.items():
        first_state, names, t = by_data[0]
        for k, v0 in first_state.items():
            if isinstance(v0, torch.Tensor) and v0.dim() >= 1:
                whole = torch.cat([by_data[dd][0][k] for dd in sorted(by_data)])
                off = 0
                for name, shape in names:
                    n = shape.numel()
                    opt.setdefault(name, {}).setdefault(k, {})[t] = whole[off:off + n].view(shape).clone()
                    off += n
            else:
                for name, _ in names:
                    opt.setdefault(name, {}).setdefault(k, {})[t] = v0
    out.params = {n: unshard(n, p, splits.get(n), tsize) for n, p in params.items()}
    out.buffers = {n: unshard(n, p, splits.get(n), tsize) for n, p in buffers.items()}
    out.optimizer = {n: {k: unshard(n, p, splits.get(n), tsize) for k, p in st.items()} for n, st in opt.items()}
    return out


def to_state_dict(path: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, Manifest, int]:
    """Write the checkpoint's model as one plain state_dict file (torch.save; original names).

    `out` is a file path (its directory is created if missing; an existing directory is refused
    before any work). The file is written through runtime/files.py: nothing but `out` is left
    behind, whatever fails. Returns (checkpoint directory, its manifest, number of tensors written).
    """
    out = Path(out)
    if out.is_dir():
        raise CheckpointError(f"-o {out} is a directory; give the state_dict file to write, e.g. {out / 'model.pt'}")
    ckpt = resolve_checkpoint(path)
    man = Manifest.load(ckpt)
    sd = assemble(ckpt, man).state_dict()
    make_dirs(out.parent)
    with atomic_file(out) as f:
        torch.save(sd, f)
    return ckpt, man, len(sd)


@dataclass
class Restore:
    """A checkpoint opened for one rank: its own file (same layout) or the logical state."""

    ckpt: Path
    manifest: Manifest
    own: dict | None = None
    logical: LogicalState | None = None

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def same_layout(self) -> bool:
        return self.own is not None


def open_restore(path: str | os.PathLike, *, rank: int, program, stage_specs: dict, train,
                 signature: str) -> Restore:
    """Open and check a checkpoint for this rank; raises CheckpointError (before any communication)."""
    ckpt = resolve_checkpoint(path)
    man = Manifest.load(ckpt)
    if man.signature != signature:
        raise CheckpointError(f"checkpoint {ckpt} was made for another model (saved from {man.model_ref}, whose "
                              f"tensors differ from those of {train.model_ref} with {train.model_kwargs}); resume "
                              "it only with the model it was saved from")
    for what, have, want in (("optimizer", man.optimizer, train.optimizer.name),
                             ("global batch size", man.global_batch_size, train.global_batch_size),
                             ("data seed", man.data_seed, train.data_seed)):
        if have != want:
            raise CheckpointError(f"checkpoint {ckpt} was saved with {what} {have!r}, this build uses {want!r}; "
                                  f"its optimizer state and data position do not carry over: make the build with "
                                  f"the same {what}")
    if man.world_size == program.world_size and man.layouts.get(rank) == layout_hash(program, stage_specs):
        own = read_rank_file(ckpt, rank, man)
        if own.get("rank") != rank or own.get("step") != man.step:
            raise CheckpointError(f"{ckpt}/rank_{rank:04d}.pt holds rank {own.get('rank')} step {own.get('step')}, "
                                  f"the manifest says rank {rank} step {man.step}")
        return Restore(ckpt, man, own=own)
    return Restore(ckpt, man, logical=assemble(ckpt, man))


def apply_params(r: Restore, modules: dict, stage_specs: dict, tcoord: int, tsize: int) -> None:
    """Overwrite the stage modules' parameters and buffers (before GradSync views them)."""
    with torch.no_grad():
        for s, m in modules.items():
            for kind, named in (("params", m.named_parameters()), ("buffers", m.named_buffers())):
                for name, t in named:
                    if r.own is not None:
                        src = r.own[kind].get(str(s), {}).get(name)
                    else:
                        key = stage_specs[s].canonical(name)
                        whole = (r.logical.params if kind == "params" else r.logical.buffers).get(key)
                        src = None if whole is None else _local(whole, _split_of(stage_specs, s, name, t.dim()),
                                                                tcoord, tsize)
                    if src is None:
                        raise CheckpointError(f"checkpoint {r.ckpt} has no tensor {name!r} (stage {s}); it was "
                                              "saved from another model")
                    if tuple(src.shape) != tuple(t.shape):
                        raise CheckpointError(f"checkpoint {r.ckpt}: {name} is {tuple(src.shape)}, this rank "
                                              f"holds {tuple(t.shape)}")
                    t.copy_(src)


def apply_optimizer(r: Restore, modules: dict, stage_specs: dict, grads, optimizer, tcoord: int,
                    tsize: int) -> None:
    """Load the optimizer state: the saved state_dict (same layout) or one re-sliced from the logical state."""
    if optimizer is None:
        return
    names = optimizer_param_names(modules, grads, optimizer_order(optimizer))
    if r.own is not None:
        if r.own["optimizer_params"] != names:
            raise CheckpointError(f"checkpoint {r.ckpt}: the optimizer's parameters differ from this rank's")
        optimizer.load_state_dict(r.own["optimizer"])
        return
    full = r.logical.optimizer
    state: dict[int, dict] = {}
    if grads is None or not grads.shards:
        params = {f"{s}/{n}": p for s, m in modules.items() for n, p in m.named_parameters()}
        for i, entry in enumerate(names):
            s, _, name = entry.partition("/")
            key = stage_specs[int(s)].canonical(name)
            if key in full:
                split = _split_of(stage_specs, int(s), name, params[entry].dim())
                state[i] = {k: _local(v, split, tcoord, tsize) for k, v in full[key].items()}
    else:
        for st in grads.states:
            i = names.index(f"bucket/{st.index}")   # its place in the optimizer's groups
            spec = stage_specs[st.bucket.stage]
            pnames = list(st.bucket.params)
            keys = [spec.canonical(n) for n in pnames]
            if not pnames or keys[0] not in full:
                continue
            k_len = st.grad_flat.numel() // grads.group.size
            lo = grads.group.rank * k_len
            entry = {}
            for k, v0 in full[keys[0]].items():
                if isinstance(v0, torch.Tensor) and v0.dim() >= 1:
                    flat = torch.cat([_local(full[key][k], _split_of(stage_specs, st.bucket.stage, n, p.dim()), tcoord,
                                             tsize).reshape(-1) for n, key, p in zip(pnames, keys, st.params)])
                    padded = torch.zeros(st.grad_flat.numel(), dtype=flat.dtype)
                    padded[:flat.numel()] = flat
                    entry[k] = padded[lo:lo + k_len].clone()
                else:
                    entry[k] = _local(v0, None, 0, 1)
            state[i] = entry
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def apply_schedule(r: Restore, scheduler, optimizer, schedule) -> None:
    """Continue the lr schedule where the checkpoint left it: the scheduler's state and the groups' lr
    (the same on every rank of the old run; on another plan, taken from any of its ranks that had an
    optimizer). A checkpoint from before schedules were saved carries none: it resumes only a build
    without one (constant lr, no warm-up)."""
    if scheduler is None:
        return
    saved = r.own.get("schedule") if r.own is not None else r.logical.schedule
    if saved is None:
        if not schedule.is_constant:
            raise CheckpointError(f"checkpoint {r.ckpt} holds no lr schedule state, and this build has a "
                                  f"{schedule.kind.value} schedule with {schedule.warmup_steps} warm-up step(s): "
                                  "resume it with the build it was saved from")
        return
    load_scheduler_state(scheduler, optimizer, saved)


def apply_rng(r: Restore, rank: int) -> None:
    """The CPU (and CUDA) RNG state this rank had at the save (same rank of the old run on another plan)."""
    if r.own is not None:
        torch.set_rng_state(r.own["rng"])
        if r.own.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(r.own["cuda_rng"])
    elif rank in r.logical.rng:
        torch.set_rng_state(r.logical.rng[rank])


def apply_loss_scale(r: Restore, scaler) -> None:
    """The fp16 loss scale and growth tracker at the save (every rank saved the same); a checkpoint
    saved without loss scaling leaves `scaler` at its initial scale. No-op without a scaler."""
    if scaler is None:
        return
    state = r.own.get("loss_scale") if r.own is not None else r.logical.loss_scale
    if state is not None:
        scaler.load_state_dict(state)
