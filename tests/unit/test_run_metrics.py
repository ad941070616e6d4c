"""runtime/metrics.py: metrics.jsonl as a run streams it, and the non-finite loss check."""

import json
import math

import pytest

from runtime.executor import RankFailure
from runtime.metrics import NonFiniteLoss, check_loss, open_metrics, write_metrics


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_fresh_run_starts_a_fresh_file_and_each_line_is_on_disk_when_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 9.0, "seconds": 1.0}\n')
    with open_metrics(path, 0) as f:
        write_metrics(f, 0, 2.5, 0.01)
        # flushed: another process (the launcher, a user's tail -f) reads it before the file is closed
        assert json.loads(path.read_text()) == {"step": 0, "loss": 2.5, "seconds": 0.01}
        write_metrics(f, 1, 2.4, 0.01)
    assert _steps(path) == [0, 1]


def test_a_resumed_run_keeps_the_steps_before_its_checkpoint_and_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open_metrics(path, 0) as f:
        for step in range(6):
            write_metrics(f, step, 1.0, 0.1)
    # the earlier run was killed while writing a line: a cut line is dropped, not an error
    with path.open("a") as f:
        f.write('{"step": 6, "lo')
    with open_metrics(path, 3) as f:        # resumed from the checkpoint of step 3
        write_metrics(f, 3, 0.5, 0.1)
    assert _steps(path) == [0, 1, 2, 3]
    assert json.loads(path.read_text().splitlines()[-1])["loss"] == 0.5
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]   # no temporary file left


def test_a_resumed_run_without_earlier_metrics_starts_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open_metrics(path, 10) as f:
        write_metrics(f, 10, 1.0, 0.1)
    assert _steps(path) == [10]


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_names_its_step(loss):
    with pytest.raises(NonFiniteLoss, match=f"the loss is {loss} at step 17 \\(rank 3"):
        check_loss(loss, 17, 3)
    assert issubclass(NonFiniteLoss, RankFailure)   # reported to the other ranks without a traceback


def test_finite_losses_pass():
    for loss in (0.0, 1e30, -2.5):
        check_loss(loss, 0, 0)
