"""Checkpoints of the torch target's script (codegen/torch_target/script.py): Distributed Checkpoint
directories, saved and resumed with the flags meshplan's own runtime takes (--checkpoint-dir,
--save-every, --resume, --resume-from-other-run; runtime/launch/rank_args.parse_args).

Layout under a checkpoint root ROOT (--checkpoint-dir):

    ROOT/step_00000002/               a torch.distributed.checkpoint directory (.metadata, *.distcp):
                                      the model's parameters and persistent buffers under the model's own
                                      names, the optimizer's state, the lr schedule's state and the step
                                      (runtime/torch_stack/dcp.py); every rank writes its own shards
    ROOT/step_00000002/torch_checkpoint.json   rank 0's record (`TorchCheckpoint`), written after every
                                      rank's shards are in place, with the sha256 of every file of the
                                      directory (.metadata and each .distcp)
    ROOT/latest                       the name of the newest complete step directory, replaced atomically
                                      (runtime/files.write_atomic) last: an interrupted save leaves the
                                      previous checkpoint as the one `--resume ROOT` takes
    ROOT/meshplan.lock                rank 0's lock while a run writes ROOT (runtime/checkpoint/dir_lock.py)

Before anything of a checkpoint is read (`checked`: on every rank of train_torch.py, in `meshplan run
--resume` and `meshplan checkpoint show/convert` before any process starts), every file is checked
against those digests, and .metadata is read by an unpickler that builds DCP's metadata types only
(runtime/torch_stack/dcp.py): a damaged or crafted file is refused, named, and nothing in it runs.

The step stored is the next step to run; the data factory is a pure function of data_seed and the step
(runtime/data.py), so the step is the whole data position. DCP reshards every tensor from the saved
shards to the loading rank's placement: a checkpoint saved under one plan (d2 ZeRO-3) resumes under
another (t2, a pipeline) of the same model. Random state is not saved: a model with random ops
(dropout) resumes with another stream than an uninterrupted run.

How this differs from meshplan's own checkpoints (runtime/checkpoint/__init__.py: rank files + manifest.json):
a torch build reads only these DCP directories and meshplan's runtime only its own format; each
refuses the other's checkpoint, saying which build resumes it. Run ids follow meshplan's rules
(runtime/checkpoint/run_ids.py): a new run does not write into a ROOT holding another run's
checkpoints; a run resuming from another run's checkpoint needs --resume-from-other-run.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runtime.checkpoint import TORCH_INFO, TORCH_LATEST, CheckpointError, step_dir, sweep_interrupted_saves
from runtime.checkpoint.run_ids import report_swept, sweep_resumed_root
from runtime.checkpoint.dir_lock import DirLock, Holder
from runtime.files import atomic_file, make_dirs, write_atomic
from runtime.execute.lr_schedule import load_scheduler_state, scheduler_state
from runtime.torch_records import TorchCheckpoint, refuse_meshplan, resolve
from runtime.torch_stack import dcp

# an optimizer group's choice of kernels (torch.optim's foreach / fused flags)
_KERNEL_KEYS = ("foreach", "fused")


def checked(path: str | os.PathLike) -> tuple[Path, TorchCheckpoint]:
    """The torch checkpoint `path` names (as `resolve`) and its record, once every file of it matches the
    digests the record holds and its .metadata is DCP metadata (read without running anything);
    CheckpointError naming the file otherwise."""
    ckpt = resolve(path)
    info = TorchCheckpoint.load(ckpt)
    if info.files:
        dcp.check_digests(ckpt, info.files, str(ckpt / TORCH_INFO))
    dcp.read_metadata(ckpt / dcp.METADATA)
    return ckpt, info


def _owner(root: Path) -> TorchCheckpoint | None:
    """The newest complete checkpoint under `root` (its run owns `root`), or None."""
    latest = root / TORCH_LATEST
    return TorchCheckpoint.load(root / latest.read_text().strip()) if latest.is_file() else None


def run_to_continue(root: str | os.PathLike | None, resumed: TorchCheckpoint | None, *, allow_other_run: bool) -> str:
    """The run id a run continues (a new one for a new run), under runtime/checkpoint/run_ids.py's rules for
    writing into --checkpoint-dir `root`; CheckpointError when they refuse it."""
    fresh = resumed.run_id if resumed is not None else uuid.uuid4().hex[:12]
    if root is None:
        return fresh
    root = Path(root)
    refuse_meshplan(root, "--checkpoint-dir")
    owner = _owner(root)
    if owner is None:
        return fresh
    if resumed is None:
        raise CheckpointError(f"--checkpoint-dir {root} holds the checkpoints of run {owner.run_id} (newest: step "
                              f"{owner.step}); a new run does not write into it: resume that run with --resume {root}, "
                              "or give a new --checkpoint-dir")
    if resumed.run_id != owner.run_id and not allow_other_run:
        raise CheckpointError(f"the resumed checkpoint belongs to run {resumed.run_id}, but --checkpoint-dir {root} "
                              f"holds run {owner.run_id}'s; give a new --checkpoint-dir, or pass "
                              "--resume-from-other-run to continue that run from this state")
    return owner.run_id


@dataclass
class ScriptCheckpoints:
    """One run's checkpointing: where it resumes from, where and how often it saves, its run id, and
    rank 0's lock on --checkpoint-dir. Built by `open_checkpoints` on every rank."""

    root: Path | None
    save_every: int
    resumed: Path | None
    run_id: str
    model_ref: str
    global_batch_size: int
    allow_other_run: bool
    lock: DirLock | None = None

    def claim(self, rank: int) -> None:
        """Rank 0 locks --checkpoint-dir for the run (runtime/checkpoint/dir_lock.py) and checks the rules again under
        the lock; every rank calls it (a collective), takes rank 0's run id (a new run's id is drawn on
        every rank) and raises rank 0's refusal, so that none waits on it."""
        if self.root is None:
            if rank == 0 and self.resumed is not None:
                sweep_resumed_root(self.resumed)
            return
        outcome = [None, self.run_id]
        if rank == 0:
            try:
                self.lock = DirLock.acquire(self.root, Holder.here(self.run_id), "checkpoint directory")
                report_swept(self.root, sweep_interrupted_saves(self.root))
                resumed = TorchCheckpoint.load(self.resumed) if self.resumed is not None else None
                run_to_continue(self.root, resumed, allow_other_run=self.allow_other_run)
            except ValueError as e:
                outcome[0] = str(e)
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            self.release()
            raise CheckpointError(outcome[0])
        self.run_id = outcome[1]

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def due(self, next_step: int, last: bool) -> bool:
        """Whether the run saves after step next_step - 1: after the last step, and every --save-every."""
        return self.root is not None and (last or (self.save_every > 0 and next_step % self.save_every == 0))

    def resume(self, state: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> int:
        """Load the resumed checkpoint into this rank's `state` module (the model, or a pipeline rank's
        stages under the model's names), the optimizer and the lr schedule; returns the step to run next
        (0 without --resume)."""
        if self.resumed is None:
            return 0
        # the kernels this plan steps with (runtime/torch_script.optimizer_for), not the saving plan's: the
        # checkpoint's param_groups carry those, and foreach kernels refuse this plan's mix of DTensors and tensors
        kernels = [{k: g[k] for k in _KERNEL_KEYS if k in g} for g in optimizer.param_groups]
        extra = dcp.load(self.resumed, state, optimizer, {"schedule": scheduler_state(scheduler, optimizer), "step": 0})
        for group, kept in zip(optimizer.param_groups, kernels):
            group.update(kept)
        load_scheduler_state(scheduler, optimizer, extra["schedule"])
        return int(extra["step"])

    def save(self, next_step: int, rank: int, state: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> Path:
        """Every rank writes its shards of the state after step next_step - 1 into ROOT/step_XXXXXXXX;
        then rank 0 completes it (torch_checkpoint.json) and points ROOT/latest at it."""
        ckpt = step_dir(self.root, next_step)
        dcp.save(ckpt, state, optimizer, {"schedule": scheduler_state(scheduler, optimizer), "step": next_step})
        dist.barrier()   # every rank's shards are written before rank 0 calls the checkpoint complete
        if rank == 0:
            info = TorchCheckpoint(next_step, next_step * self.global_batch_size, self.run_id, self.model_ref,
                                   files=dcp.file_digests(ckpt))
            write_atomic(ckpt / TORCH_INFO, json.dumps(info.to_dict(), indent=1).encode())
            write_atomic(self.root / TORCH_LATEST, ckpt.name.encode())
        dist.barrier()
        return ckpt


def open_checkpoints(args, model_ref: str, global_batch_size: int) -> ScriptCheckpoints:
    """The run's checkpointing from the launch options (file checks only, the same on every rank, before
    any communication); CheckpointError for a checkpoint it cannot resume or a directory it must not
    write."""
    resumed, info = checked(args.resume) if args.resume else (None, None)
    if info is not None and info.model_ref != model_ref:
        raise CheckpointError(f"checkpoint {resumed} was saved by a build of {info.model_ref}, not of {model_ref}; "
                              "resume it with a build of that model")
    run_id = run_to_continue(args.checkpoint_dir, info, allow_other_run=args.resume_from_other_run)
    root = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    return ScriptCheckpoints(root, args.save_every, resumed, run_id, model_ref, global_batch_size,
                             args.resume_from_other_run)


def to_state_dict(path: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, TorchCheckpoint, int]:
    """Write a torch checkpoint's model as one plain state_dict file (torch.save; the model's own names,
    whole tensors), once `checked`; as runtime/checkpoint_restore.to_state_dict does for meshplan's own
    checkpoints. Returns (step directory, its record, number of tensors written)."""
    ckpt, info = checked(path)
    sd = dcp.load_whole(ckpt).get("model", {})
    out = Path(out)
    make_dirs(out.parent)
    with atomic_file(out) as f:
        torch.save(sd, f)
    return ckpt, info, len(sd)
