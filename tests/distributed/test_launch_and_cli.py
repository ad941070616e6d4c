"""The generated build runs through its own launch script (torchrun, its store listening on loopback only),
and `meshplan codegen` / `meshplan run --verify` work end to end."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner.app.cli import main
from runtime.verify import verify_build
from runtime.program.trace import Timeline
from runtime.vocab import MeshAxis
from tests.parallel_cases import CONFIGS, emit_case

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from listening_sockets import listening, reaches_beyond_loopback  # noqa: E402


def test_torchrun_launch_script_trains_and_matches_reference(tmp_path):
    build = emit_case(tmp_path, "gpt", "t2", CONFIGS["t2"])
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHRUN=str(torchrun))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    # its listening sockets, read from /proc while it runs: one node's torchrun store is on loopback only
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(["bash", str(build / "launch_torchrun.sh"), "--steps", "3", "--save-params",
                                 "--save-steps", "--timeout", "60"], cwd=tmp_path, env=env, stdout=o, stderr=e,
                                start_new_session=True)
        seen, deadline = set(), time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= listening(proc.pid)
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert any(name == "pt_elastic" for name, *_ in seen), f"torchrun's store was seen listening: {sorted(seen)}"
    assert not [s for s in seen if reaches_beyond_loopback(s[1], s[3])], sorted(seen)
    metrics = [json.loads(x) for x in (build / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    losses = {r: json.loads((build / "run" / f"rank_{r:04d}.json").read_text())["losses"] for r in range(2)}
    cmp = verify_build(build, 3, losses)
    assert cmp.ok, cmp.summary()
    assert metrics[-1]["loss"] == losses[0][-1]
    # under a launch script rank 0 draws the progress (plain lines: its output is not a terminal)
    assert "step 2 (3/3, 100%)" in stdout + stderr


def test_build_directory_is_readable_and_complete(tmp_path):
    build = emit_case(tmp_path, "gpt", "d2t2p2", CONFIGS["d2t2p2"])
    names = {p.name for p in build.iterdir()}
    assert {"plan.json", "build.json", "programs.json", "run_rank.py", "launch_torchrun.sh", "launch_mpirun.sh",
            "launch_srun.sh"} <= names
    assert sum(n.startswith("rank_") for n in names) == 8
    text = (build / "rank_0005.py").read_text()
    # its stage's forward as Python, its process groups, its Program
    assert "class Stage1(torch.nn.Module)" in text and "def layer_blocks_1(self" in text
    assert f"GROUPS = {{'{MeshAxis.PIPELINE}': [1, 5], 'data': [5, 7], 'tensor': [4, 5]}}" in text
    assert "#   B s1 m0" in text and "PROGRAM = {" in text
    # the split qkv's heads: the example GPT writes the count as -1, inferred from the local features
    assert "unflatten(-1, (3, -1, 8))" in text
    srun = (build / "launch_srun.sh").read_text()
    assert os.access(build / "launch_srun.sh", os.X_OK) and "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=8" in srun


def test_cli_codegen_then_run_verify(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "build"
    assert main(["codegen", "examples/models/mlp.py:build", "--batch", "8", "--data", "2", "--micro-batch", "2",
                 "--momentum", "0.9", "--bucket-mb", "0.001", "-o", str(out)]) == 0
    assert main(["run", str(out), "--steps", "3", "--verify", "--timeout", "60",
                 "--tensorboard", str(tmp_path / "tb")]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "step 2: loss" in text and "single-process reference: OK" in text
    assert "per step from the run's parameters" in text and "trajectory" in text
    assert "step 2 (3/3, 100%)" in captured.err          # the launcher's progress (stderr is not a terminal)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:   # every field; what this run does not compute (no schedule, clipping, fp16) is null
        assert list(m) == ["step", "loss", "seconds", "lr", "grad_norm", "loss_scale", "skipped", "samples_per_s",
                           "tokens_per_s", "mfu", "peak_memory_bytes"]
        assert m["samples_per_s"] == 8 / m["seconds"] and m["tokens_per_s"] == m["samples_per_s"]  # a classifier
        assert 0 < m["mfu"] < 1 and m["peak_memory_bytes"] > 0 and m["skipped"] is False
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [pytest.approx(m["loss"]) for m in metrics]
    tl = Timeline.load(out / "timeline.json")
    assert set(tl.ranks) == {0, 1} and any(e.op == "F" for e in tl.events)
    chrome = json.loads((out / "trace.json").read_text())
    assert any(e.get("ph") == "X" and e["name"].startswith("F s0") for e in chrome["traceEvents"])


def test_cli_run_reports_a_failed_verification(tmp_path, capsys):
    out = tmp_path / "build"
    assert main(["codegen", "examples/models/mlp.py:build", "--batch", "4", "--data", "2", "--micro-batch", "2",
                 "-o", str(out)]) == 0
    # a reference with another learning rate cannot match: edit the build's training setup
    info = json.loads((out / "build.json").read_text())
    info["train"]["optimizer"]["lr"] = 0.5
    (out / "build.json").write_text(json.dumps(info))
    assert main(["run", str(out), "--steps", "2", "--verify", "--timeout", "60"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
