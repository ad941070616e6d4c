"""runtime/launch/progress.py (the live display: bar on a terminal, plain lines otherwise; the launcher's tail of
metrics.jsonl), runtime/tensorboard_log.py (event files, the missing-package error) and codegen/throughput.py
(what a build records for tokens/s and MFU)."""

import dataclasses
import io
import json
import os
import sys

import pytest
import torch

import planner
from planner.app.commands import make_fixed_plan
from codegen.emit import capture_ref
from codegen.throughput import step_work
from runtime.executor import StepResult
from runtime.files import write_atomic
from runtime.metrics import StepLog, step_fields
from runtime.launch.progress import MetricsTail, StepProgress, RunProgress, is_terminal
from runtime.program.step_work import StepWork
from runtime.tensorboard_log import TensorBoardLog, TensorBoardMissing, require_tensorboard


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _line(step, loss=1.0):
    return {"step": step, "loss": loss, "seconds": 0.1}


def test_plain_lines_come_every_interval_and_for_the_last_step():
    out, clock = io.StringIO(), _Clock()
    p = StepProgress(0, 100, out, interval_s=10.0, clock=clock)
    for step in range(100):
        clock.now += 1.0          # a step a second: a line every 10 steps, and the last
        p.update(_line(step, 2.0 - step / 100))
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("step 9 (10/100, 10%)  loss 1.9100  0:10 elapsed, 1.000 s/step, ETA 1:30")
    assert lines[-1].startswith("step 99 (100/100, 100%)  loss 1.0100  1:40 elapsed")
    assert "\r" not in out.getvalue()   # no bar redraws in a log file


def test_the_rate_leaves_the_start_up_out():
    out, clock = io.StringIO(), _Clock()
    p = StepProgress(0, 4, out, interval_s=0.0, clock=clock)
    clock.now += 30.0                                   # the processes start and the first step runs
    for step in range(4):
        p.update(_line(step))
        clock.now += 2.0
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("step 1 (2/4, 50%)  loss 1.0000  0:32 elapsed, 2.000 s/step, ETA 0:04")


def test_lines_read_all_at_once_take_their_rate_from_their_own_seconds():
    out, clock = io.StringIO(), _Clock()
    p = StepProgress(0, 10, out, clock=clock)
    clock.now += 5.0
    for step in range(5):                               # the launcher found five new lines in one read
        p.update({"step": step, "loss": 1.0, "seconds": 0.5})
    p.update({"step": 9, "loss": 1.0, "seconds": 0.5})
    assert "0:05 elapsed, 0.500 s/step" in out.getvalue()


def test_a_resumed_run_counts_its_own_steps():
    out, clock = io.StringIO(), _Clock()
    p = StepProgress(50, 10, out, clock=clock)
    for step in range(50, 60):
        clock.now += 2.0
        p.update(_line(step))
    assert out.getvalue().splitlines()[-1].startswith("step 59 (10/10, 100%)")


def test_the_bar_is_drawn_only_on_a_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert not is_terminal(io.StringIO()) and is_terminal(_Tty())
    monkeypatch.setenv("TERM", "dumb")
    assert not is_terminal(_Tty())
    monkeypatch.setenv("TERM", "xterm")
    tty = _Tty()
    p = StepProgress(0, 3, tty)
    for step in range(3):
        p.update(_line(step))
    p.close()
    text = tty.getvalue()
    assert "\r" in text and "3/3" in text and "loss 1.0000" in text   # tqdm's one redrawn line


def test_the_tail_reads_complete_lines_of_this_run_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path, 0)
    assert tail.read() == []                            # rank 0 has not created it yet
    with path.open("w") as f:
        f.write(json.dumps(_line(0)) + "\n" + '{"step": 1, "lo')
        f.flush()
        assert [d["step"] for d in tail.read()] == [0]  # the line being written waits
        f.write('ss": 1.0}\n')
        f.flush()
        assert [d["step"] for d in tail.read()] == [1]
    tail.close()


def test_the_tail_of_a_resumed_run_skips_the_old_file_and_the_kept_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(_line(s)) + "\n" for s in range(6)))   # the earlier run, to step 5
    tail = MetricsTail(path, 3, ignore_inode=os.stat(path).st_ino)
    assert tail.read() == []                            # still the earlier run's file
    write_atomic(path, "".join(json.dumps(_line(s)) + "\n" for s in range(4)).encode())   # rank 0 resumes at 3
    assert [d["step"] for d in tail.read()] == [3]


def test_the_launcher_display_shows_what_rank_0_writes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_line(0, 9.0)) + "\n")   # an earlier fresh run's file: removed, not shown
    out = io.StringIO()
    display = RunProgress(path, 0, 2, out, bar=False)
    assert not path.exists()
    log = StepLog(path, 0, 2, 8, None, torch.device("cpu"))
    for step in range(2):
        log.write(log.fields(StepResult(step, 1.5, 0.01)))
        display.poll()
    log.close()
    display.close()
    assert out.getvalue().splitlines()[-1].startswith("step 1 (2/2, 100%)  loss 1.5000")
    assert "9.0000" not in out.getvalue()


def test_tensorboard_event_files_hold_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TensorBoardLog(tmp_path / "tb")
    lines = [step_fields(StepResult(s, 3.0 - s, 0.5, lr=0.1 * (s + 1)), 8, StepWork(1e9, 1e10, 4), 1000)
             for s in range(3)]
    lines[2]["eval_loss"] = 0.75
    for fields in lines:
        board.write(fields)
    board.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "seconds", "lr", "skipped", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes",
            "eval_loss"} <= tags
    assert "grad_norm" not in tags                      # null fields are left out
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    assert [e.value for e in acc.Scalars("lr")] == pytest.approx([0.1, 0.2, 0.3])
    assert acc.Scalars("mfu")[0].value == pytest.approx(1e9 / (0.5 * 1e10))
    assert [(e.step, e.value) for e in acc.Scalars("eval_loss")] == [(2, 0.75)]


def test_without_tensorboard_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)          # import tensorboard -> ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(TensorBoardMissing, match=r"pip install 'meshplan\[tensorboard\]'"):
        require_tensorboard()
    assert issubclass(TensorBoardMissing, ValueError)               # one line and exit 2 from the CLI
    with pytest.raises(TensorBoardMissing):
        StepLog(tmp_path / "metrics.jsonl", 0, 1, 8, None, torch.device("cpu"),
                tensorboard=str(tmp_path / "tb"))
    assert not (tmp_path / "metrics.jsonl").exists()                # refused before anything is written


def test_the_build_records_the_plan_flops_peak_and_tokens():
    graph = capture_ref("examples/models/gpt.py:build", {"preset": "tiny"}, batch_size=2)
    config = planner.ParallelConfig(data=2, micro_batch_size=2, dtype="fp32")
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=2), config, 8)
    work = step_work(plan, graph)
    # forward + backward per sample (captured at 2 samples) x the global batch of 8
    assert work.flops == (graph.total_fwd_flops + graph.total_bwd_flops) / 2 * 8
    assert work.peak_flops == 2 * plan.cluster.device.peak("fp32")
    assert work.tokens_per_sample == 16                 # logits (B, 16, vocabulary): 16 positions per sample
    mlp = capture_ref("examples/models/mlp.py:build", {}, batch_size=2)
    assert step_work(make_fixed_plan(mlp, plan.cluster, config, 8), mlp).tokens_per_sample == 1   # (B, classes)


def test_a_cluster_without_a_peak_for_the_dtype_leaves_mfu_out():
    graph = capture_ref("examples/models/mlp.py:build", {}, batch_size=2)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=1),
                           planner.ParallelConfig(micro_batch_size=2, dtype="fp32"), 4)
    device = dataclasses.replace(plan.cluster.device, peak_flops={"bf16": 1e12})
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, device=device))
    work = step_work(plan, graph)
    assert work.peak_flops is None and work.flops > 0


def test_meshplan_run_refuses_tensorboard_without_the_package_before_starting(monkeypatch, tmp_path, capsys):
    from planner.app.cli import main

    build = tmp_path / "build"
    build.mkdir()
    (build / "build.json").write_text(json.dumps({"world_size": 2}))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    assert main(["run", str(build), "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'meshplan[tensorboard]'" in err and "Traceback" not in err
    assert not (build / "run").exists()                 # no rank was started


def test_a_resumed_run_hides_the_earlier_runs_events_of_the_steps_it_trains_again(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardLog(tmp_path / "tb")
    for s in range(6):                                  # the earlier run got to step 5; its checkpoint was step 3
        first.write({"step": s, "loss": 10.0 + s})
    first.close()
    again = TensorBoardLog(tmp_path / "tb", first_step=3)
    again.write({"step": 3, "loss": 0.5})
    again.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 10.0), (1, 11.0), (2, 12.0), (3, 0.5)]


def test_events_reach_the_writer_every_few_seconds_not_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from runtime.tensorboard_log import HAND_OVER_S

    clock = _Clock()
    board = TensorBoardLog(tmp_path / "tb", clock=clock)

    def steps_on_disk():
        board._writer.flush()
        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        return [e.step for e in acc.Scalars("loss")] if "loss" in acc.Tags()["scalars"] else []

    board.write({"step": 0, "loss": 1.0})
    board.write({"step": 1, "loss": 1.0})
    assert steps_on_disk() == []                        # held: no wake-up of the writer thread per step
    clock.now += HAND_OVER_S
    board.write({"step": 2, "loss": 1.0})
    assert steps_on_disk() == [0, 1, 2]
    board.write({"step": 3, "loss": 1.0})
    board.close()                                       # the rest at the end
    assert steps_on_disk() == [0, 1, 2, 3]
