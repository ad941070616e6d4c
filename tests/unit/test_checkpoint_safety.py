"""Nothing in a checkpoint runs, nothing is overwritten unasked, and interrupted saves leave nothing behind.

Torch-target checkpoints (Distributed Checkpoints) carry the sha256 of every file and their .metadata is
read by a restricted unpickler: a crafted .metadata whose pickle would create a marker file is refused,
naming the file, by every entry point that runs without ranks (meshplan run --resume, checkpoint show and
convert; train_torch.py's own check is in tests/distributed/test_torch_script_checkpoint.py), and the marker
never appears. `convert` never writes into a checkpoint, nor over an existing file without --force. A save
interrupted by SIGTERM removes its temporary; what a killed save left is swept by the next run that holds
the directory. The MPI failure channel reads signed JSON only.
"""

import contextlib
import hashlib
import io
import json
import pickle
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from planner.app.cli import main
from runtime.checkpoint import MANIFEST, TORCH_INFO, TORCH_LATEST, CheckpointError, sweep_interrupted_saves
from runtime.comm.jobauth import Signer, new_secret
from runtime.torch_script_checkpoint import TorchCheckpoint, checked
from runtime.torch_stack import dcp


class _Payload:
    """Unpickled by plain pickle, creates `marker` (a stand-in for any code a crafted file could run)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _cli(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([str(a) for a in argv])
    return rc, err.getvalue()


def _torch_checkpoint(root: Path, state: dict) -> Path:
    """A torch build's checkpoint root as ScriptCheckpoints.save leaves it: step_00000003 with its record."""
    step = root / "step_00000003"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.save(state, checkpoint_id=str(step), no_dist=True)
    record = TorchCheckpoint(3, 24, "0123456789ab", "m.py:build", files=dcp.file_digests(step))
    (step / TORCH_INFO).write_text(json.dumps(record.to_dict()))
    (root / TORCH_LATEST).write_text(step.name)
    return step


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_crafted_dcp_metadata_is_refused_everywhere_and_runs_nothing(tmp_path):
    root = tmp_path / "ckpt"
    step = _torch_checkpoint(root, {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "extra": {"step": 3}})
    ckpt, info = checked(root)   # an honest checkpoint passes, and converts
    assert (ckpt, sorted(info.files)) == (step, [".metadata", "__0_0.distcp"])
    assert _cli(["checkpoint", "show", root])[0] == 0
    assert _cli(["checkpoint", "convert", root, "-o", tmp_path / "model.pt"])[0] == 0
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["w"], torch.arange(6.0).reshape(2, 3))

    marker = tmp_path / "marker"
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    # the attacker rewrites the record too, so that the digests match: the unpickler is what refuses it
    record = json.loads((step / TORCH_INFO).read_text())
    record["files"] = dcp.file_digests(step)
    (step / TORCH_INFO).write_text(json.dumps(record))
    fake_build = tmp_path / "build"
    fake_build.mkdir()
    (fake_build / "build.json").write_text(json.dumps({"target": "torch", "world_size": 1}))
    for argv in (["checkpoint", "show", root], ["checkpoint", "convert", root, "-o", tmp_path / "m2.pt"],
                 ["run", fake_build, "--resume", root]):
        rc, err = _cli(argv)
        assert rc == 2 and f"checkpoint file {step / '.metadata'} is not a Distributed Checkpoint's metadata" in err \
            and "it refers to io.open" in err, (argv, err)
    assert not marker.exists() and not (tmp_path / "m2.pt").exists()
    # a file changed after the save (record untouched) is named by its digest
    (step / "__0_0.distcp").write_bytes(b"x" + (step / "__0_0.distcp").read_bytes()[1:])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp does not match the sha256 .*torch_checkpoint.json"):
        checked(root)
    (step / TORCH_INFO).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"checkpoint record {step / TORCH_INFO} is damaged"):
        checked(root)
    pickle.loads(pickle.dumps(_Payload(tmp_path / "marker2")))   # the payload does run under plain pickle
    assert (tmp_path / "marker2").exists()


def test_a_crafted_checkpoint_item_is_refused_not_run(tmp_path):
    marker = tmp_path / "marker"
    step = _torch_checkpoint(tmp_path / "ckpt", {"model": {"w": torch.ones(2)}, "extra": {"evil": _Payload(marker)}})
    with pytest.raises(CheckpointError, match="checkpoint item extra.evil is not plain data"):
        dcp.load_whole(step)
    assert not marker.exists()


def test_convert_writes_neither_into_a_checkpoint_nor_over_a_file(tmp_path):
    step = tmp_path / "ckpt" / "step_00000001"
    step.mkdir(parents=True)
    shard = step / "rank_0000.pt"
    shard.write_bytes(b"the state rank 0 saved")
    (step / MANIFEST).write_text("{}")
    before = {p: _sha(p) for p in (shard, step / MANIFEST)}
    for out in (shard, step / "new.pt", tmp_path / "ckpt" / "model.pt"):
        for force in ([], ["--force"]):
            rc, err = _cli(["checkpoint", "convert", step, "-o", out, *force])
            assert rc == 2 and f"-o {out} is inside the checkpoint directory" in err, err
    assert {p: _sha(p) for p in before} == before and sorted(p.name for p in step.iterdir()) == [MANIFEST, shard.name]
    existing = tmp_path / "model.pt"
    existing.write_bytes(b"mine")
    rc, err = _cli(["checkpoint", "convert", step, "-o", existing])
    assert rc == 2 and f"-o {existing} exists; pass --force to replace it" in err and existing.read_bytes() == b"mine"
    # the same rule for the other commands that write a file a user may have
    mine = tmp_path / "cluster.yaml"
    mine.write_text("mine")
    rc, err = _cli(["cluster", "local", "-o", mine])
    assert rc == 2 and "exists; pass --force" in err and mine.read_text() == "mine"
    assert _cli(["cluster", "local", "-o", mine, "--force"])[0] == 0 and "mine" not in mine.read_text()
    rc, err = _cli(["codegen", "examples/models/mlp.py:build", "--batch", "4", "-o", tmp_path])
    assert rc == 2 and "a directory with other files than a meshplan build" in err


def test_the_next_run_sweeps_what_interrupted_saves_left(tmp_path):
    root = tmp_path / "ckpt"
    done, killed, torch_done = root / "step_00000002", root / "step_00000004", root / "step_00000006"
    for d in (done, killed, torch_done):
        d.mkdir(parents=True)
    (done / MANIFEST).write_text("{}")
    (torch_done / TORCH_INFO).write_text("{}")
    (killed / "rank_0000.pt").write_bytes(b"complete shard of a save that never finished")
    left = [done / ".rank_0001.pt.a1b2c3d4.tmp", root / ".latest.zz_9y8x7.tmp", torch_done / ".metadata.tmp",
            torch_done / "__1.metadata.tmp"]
    for f in left:
        f.write_bytes(b"partial")
    keep = [done / MANIFEST, torch_done / TORCH_INFO, root / "notes.tmp", root / "meshplan.lock"]
    for f in keep[2:]:
        f.write_text("the user's")
    removed = sweep_interrupted_saves(root)
    assert sorted(removed) == sorted([killed, *left])
    assert all(f.exists() for f in keep) and not any(f.exists() for f in [killed, *left])


_SIGTERM_MID_WRITE = """
import os, signal, sys
from runtime.files import write_atomic
from runtime.lifetime import Terminated, die_of, raise_on_terminate
raise_on_terminate()
try:
    write_atomic(sys.argv[1], b"x" * 1000, interrupt=lambda: os.kill(os.getpid(), signal.SIGTERM))
except Terminated as e:
    die_of(e.signum, "stopped")
"""


def test_sigterm_in_the_middle_of_a_write_removes_the_temporary(tmp_path):
    target = tmp_path / "rank_0000.pt"
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_MID_WRITE, str(target)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert list(tmp_path.iterdir()) == [], "neither the file nor its temporary"


def test_the_mpi_failure_channel_takes_signed_json_only(capsys):
    from runtime.comm.mpi import MpiCommunicator

    secret = new_secret()
    comm = MpiCommunicator.__new__(MpiCommunicator)   # the message check needs no MPI
    comm.rank, comm.signer = 1, Signer(secret)
    signed = Signer(secret).sign(json.dumps({"reason": "rank 0 failed: out of memory"})).encode()
    assert comm._abort_message(signed) == "rank 0 failed: out of memory"
    forged = [pickle.dumps("rank 0 failed"), Signer(new_secret()).sign(json.dumps({"reason": "x"})).encode(),
              Signer(secret).sign(json.dumps(["not", "a", "reason"])).encode(), b"\xff\xfe"]
    assert [comm._abort_message(m) for m in forged] == [None] * 4
    assert capsys.readouterr().err.count("ignored a failure message on the MPI abort channel") == 4
