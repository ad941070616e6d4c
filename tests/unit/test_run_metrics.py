"""runtime/metrics.py: metrics.jsonl as a run streams it (its fields, rates and MFU), and the non-finite loss check."""

import json
import math

import pytest

import torch

from runtime.executor import RankFailure, StepResult
from runtime.metrics import (NonFiniteLoss, StepLog, check_loss, open_metrics, peak_memory_bytes, step_fields,
                             write_metrics)
from runtime.spec import SpecError, TrainSpec
from runtime.program.step_work import StepWork

FIELDS = ["step", "loss", "seconds", "lr", "grad_norm", "loss_scale", "skipped", "samples_per_s", "tokens_per_s",
          "mfu", "peak_memory_bytes"]


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_fresh_run_starts_a_fresh_file_and_each_line_is_on_disk_when_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 9.0, "seconds": 1.0}\n')
    with open_metrics(path, 0) as f:
        write_metrics(f, {"step": 0, "loss": 2.5, "seconds": 0.01})
        # flushed: another process (the launcher, a user's tail -f) reads it before the file is closed
        assert json.loads(path.read_text()) == {"step": 0, "loss": 2.5, "seconds": 0.01}
        write_metrics(f, {"step": 1, "loss": 2.4, "seconds": 0.01})
    assert _steps(path) == [0, 1]


def test_a_resumed_run_keeps_the_steps_before_its_checkpoint_and_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open_metrics(path, 0) as f:
        for step in range(6):
            write_metrics(f, {"step": step, "loss": 1.0, "seconds": 0.1})
    # the earlier run was killed while writing a line: a cut line is dropped, not an error
    with path.open("a") as f:
        f.write('{"step": 6, "lo')
    with open_metrics(path, 3) as f:        # resumed from the checkpoint of step 3
        write_metrics(f, {"step": 3, "loss": 0.5, "seconds": 0.1})
    assert _steps(path) == [0, 1, 2, 3]
    assert json.loads(path.read_text().splitlines()[-1])["loss"] == 0.5
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]   # no temporary file left


def test_a_resumed_run_without_earlier_metrics_starts_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open_metrics(path, 10) as f:
        write_metrics(f, {"step": 10, "loss": 1.0, "seconds": 0.1})
    assert _steps(path) == [10]


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_names_its_step(loss):
    with pytest.raises(NonFiniteLoss, match=f"the loss is {loss} at step 17 \\(rank 3"):
        check_loss(loss, 17, 3)
    assert issubclass(NonFiniteLoss, RankFailure)   # reported to the other ranks without a traceback


def test_finite_losses_pass():
    for loss in (0.0, 1e30, -2.5):
        check_loss(loss, 0, 0)


def test_a_line_has_every_field_in_order_with_null_for_what_the_run_did_not_compute():
    work = StepWork(flops=6e12, peak_flops=4 * 1e12, tokens_per_sample=16)
    line = step_fields(StepResult(7, 2.5, 0.5), 8, work, 123)
    assert list(line) == FIELDS
    assert (line["lr"], line["grad_norm"], line["loss_scale"], line["skipped"]) == (None, None, None, False)
    assert json.loads(json.dumps(line))["lr"] is None          # null in the file
    assert line["samples_per_s"] == 8 / 0.5
    assert line["tokens_per_s"] == 8 / 0.5 * 16
    # 6e12 FLOPs in 0.5 s on 4 devices of 1e12 FLOP/s: 12e12 FLOP/s of 4e12 -> 3.0
    assert line["mfu"] == pytest.approx(6e12 / (0.5 * 4e12))
    assert line["peak_memory_bytes"] == 123


def test_a_line_carries_what_the_step_result_holds():
    r = StepResult(3, 1.25, 0.25, lr=1e-3, grad_norm=4.5, loss_scale=65536.0, skipped=True)
    line = step_fields(r, 4, StepWork(1e9, None, 1), None)
    assert (line["lr"], line["grad_norm"], line["loss_scale"], line["skipped"]) == (1e-3, 4.5, 65536.0, True)
    assert line["mfu"] is None and line["tokens_per_s"] == 16.0   # no peak for the dtype: no MFU


def test_a_build_without_step_work_writes_null_rates_it_cannot_know():
    line = step_fields(StepResult(0, 1.0, 0.1), 4, None, 1)
    assert line["samples_per_s"] == pytest.approx(40.0)
    assert line["tokens_per_s"] is None and line["mfu"] is None


def test_the_step_work_round_trips_through_the_build_file():
    spec = TrainSpec("m.py:build", "m.py:data", 8, work=StepWork(1.5e9, 2e12, 16))
    assert TrainSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    old = spec.to_dict()
    del old["work"]                                   # a build made before: no rates, still loads
    assert TrainSpec.from_dict(old).work is None
    with pytest.raises(SpecError, match="build field 'work'"):
        TrainSpec.from_dict({**spec.to_dict(), "work": {"flops": 1.0}})


def test_cpu_peak_memory_is_the_process_resident_peak():
    before = peak_memory_bytes(torch.device("cpu"))
    big = torch.ones(64 * 2 ** 20 // 4)                 # 64 MiB touched
    after = peak_memory_bytes(torch.device("cpu"))
    assert after >= before and after >= big.numel() * 4   # bytes, not KiB


def test_the_step_log_writes_each_step_and_passes_extra_keys_through(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = StepLog(path, 0, 2, 8, StepWork(1e9, 1e12, 16), torch.device("cpu"))
    for step in range(2):
        log.start_step()
        fields = log.fields(StepResult(step, 2.0 - step, 0.1))
        if step == 1:
            fields["eval_loss"] = 1.5                   # the evaluation's fields join the step's line
        log.write(fields)
    log.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [list(x) for x in lines] == [FIELDS, FIELDS + ["eval_loss"]]
    assert lines[1]["eval_loss"] == 1.5 and lines[0]["peak_memory_bytes"] > 0
