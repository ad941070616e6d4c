"""Sharded checkpoints over real processes (gloo): bit-exact resume, conversion to a plain state_dict,
loading into another plan (data 4 with ZeRO-1 -> data 2 x pipeline 2, and -> data 2 x tensor 2), an
interrupted save, and checkpoints refused for another model or setup.

GPT runs use SGD with momentum: AdamW turns the rounding noise of GPT's zero-gradient parameters (the
key bias of attention) into lr-sized steps, so two summation orders cannot agree to rtol 1e-4 (they do
bit-exactly for a resume on the same plan, which the MLP with AdamW also shows).
"""

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import CheckpointError, Manifest, complete_checkpoints, resolve_checkpoint, step_dir
from runtime.checkpoint.dir_lock import LOCK_NAME, DirectoryBusy, DirLock, Holder
from runtime.checkpoint.restore import to_state_dict
from runtime.launch.launcher import read_build, run_local, run_many
from runtime.verify import verify_build
from runtime.materialize import build_model
from runtime.reference import local_slice
from runtime.spec import StageSpec, TrainSpec
from runtime.vocab import MeshAxis
from tests.parallel_cases import emit_case, saved_params

ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def builds(root):
    out = {
        "d2p2": emit_case(root, "gpt", "d2p2", dict(data=2, pipeline=2)),  # SGD with momentum
        "d4_zero1": emit_case(root, "gpt", "d4_zero1", dict(data=4, zero=1)),
        "d2t2": emit_case(root, "gpt", "d2t2", dict(data=2, tensor=2)),
        "mlp_d2": emit_case(root, "mlp", "d2_zero3", dict(data=2, zero=3), optimizer=ADAMW),
        "mlp_t2": emit_case(root, "mlp", "t2", dict(tensor=2), optimizer=ADAMW),
    }
    # the same builds again, for a second run in one launch (a run's outputs are its build's)
    for name in ("d2p2", "mlp_t2"):
        out[f"{name}_again"] = out[name].with_name(f"{out[name].name}_again")
        shutil.copytree(out[name], out[f"{name}_again"])
    return out


def _ok(res, label):
    assert res.returncode == 0, f"{label} failed:\n{res.output[-4000:]}"


@pytest.fixture(scope="module")
def sources(builds, root):
    """gpt on 4 ranks, in one launch: 6 steps each with a checkpoint every 3, of data 2 x pipeline 2
    (root/c_d2p2, its parameters saved) and data 4 with ZeRO-1 (root/c_d4)."""
    ckpts = {"d2p2": root / "c_d2p2", "d4_zero1": root / "c_d4"}
    results = run_many([builds[n] for n in ckpts], steps=6, timeout=60, build_args=[
        ["--checkpoint-dir", str(c), "--save-every", "3", *(["--save-params"] if n == "d2p2" else [])]
        for n, c in ckpts.items()])
    for n, res in zip(ckpts, results):
        _ok(res, f"{n}: 6 steps")
    return dict(zip(ckpts, results)), saved_params(builds["d2p2"])


@pytest.fixture(scope="module")
def six_steps(sources, root):
    """gpt, data 2 x pipeline 2 (4 ranks), SGD with momentum: 6 steps with a checkpoint every 3."""
    return sources[0]["d2p2"], sources[1], root / "c_d2p2"


@pytest.fixture(scope="module")
def resumed(builds, sources, root):
    """3 steps after step 3, in one launch: data 2 x pipeline 2 from its own checkpoint ("same"), and from
    data 4 ZeRO-1's into data 2 x pipeline 2 (the build's copy) and data 2 x tensor 2."""
    jobs = {"same": (builds["d2p2"], root / "c_d2p2"), "d2p2": (builds["d2p2_again"], root / "c_d4"),
            "d2t2": (builds["d2t2"], root / "c_d4")}
    results = run_many([b for b, _c in jobs.values()], steps=3, timeout=60,
                       extra_args=["--save-params", "--save-steps"],
                       build_args=[["--resume", str(step_dir(c, 3))] for _b, c in jobs.values()])
    return dict(zip(jobs, results))


def test_resume_on_the_same_plan_is_bit_exact(builds, six_steps, resumed):
    six, p6, ckpt = six_steps
    assert [d.name for d in complete_checkpoints(ckpt)] == ["step_00000003", "step_00000006"]
    b = builds["d2p2"]
    res = resumed["same"]
    _ok(res, "resume")
    for r in range(4):
        assert res.losses[r] == six.losses[r][3:], f"rank {r}: losses of steps 3-5 differ"
    p = saved_params(b)
    n = 0
    for r in range(4):
        assert p[r].keys() == p6[r].keys()
        for name, t in p6[r].items():
            assert torch.equal(p[r][name], t), f"rank {r} {name}: 3 + resume + 3 steps != 6 steps"
            n += 1
    print(f"resume equality: {n} parameter tensors on 4 ranks bit-identical (torch.equal); "
          f"losses {res.losses[0]} == {six.losses[0][3:]}")
    assert n > 0


def test_checkpoint_converts_to_the_model_state_dict(builds, six_steps, tmp_path):
    _six, p6, ckpt = six_steps
    out = tmp_path / "model.pt"
    ck, man, count = to_state_dict(ckpt, out)
    assert ck == step_dir(ckpt, 6) and man.step == 6 and man.samples == 6 * 8
    sd = torch.load(out, weights_only=True)
    spec = TrainSpec.from_dict(read_build(builds["d2p2"])["train"])
    model = build_model(spec)
    assert set(sd) == set(model.state_dict()) and count == len(sd)
    model.load_state_dict(sd, strict=True)
    held = {name: t for r in p6 for name, t in p6[r].items()}
    assert len(held) == len(dict(model.named_parameters()))
    assert all(torch.equal(sd[name], t) for name, t in held.items())


def _target_params_after_load(build: Path, rank: int, ckpt: Path) -> dict[str, torch.Tensor]:
    """A rank of `build` prepared in this process with --resume: its stage parameters (no process groups)."""
    from runtime.rank_main import prepare

    g = runpy.run_path(str(build / f"rank_{rank:04d}.py"), run_name="checkpoint_test")
    stages = {s: (g[f"Stage{s}"], d) for s, d in g["STAGE_SPECS"].items()}
    prep = prepare(rank=rank, program=g["PROGRAM"], stages=stages, train=g["TRAIN"], signature=g["SIGNATURE"],
                   argv=["--resume", str(ckpt)], build_dir=str(build))
    assert not prep.restore.same_layout
    return {k: v for m in prep.modules.values() for k, v in m.named_parameters()}


def test_reshard_on_load(builds, root, resumed, tmp_path):
    """data 4 + ZeRO-1 (optimizer state in flat shards) after step 3 -> data 2 x pipeline 2 and data 2 x tensor 2."""
    ckpt = step_dir(root / "c_d4", 3)
    to_state_dict(ckpt, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    # the same parameters, exactly: each target rank holds its slice of the checkpoint's tensors
    info = read_build(builds["d2t2"])
    for rank in range(4):
        prog = json.loads((builds["d2t2"] / "programs.json").read_text())[str(rank)]
        tcoord = dict(zip([a for a, _ in prog["mesh"]], prog["coords"]))["tensor"]
        held = _target_params_after_load(builds["d2t2"], rank, ckpt)
        specs = [StageSpec.from_dict(info["stages"][str(s)]) for s in prog["stages"]]
        assert any(sp.shards for sp in specs), "the data 2 x tensor 2 plan splits modules over the tensor axis"
        for name, t in held.items():
            split = next((sp.split_of(name, t.dim()) for sp in specs if sp.split_of(name, t.dim())), None)
            want = local_slice(whole[name], split, tcoord, 2)
            assert torch.equal(t, want), f"rank {rank} {name}"
    # and training continues as the single process would: 3 more steps equal steps 3-5 of the reference
    for b, res in ((builds["d2p2_again"], resumed["d2p2"]), (builds["d2t2"], resumed["d2t2"])):
        _ok(res, f"resume {b.name} from data 4")
        cmp = verify_build(b, 3, res.losses, first_step=3)
        print(f"{b.name} resumed from data 4 ZeRO-1: {cmp.summary()}")
        assert cmp.ok and cmp.params_compared > 0, cmp.summary()


def test_an_interrupted_save_leaves_the_previous_checkpoint(builds, root):
    b, ckpt = builds["mlp_d2"], root / "c_mlp"
    res = run_local(b, steps=4, timeout=20, wall_timeout=150, extra_args=[
        "--checkpoint-dir", str(ckpt), "--save-every", "2", "--fail-at", "1:3:0", "--fault", "sigkill-in-save"])
    assert res.returncode != 0 and res.returncodes[1] == -9
    assert "injecting fault: sigkill-in-save in the checkpoint of step 4" in res.output
    assert "meshplan rank 0: stopping because another rank failed: rank 1 stopped responding (no heartbeat" in res.output, res.output[-3000:]
    assert complete_checkpoints(ckpt) == [step_dir(ckpt, 2)]
    assert list(step_dir(ckpt, 4).glob(".rank_0001.pt.*.tmp")), "rank 1 was killed half-way through its file"
    assert not (step_dir(ckpt, 4) / "rank_0001.pt").exists()
    with pytest.raises(CheckpointError, match="save was interrupted"):
        resolve_checkpoint(step_dir(ckpt, 4))
    assert resolve_checkpoint(ckpt) == step_dir(ckpt, 2)
    # resume on the same plan, and on tensor 2 (AdamW state out of ZeRO-3 flat shards into split tensors)
    targets = [b, builds["mlp_t2"]]
    results = run_many(targets, steps=2, timeout=20, extra_args=["--resume", str(ckpt), "--save-params", "--save-steps"])
    for t, res in zip(targets, results):
        _ok(res, f"{t.name}: resume after the interrupted save")
        cmp = verify_build(t, 2, res.losses, first_step=2)
        assert cmp.ok and cmp.params_compared > 0, f"{t.name}: {cmp.summary()}"
    # the resume swept what the killed save left: its temporary and the step directory it never completed
    assert not list(ckpt.rglob("*.tmp")) and not step_dir(ckpt, 4).exists() and step_dir(ckpt, 2).is_dir()
    assert f"meshplan rank 0: removed what an interrupted save left in {ckpt}: step_00000004" in results[0].output


def test_resume_from_a_checkpoint_of_another_model_or_setup_is_refused(builds, six_steps, tmp_path):
    from runtime.rank_main import prepare

    gpt_ckpt = six_steps[2]
    res = run_local(builds["mlp_t2"], steps=1, timeout=20, extra_args=["--resume", str(gpt_ckpt)])
    assert res.returncode == 2
    for r in range(2):
        assert f"[rank {r}] meshplan rank {r}: error: checkpoint {step_dir(gpt_ckpt, 6)} was made for another " \
            "model" in res.output, res.output[-3000:]
    g = runpy.run_path(str(builds["d2p2"] / "rank_0000.py"), run_name="checkpoint_test")
    stages = {s: (g[f"Stage{s}"], d) for s, d in g["STAGE_SPECS"].items()}

    def open_with(train, path=gpt_ckpt):
        prepare(rank=0, program=g["PROGRAM"], stages=stages, train=train, signature=g["SIGNATURE"],
                argv=["--resume", str(path)], build_dir=str(builds["d2p2"]))

    open_with(g["TRAIN"])  # the build it was made with opens it
    with pytest.raises(CheckpointError, match="saved with optimizer 'sgd', this build uses 'adamw'"):
        open_with({**g["TRAIN"], "optimizer": ADAMW})
    with pytest.raises(CheckpointError, match="global batch size 8, this build uses 16"):
        open_with({**g["TRAIN"], "global_batch_size": 16})
    damaged = tmp_path / "damaged"
    shutil.copytree(step_dir(gpt_ckpt, 6), damaged)
    data = bytearray((damaged / "rank_0000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / "rank_0000.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank_0000.pt does not match its manifest"):
        open_with(g["TRAIN"], damaged)
    (damaged / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="manifest.json is damaged"):
        open_with(g["TRAIN"], damaged)


def test_command_line(builds, tmp_path, capsys):
    """meshplan run --checkpoint-dir/--save-every/--resume --verify, meshplan checkpoint show/convert."""
    from planner.app.cli import main

    b, ckpt = str(builds["mlp_t2"]), tmp_path / "cli_ckpt"
    assert main(["run", b, "--steps", "2", "--timeout", "30", "--checkpoint-dir", str(ckpt),
                 "--save-every", "1"]) == 0
    assert [d.name for d in complete_checkpoints(ckpt)] == ["step_00000001", "step_00000002"]
    assert main(["run", b, "--steps", "1", "--timeout", "30", "--resume", str(ckpt), "--checkpoint-dir", str(ckpt),
                 "--verify"]) == 0
    assert "verify against the single-process reference: " in capsys.readouterr().out
    assert main(["checkpoint", "show", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert f"step_00000003: step 3 (24 samples), 2 ranks, mesh {MeshAxis.PIPELINE} 1 x data 1 x tensor 2" in out, out
    assert main(["checkpoint", "convert", str(ckpt), "-o", str(tmp_path / "m.pt")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli_ckpt", "m.pt"]  # no temporary left anywhere
    assert not [p for p in ckpt.rglob("*") if p.name.endswith(".tmp")]
    assert main(["checkpoint", "convert", str(ckpt), "-o", str(tmp_path)]) == 2
    assert f"-o {tmp_path} is a directory" in capsys.readouterr().err
    assert not [p for p in tmp_path.parent.iterdir() if p.name.endswith(".tmp")]
    spec = TrainSpec.from_dict(read_build(builds["mlp_t2"])["train"])
    build_model(spec).load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True), strict=True)
    assert main(["checkpoint", "show", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_full_disk_during_a_save_is_a_clear_error_that_leaves_the_previous_checkpoint(builds, root):
    """Rank 1's write of its checkpoint file fails with ENOSPC half-way: every rank stops with that
    reason (naming the file), the step directory is gone, and the previous checkpoint resumes."""
    b, ckpt = builds["mlp_d2"], root / "c_full"
    res = run_local(b, steps=4, timeout=20, wall_timeout=150, extra_args=[
        "--checkpoint-dir", str(ckpt), "--save-every", "2", "--fail-at", "1:3:0", "--fault", "disk-full-in-save"])
    assert res.returncode != 0
    reason = f"rank 1 failed: WriteError: cannot write {step_dir(ckpt, 4) / 'rank_0001.pt'}: disk full (ENOSPC)"
    assert f"[rank 1] meshplan rank 1: error: {reason}" in res.output, res.output[-3000:]
    assert any(line.startswith("[rank 0] meshplan rank 0: stopping") and reason in line
               for line in res.output.splitlines()), res.output[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == [LOCK_NAME, "step_00000002"]  # no partial files
    res = run_local(b, steps=2, timeout=20, verify=True, extra_args=["--resume", str(ckpt), "--checkpoint-dir",
                                                                     str(ckpt)])
    _ok(res, "resume after the failed save")
    assert res.comparison.ok and res.comparison.params_compared > 0, res.comparison.summary()
    assert complete_checkpoints(ckpt) == [step_dir(ckpt, 2), step_dir(ckpt, 4)]


def _wait_for_holder(lock: Path, proc: subprocess.Popen, ready) -> Holder:
    """The holder recorded in `lock` once `ready(holder)` (fails if `proc` ends first)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        holder = Holder.parse(lock.read_bytes()) if lock.is_file() else None
        if holder is not None and ready(holder):
            return holder
        assert proc.poll() is None, f"the first run ended (exit status {proc.returncode}) before it was seen running"
        time.sleep(0.05)
    raise AssertionError(f"{lock} named no running holder within 300 s")


def _start_run(build: Path, *extra: str) -> subprocess.Popen:
    """`meshplan run BUILD --steps 2000` in its own process group (so that the test can end all of it)."""
    return subprocess.Popen([sys.executable, "-m", "planner.app.cli", "run", str(build), "--steps", "2000",
                             "--timeout", "60", *extra], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def _end(proc: subprocess.Popen, build: Path | None = None) -> None:
    """End `proc`'s process group; with `build`, also wait (at most 120 s) until nothing holds the build's
    lock, so that the next test's run of it is not refused while the ended run's processes wind down."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=120)
    deadline = time.monotonic() + 120
    while build is not None:
        try:
            DirLock.acquire(build, Holder.here(), "build").release()
            return
        except DirectoryBusy as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"the ended run still holds its build after 120 s: {e}") from None
            time.sleep(0.1)


def test_two_runs_on_one_checkpoint_directory_the_second_is_refused(builds, root):
    """A live run holds its checkpoint directory (rank 0's lock, stopped with SIGSTOP so that it is
    certainly still running); another build's run into that directory stops on every rank naming it."""
    ckpt = root / "c_shared"
    first = _start_run(builds["mlp_t2"], "--checkpoint-dir", str(ckpt))
    holder = None
    try:
        holder = _wait_for_holder(ckpt / LOCK_NAME, first, lambda h: bool(h.run_id))
        os.kill(holder.pid, signal.SIGSTOP)
        res = run_local(builds["mlp_d2"], steps=1, timeout=30, extra_args=["--checkpoint-dir", str(ckpt)])
    finally:
        _end(first, builds["mlp_t2"])
        if holder is not None:   # the stopped rank runs in its own session: ending the launcher's misses it
            try:
                os.kill(holder.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert res.returncode != 0
    busy = f"rank 0: checkpoint directory {ckpt} is in use by run {holder.run_id} (host {holder.host}, " \
           f"pid {holder.pid}, started "
    assert f"[rank 0] meshplan rank 0: error: {busy}" in res.output, res.output[-3000:]
    assert f"[rank 1] meshplan rank 1: stopping because another rank failed: {busy}" in res.output, \
        res.output[-3000:]
    assert not complete_checkpoints(ckpt)


def test_two_concurrent_runs_of_one_build_the_second_is_refused(builds, capsys):
    from planner.app.cli import main

    build = builds["mlp_t2"]
    shutil.rmtree(build / "run", ignore_errors=True)   # so that run/ is seen only once the first run made it
    first = _start_run(build)
    try:
        # the launcher locks the build, then clears and makes run/: stop it only after that
        holder = _wait_for_holder(build / LOCK_NAME, first, lambda h: h.pid == first.pid and (build / "run").is_dir())
        os.kill(first.pid, signal.SIGSTOP)  # the launcher holds the lock: keep it from finishing
        capsys.readouterr()
        assert main(["run", str(build), "--steps", "1", "--timeout", "30"]) == 2
        err = capsys.readouterr().err
        assert f"build {build.resolve()} is in use by (host {holder.host}, pid {first.pid}, started " in err, err
        assert (build / "run").is_dir(), "the refused run must not clear the running one's outputs"
    finally:
        _end(first, build)


def test_resume_from_another_runs_checkpoint_needs_the_flag(builds, tmp_path, capsys):
    from planner.app.cli import main

    b = str(builds["mlp_t2"])
    run = ["run", b, "--steps", "1", "--timeout", "30"]
    dir_a, dir_b = tmp_path / "run_a", tmp_path / "run_b"
    # two runs of the build (run a through its copy), each into its own directory, in one launch
    for d, res in zip((dir_a, dir_b), run_many([builds["mlp_t2_again"], builds["mlp_t2"]], steps=1, timeout=30,
                                               build_args=[["--checkpoint-dir", str(d)] for d in (dir_a, dir_b)])):
        _ok(res, f"the run into {d.name}")
    id_a, id_b = (Manifest.load(resolve_checkpoint(d)).run_id for d in (dir_a, dir_b))
    assert id_a and id_b and id_a != id_b
    capsys.readouterr()
    assert main([*run, "--checkpoint-dir", str(dir_a)]) == 1     # a new run into run a's directory
    assert f"--checkpoint-dir {dir_a} holds the checkpoints of another run" in capsys.readouterr().err
    assert main([*run, "--resume", str(dir_a), "--checkpoint-dir", str(dir_b)]) == 1
    err = capsys.readouterr().err
    assert f"checkpoint {dir_a} belongs to run {id_a}, but --checkpoint-dir {dir_b} holds the checkpoints of run " \
           f"{id_b}" in err and "--resume-from-other-run" in err, err
    assert complete_checkpoints(dir_b) == [step_dir(dir_b, 1)]
    assert main([*run, "--resume", str(dir_a), "--checkpoint-dir", str(dir_b), "--resume-from-other-run"]) == 0
    assert complete_checkpoints(dir_b) == [step_dir(dir_b, 1), step_dir(dir_b, 2)]
    assert Manifest.load(step_dir(dir_b, 2)).run_id == id_b   # run b continues, from run a's state
