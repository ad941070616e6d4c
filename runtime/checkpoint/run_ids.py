"""Which run a checkpoint directory belongs to, and the lock that lets one run at a time write it.

What "the same run" means: a run is one training history. It gets a run id (12 hex digits,
random) when it starts without --resume; every checkpoint it saves records that id in its
manifest; a run that resumes from one of those checkpoints continues the same id, whichever
plan or launcher it uses. A checkpoint directory (--checkpoint-dir) belongs to the run of its
newest complete checkpoint (its manifest's run_id; checkpoints made before run ids existed have
the empty id, and count as one unnamed run).

The rules, checked before a run writes into a checkpoint directory ROOT:

* a run that does not resume may write only into a ROOT without complete checkpoints (a new run
  would mix its checkpoints with another run's, and `--resume ROOT` would then pick whichever is
  newest);
* a run that resumes from a checkpoint of ROOT's run continues that run in ROOT;
* a run that resumes from another run's checkpoint is refused unless it is given
  --resume-from-other-run; it then continues ROOT's run (ROOT's checkpoints keep one run id;
  its state came from elsewhere). Into an empty ROOT it continues the resumed checkpoint's run.

Every rank checks the rules while it prepares (before any communication: a refusal is the same
clear error on every rank). Rank 0 then takes ROOT's lock (runtime/checkpoint/dir_lock.py) for the whole run,
checks again under the lock (nothing can have changed since), and records the run id and itself
in the lock file. Only rank 0 takes it because only rank 0 completes a checkpoint (the manifest)
and the other ranks write their shards into ROOT only inside a collective save with their rank 0;
one lock per run also works for rank scripts started directly (torchrun, srun, mpirun), where no
`meshplan run` holds the build's lock. A second run into ROOT is refused at its rank 0 naming the
first run (run id, host, pid, start), and its other ranks stop with that reason.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass

import sys
from pathlib import Path

from runtime.checkpoint import CheckpointError, Manifest, complete_checkpoints, sweep_interrupted_saves
from runtime.checkpoint.dir_lock import DirLock, DirectoryBusy, Holder


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _describe(run_id: str) -> str:
    return f"run {run_id}" if run_id else "an unnamed run (saved before run ids existed)"


def run_to_continue(root: str | os.PathLike, resumed: Manifest | None, resumed_from: str | os.PathLike | None,
                    *, allow_other_run: bool) -> str | None:
    """The run id a run writing checkpoints into `root` continues, or None for a new run.

    `resumed` is the manifest of the checkpoint the run resumes from (None: it does not), found
    at `resumed_from`. Raises CheckpointError when the rules above refuse the run.
    """
    done = complete_checkpoints(root)
    if not done:
        return resumed.run_id if resumed is not None else None
    newest = done[-1]
    if resumed is None:
        raise CheckpointError(
            f"--checkpoint-dir {root} holds the checkpoints of another run ({newest.name} and "
            f"{len(done) - 1} earlier); a new run does not write into it: resume that run with --resume {root}, "
            "or give a new --checkpoint-dir (or remove the old checkpoints)")
    owner = Manifest.load(newest).run_id
    if resumed.run_id == owner:
        return owner
    if allow_other_run:
        return owner
    raise CheckpointError(
        f"checkpoint {resumed_from} belongs to {_describe(resumed.run_id)}, but --checkpoint-dir {root} holds the "
        f"checkpoints of {_describe(owner)} (newest {newest.name}); resuming from another run's checkpoint into it "
        "would mix two runs: give a new --checkpoint-dir, or pass --resume-from-other-run to continue "
        f"{_describe(owner)} from that state")


@dataclass
class CheckpointClaim:
    """Rank 0's hold on a checkpoint directory for one run: the lock and the run id it saves under."""

    lock: DirLock
    run_id: str

    def release(self) -> None:
        self.lock.release()


def claim_checkpoint_dir(root: str | os.PathLike, resumed: Manifest | None,
                         resumed_from: str | os.PathLike | None, *, allow_other_run: bool) -> CheckpointClaim:
    """Lock `root` for this run and decide its run id (a new one for a new run); rank 0 calls it.

    Raises DirectoryBusy (another live run holds `root`) or CheckpointError (the rules refuse it).
    """
    lock = DirLock.acquire(root, Holder.here(), "checkpoint directory")
    try:
        report_swept(root, sweep_interrupted_saves(root))
        run_id = run_to_continue(root, resumed, resumed_from, allow_other_run=allow_other_run) or new_run_id()
        lock.update(dataclasses.replace(lock.holder, run_id=run_id))
    except BaseException:
        lock.release()
        raise
    return CheckpointClaim(lock, run_id)



def report_swept(root: str | os.PathLike, removed: list) -> None:
    if removed:
        print(f"meshplan rank 0: removed what an interrupted save left in {root}: "
              + ", ".join(Path(p).name for p in removed), file=sys.stderr, flush=True)


def sweep_resumed_root(resumed: str | os.PathLike) -> None:
    """After --resume without --checkpoint-dir (rank 0): sweep the resumed checkpoint's root, unless a run
    holds it (that run's own saves may be in progress there)."""
    root = Path(resumed)
    root = root.parent if root.name.startswith("step_") else root
    try:
        lock = DirLock.acquire(root, Holder.here(), "checkpoint directory")
    except (DirectoryBusy, OSError, ValueError):
        return
    try:
        report_swept(root, sweep_interrupted_saves(root))
    finally:
        lock.release()
