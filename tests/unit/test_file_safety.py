"""Safe file writing (runtime/files.py), directory locks (runtime/checkpoint/dir_lock.py) and the run identity
of checkpoint directories (runtime/checkpoint/run_ids.py), without training processes."""

import errno
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from runtime.checkpoint import MANIFEST, CheckpointError, Manifest, step_dir
from runtime.checkpoint.restore import to_state_dict
from runtime.checkpoint.run_ids import claim_checkpoint_dir, run_to_continue
from runtime.checkpoint.dir_lock import LOCK_NAME, DirectoryBusy, DirLock, Holder
from runtime.files import WriteError, atomic_file, write_atomic

REPO = Path(__file__).resolve().parents[2]


def _disk_full():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ---- runtime/files.py ---------------------------------------------------------------------------


def test_write_atomic_leaves_only_the_file_with_the_mode_open_gives(tmp_path):
    write_atomic(tmp_path / "a.bin", b"new")
    with open(tmp_path / "plain", "wb"):
        pass
    assert (tmp_path / "a.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "plain"]
    assert (tmp_path / "a.bin").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_temporaries_are_created_exclusively_never_through_a_link(tmp_path, monkeypatch):
    """The temporary is opened O_CREAT | O_EXCL | O_NOFOLLOW by mkstemp under a random name: a symlink
    at the old predictable name, a pre-created file, and a symlink at the very name mkstemp draws first
    are all left alone (the files they point to keep their bytes)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "rank_0000.pt"
    (tmp_path / f"rank_0000.pt.tmp{os.getpid()}").symlink_to(victim)   # the name the old code used
    (tmp_path / ".rank_0000.pt.planted.tmp").write_bytes(b"someone else's")
    (tmp_path / ".rank_0000.pt.first.tmp").symlink_to(victim)          # the name mkstemp draws first
    names = iter(["first", "planted", "fresh"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    flags = []
    real_open = os.open

    def spy(path, flag, *a, **k):
        if str(path).startswith(str(tmp_path / ".rank_0000.pt.")):
            flags.append((Path(path).name, flag))
        return real_open(path, flag, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    write_atomic(target, b"checkpoint bytes")
    assert target.read_bytes() == b"checkpoint bytes" and not target.is_symlink()
    assert victim.read_bytes() == b"precious"
    assert (tmp_path / ".rank_0000.pt.planted.tmp").read_bytes() == b"someone else's"
    want = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    assert [n for n, _ in flags] == [".rank_0000.pt.first.tmp", ".rank_0000.pt.planted.tmp",
                                     ".rank_0000.pt.fresh.tmp"]
    assert all(f & want == want for _, f in flags), flags
    assert not (tmp_path / ".rank_0000.pt.fresh.tmp").exists()


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "model.pt").symlink_to(victim)
    write_atomic(tmp_path / "model.pt", b"model")
    assert not (tmp_path / "model.pt").is_symlink() and (tmp_path / "model.pt").read_bytes() == b"model"
    assert victim.read_bytes() == b"precious"


def test_a_failed_write_names_the_path_and_cause_and_leaves_nothing(tmp_path):
    target = tmp_path / "rank_0001.pt"
    target.write_bytes(b"old")
    with pytest.raises(WriteError, match=r"cannot write .*rank_0001.pt: disk full \(ENOSPC\); free space") as e:
        write_atomic(target, b"x" * 10_000, interrupt=_disk_full)
    assert e.value.errno == errno.ENOSPC and e.value.path == target
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["rank_0001.pt"]
    with pytest.raises(WriteError, match="its directory does not exist"):
        write_atomic(tmp_path / "missing" / "f", b"x")
    (tmp_path / "d").mkdir()
    with pytest.raises(WriteError, match=r"d: it is a directory \(EISDIR\)"):
        write_atomic(tmp_path / "d", b"x")
    with pytest.raises(RuntimeError, match="inside"):  # an error that is not the disk's passes unchanged
        with atomic_file(tmp_path / "g") as f:
            f.write(b"partial")
            raise RuntimeError("inside")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "rank_0001.pt"]


def test_a_shared_directory_removed_by_a_peer_is_made_again(tmp_path, monkeypatch):
    """The race CI met: rank 1's save fails and, finding the step directory empty, removes it between
    rank 0's mkdir and rank 0's mkstemp. make_parent makes it again (at most a few times)."""
    import runtime.files as files

    real, removals = tempfile.mkstemp, []

    def peer_removes_the_directory_first(*args, dir, **kwargs):
        if len(removals) < wanted:
            os.rmdir(dir)
            removals.append(dir)
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(files.tempfile, "mkstemp", peer_removes_the_directory_first)
    target = tmp_path / "step_00000004" / "rank_0000.pt"
    wanted = 2
    write_atomic(target, b"state", make_parent=True)
    assert target.read_bytes() == b"state" and len(removals) == 2
    removals.clear()
    wanted = files._DIRECTORY_ATTEMPTS    # a directory that keeps vanishing is still a clear error
    with pytest.raises(WriteError, match="rank_0001.pt: its directory does not exist"):
        write_atomic(tmp_path / "step_00000006" / "rank_0001.pt", b"state", make_parent=True)
    removals.clear()
    wanted = 0                            # without make_parent nothing is created
    with pytest.raises(WriteError, match="its directory does not exist"):
        write_atomic(tmp_path / "step_00000008" / "rank_0000.pt", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]


def test_a_file_size_limit_is_a_clear_error(tmp_path):
    """A real EFBIG: the write runs in a process whose RLIMIT_FSIZE is 4 KiB."""
    (tmp_path / "big.bin").write_bytes(b"old")
    script = textwrap.dedent(f"""
        import resource
        from runtime.files import WriteError, write_atomic
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            write_atomic({str(tmp_path / 'big.bin')!r}, b"x" * 2**20)
        except WriteError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert f"cannot write {tmp_path / 'big.bin'}: file too large" in out.stdout and "(EFBIG)" in out.stdout, \
        out.stdout + out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["big.bin"] and (tmp_path / "big.bin").read_bytes() == b"old"


# ---- runtime/checkpoint/dir_lock.py ------------------------------------------------------------------------


_HOLD = """
import sys
from runtime.checkpoint.dir_lock import DirLock, Holder
lock = DirLock.acquire(sys.argv[1], Holder.here("run-in-child"), "checkpoint directory")
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_lock_names_its_live_holder_and_dies_with_it(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryBusy, match=rf"checkpoint directory {tmp_path} is in use by run run-in-child "
                                                rf"\(host .+, pid {child.pid}, started \d{{4}}-") as e:
            DirLock.acquire(tmp_path, Holder.here(), "checkpoint directory")
        assert e.value.holder.pid == child.pid
    finally:
        child.kill()
        child.wait(timeout=60)
    with DirLock.acquire(tmp_path, Holder.here("mine"), "checkpoint directory") as lock:  # a dead run's lock is free
        assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == "mine" and lock.held
        with pytest.raises(DirectoryBusy):  # one open file per lock: the same process is refused too
            DirLock.acquire(tmp_path, Holder.here(), "checkpoint directory")
    DirLock.acquire(tmp_path, Holder.here(), "checkpoint directory").release()


def test_a_symlink_at_the_lock_name_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / LOCK_NAME).symlink_to(victim)
    with pytest.raises(WriteError, match="symbolic link"):
        DirLock.acquire(tmp_path / "d", Holder.here(), "build")
    assert victim.read_bytes() == b"precious"


# ---- runtime/checkpoint/run_ids.py ------------------------------------------------------------------


def _checkpoint(root: Path, step: int, run_id: str) -> Manifest:
    man = Manifest(step=step, world_size=1, mesh=(("data", 1),), signature="s", model_ref="m.py:build",
                   optimizer="sgd", global_batch_size=2, data_seed=0, layouts={0: "h"},
                   files={0: {"sha256": "0" * 64, "bytes": 1}}, run_id=run_id)
    step_dir(root, step).mkdir(parents=True)
    (step_dir(root, step) / MANIFEST).write_text(json.dumps(man.to_dict()))
    return Manifest.load(step_dir(root, step))


def test_which_run_may_write_a_checkpoint_directory(tmp_path):
    a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "empty"
    man_a = _checkpoint(a, 3, "aaaa")
    _checkpoint(b, 2, "bbbb")
    assert man_a.run_id == "aaaa"
    assert run_to_continue(empty, None, None, allow_other_run=False) is None         # a new run
    assert run_to_continue(empty, man_a, a, allow_other_run=False) == "aaaa"         # continued elsewhere
    assert run_to_continue(a, man_a, a, allow_other_run=False) == "aaaa"             # continued in place
    with pytest.raises(CheckpointError, match=rf"--checkpoint-dir {a} holds the checkpoints of another run "
                                              r"\(step_00000003 and 0 earlier\); a new run does not write"):
        run_to_continue(a, None, None, allow_other_run=False)
    with pytest.raises(CheckpointError, match=rf"checkpoint {a} belongs to run aaaa, but --checkpoint-dir {b} "
                                              r"holds the checkpoints of run bbbb .*--resume-from-other-run"):
        run_to_continue(b, man_a, a, allow_other_run=False)
    assert run_to_continue(b, man_a, a, allow_other_run=True) == "bbbb"              # b's run, a's state
    legacy = _checkpoint(tmp_path / "legacy", 1, "")
    with pytest.raises(CheckpointError, match="an unnamed run"):
        run_to_continue(b, legacy, tmp_path / "legacy", allow_other_run=False)


def test_claiming_a_checkpoint_directory(tmp_path):
    first = claim_checkpoint_dir(tmp_path / "c", None, None, allow_other_run=False)
    try:
        assert len(first.run_id) == 12
        assert json.loads((tmp_path / "c" / LOCK_NAME).read_text())["run_id"] == first.run_id
        with pytest.raises(DirectoryBusy, match=rf"in use by run {first.run_id} \(host .*, pid {os.getpid()}"):
            claim_checkpoint_dir(tmp_path / "c", None, None, allow_other_run=False)
    finally:
        first.release()
    man = _checkpoint(tmp_path / "c", 1, first.run_id)
    with pytest.raises(CheckpointError, match="holds the checkpoints of another run"):  # refused, lock given back
        claim_checkpoint_dir(tmp_path / "c", None, None, allow_other_run=False)
    again = claim_checkpoint_dir(tmp_path / "c", man, tmp_path / "c", allow_other_run=False)
    assert again.run_id == first.run_id
    again.release()


def test_convert_refuses_a_directory_before_any_work(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match=rf"-o {tmp_path / 'out'} is a directory; give the state_dict file"):
        to_state_dict(tmp_path / "no-checkpoint-here", tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not list((tmp_path / "out").iterdir())
