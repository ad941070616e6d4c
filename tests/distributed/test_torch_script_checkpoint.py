"""Checkpoints of the torch target's script (runtime/torch_script_checkpoint.py): a Distributed Checkpoint
saved under one plan resumes under another and continues exactly, and each runtime refuses the other's
checkpoints.

One launch set: the example GPT's torch build at data 2 ZeRO-3 runs 2 steps and saves; its torch build at
tensor 2 resumes for step 2 through `meshplan run --resume --verify` (runtime/verify/__init__.py: step 2's loss,
gradients and norm from the resumed parameters, then the final parameters against the single-process
run's 3 steps).
"""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from runtime.checkpoint import MANIFEST, TORCH_INFO, TORCH_LATEST, CheckpointError, resolve_checkpoint
from planner.app.cli import main
from runtime.launch.launcher import run_many
from runtime.launch.rank_args import parse_args
from runtime.torch_script_checkpoint import TorchCheckpoint, open_checkpoints
from tests.distributed.test_torch_script import GPT, emit_torch_fixed
from tests.real_models import CONFIGS


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the checkpoint root the d2 ZeRO-3 build saved after 2 steps, the t2 build's directory)."""
    root = tmp_path_factory.mktemp("torch_ckpt")
    ckpt = root / "ckpt"
    zero3 = emit_torch_fixed(root, "gpt_d2_zero3", GPT, {}, CONFIGS["d2_zero3"])
    first, = run_many([zero3], steps=2, timeout=60, extra_args=["--checkpoint-dir", str(ckpt)])
    assert first.returncode == 0, first.output[-4000:]
    return ckpt, emit_torch_fixed(root, "gpt_t2", GPT, {}, CONFIGS["t2"])


def test_checkpoint_of_one_plan_resumes_under_another_exactly(saved, capsys):
    ckpt, tensor = saved
    assert (ckpt / TORCH_LATEST).read_text() == "step_00000002"
    info = TorchCheckpoint.load(ckpt / "step_00000002")
    assert (info.step, info.samples, info.model_ref) == (2, 16, GPT)   # 2 steps of a global batch of 8
    capsys.readouterr()
    assert main(["run", str(tensor), "--steps", "1", "--verify", "--quiet", "--resume", str(ckpt)]) == 0
    assert "verify against the single-process reference: OK: 1 step(s)" in capsys.readouterr().out
    record = json.loads((tensor / "run" / "rank_0001.json").read_text())
    assert (record["first_step"], len(record["losses"]), record["resumed_from"]) == (2, 1, str(ckpt / "step_00000002"))


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_metadata_stops_train_torch_before_anything_runs(saved, tmp_path):
    """The digests of every file are recorded at save time; the generated script refuses a .metadata crafted
    to run code (the record rewritten to match it) on every rank before any rendezvous, and runs nothing."""
    from runtime.torch_stack.dcp import file_digests

    ckpt, tensor = saved
    step = ckpt / "step_00000002"
    assert set(TorchCheckpoint.load(step).files) == {".metadata", "__0_0.distcp", "__1_0.distcp"} \
        and TorchCheckpoint.load(step).files == file_digests(step)
    crafted = tmp_path / "crafted"
    shutil.copytree(step, crafted)
    marker = tmp_path / "marker"
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    record = json.loads((crafted / TORCH_INFO).read_text())
    (crafted / TORCH_INFO).write_text(json.dumps({**record, "files": file_digests(crafted)}))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    for rank in (1,):   # every rank runs the same check before the rendezvous; one interpreter keeps it cheap
        proc = subprocess.run([sys.executable, str(tensor / "train_torch.py"), "--steps", "1", "--resume", str(crafted)],
                              env={**env, "RANK": str(rank), "WORLD_SIZE": "2"}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and f"meshplan rank {rank}: error: checkpoint file {crafted / '.metadata'} is not a " \
            "Distributed Checkpoint's metadata" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


def test_meshplan_runtime_refuses_a_torch_checkpoint(saved):
    ckpt, _ = saved
    for path in (ckpt, ckpt / "step_00000002"):
        with pytest.raises(CheckpointError, match="Distributed Checkpoint of a torch build"):
            resolve_checkpoint(path)


def test_torch_build_refuses_a_meshplan_runtime_checkpoint(tmp_path):
    step = tmp_path / "ckpt" / "step_00000003"
    step.mkdir(parents=True)
    (step / MANIFEST).write_text(json.dumps({"step": 3}))
    for path in (step, step.parent):
        args = parse_args(["--resume", str(path)], str(tmp_path))
        with pytest.raises(CheckpointError, match="meshplan codegen without --target torch"):
            open_checkpoints(args, GPT, 8)
    args = parse_args(["--checkpoint-dir", str(step.parent)], str(tmp_path))
    with pytest.raises(CheckpointError, match="checkpoint of meshplan's own runtime"):
        open_checkpoints(args, GPT, 8)


def test_a_checkpoint_directory_holds_one_run(saved, tmp_path):
    ckpt, _ = saved
    owner = TorchCheckpoint.load(ckpt / "step_00000002").run_id
    with pytest.raises(CheckpointError, match=f"holds the checkpoints of run {owner}.*--resume {ckpt}"):
        open_checkpoints(parse_args(["--checkpoint-dir", str(ckpt)], str(tmp_path)), GPT, 8)
    resumed = open_checkpoints(parse_args(["--resume", str(ckpt), "--checkpoint-dir", str(ckpt)], str(tmp_path)),
                               GPT, 8)
    assert (resumed.run_id, resumed.resumed) == (owner, ckpt / "step_00000002")
    other = tmp_path / "other"                   # another run's checkpoint root
    (other / "step_00000005").mkdir(parents=True)
    (other / "step_00000005" / TORCH_INFO).write_text(json.dumps(TorchCheckpoint(5, 40, "0123456789ab", GPT).to_dict()))
    (other / TORCH_LATEST).write_text("step_00000005")
    argv = ["--resume", str(ckpt), "--checkpoint-dir", str(other)]
    with pytest.raises(CheckpointError, match="pass --resume-from-other-run"):
        open_checkpoints(parse_args(argv, str(tmp_path)), GPT, 8)
    assert open_checkpoints(parse_args([*argv, "--resume-from-other-run"], str(tmp_path)), GPT, 8).run_id \
        == "0123456789ab"
    with pytest.raises(CheckpointError, match="saved by a build of examples/models/gpt.py:build, not of m.py:build"):
        open_checkpoints(parse_args(["--resume", str(ckpt)], str(tmp_path)), "m.py:build", 8)
