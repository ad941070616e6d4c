"""run_many's per-build rank options: one list per build, and only through workers (one process per rank
runs every build, so that each build can get its own options)."""

import pytest

from runtime.launch.launcher import run_many


def test_build_args_need_one_list_per_build(tmp_path):
    with pytest.raises(ValueError, match=r"one list of options per build \(2, got 1\)"):
        run_many([tmp_path / "a", tmp_path / "b"], build_args=[["--sabotage", "drop-bucket"]])


def test_build_args_need_workers(tmp_path):
    with pytest.raises(ValueError, match="run them through_workers"):
        run_many([tmp_path / "a"], build_args=[["--resume", str(tmp_path / "ckpt")]], through_workers=False)
