"""The trace of a GPU run times each instruction on the device (CUDA events), with the host's
intervals beside them, and `meshplan compare` reads the device clock.

One GPT of about 150M parameters (hidden 1024, 8 layers, vocabulary 50304, 8 x 1024 tokens per step,
bf16 autocast, AdamW, a clipped gradient norm) run with NCCL at world size 1: large enough that the
host queues the backward well before the device has run it (device-bound: about 7.4 TFLOP a step,
some 25 ms on an H100 at 300 TFLOP/s, against a few ms to queue its kernels), small enough that
the build and its 6 steps take well under a minute there.
"""

import json
import statistics

import pytest

from cost_models.hardware import Cluster
from planner.app.cli import main
from runtime.program.trace import Timeline
from runtime.vocab import Clock, Track

GPT = ["--arg", "vocab_size=50304", "--arg", "seq_len=1024", "--arg", "hidden=1024", "--arg", "num_layers=8",
       "--arg", "num_heads=16"]
STEPS = 6
# The blocking instructions F, B and STEP hold the step's work: on the device their intervals add up
# to nearly all of the step's wall time (ZERO_GRAD and the host's bookkeeping between instructions are
# the rest, a few percent on this model). A trace that timed only the host's queueing would sum to a
# small share.
MIN_SHARE = 0.8


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """(build dir, Timeline, per-step seconds) of the traced NCCL run."""
    tmp = tmp_path_factory.mktemp("cuda_timing")
    cluster = tmp / "h100x1.yaml"
    Cluster.preset("dgx-h100", devices=1).save(cluster)
    build = tmp / "build"
    assert main(["codegen", "examples/models/gpt.py:build", *GPT, "--batch", "8", "--micro-batch", "8", "--dtype",
                 "bf16", "--optimizer", "adamw", "--lr", "1e-4", "--clip-grad", "1.0", "--cluster", str(cluster),
                 "-o", str(build)]) == 0
    assert main(["run", str(build), "--steps", str(STEPS), "--backend", "nccl", "--trace", "--timeout", "300"]) == 0
    seconds = json.loads((build / "run" / "rank_0000.json").read_text())["seconds"]
    return build, Timeline.load(build / "timeline.json"), seconds


def _steady(tl):
    return sorted({e.step for e in tl.events})[1:]     # the first step is warm-up


def test_every_instruction_has_a_device_and_a_host_interval(gpu_run):
    _build, tl, _seconds = gpu_run
    assert tl.clock == Clock.CUDA
    assert sorted({e.step for e in tl.events}) == list(range(STEPS))
    for step in range(STEPS):
        ops = {}
        for e in tl.events:
            if e.step == step:
                ops.setdefault((e.index, e.op), []).append(e.track)
        for op in ("F", "B", "STEP"):
            tracks = [t for (i, o), ts in ops.items() if o == op for t in ts]
            assert sorted(tracks) == [Track.COMPUTE, Track.HOST], (step, op, tracks)
        for e in tl.events:
            assert e.end >= e.start, e


def test_device_intervals_add_up_to_the_step(gpu_run):
    """F + B + STEP on the device: at least MIN_SHARE of the step's wall time as run_step measured it
    (its own perf_counter, ending with the loss's .item()), and no more than all of it."""
    _build, tl, seconds = gpu_run
    for step in _steady(tl):
        busy = sum(e.duration for e in tl.events
                   if e.step == step and e.track == Track.COMPUTE and e.op in ("F", "B", "STEP"))
        assert MIN_SHARE * seconds[step] <= busy <= 1.01 * seconds[step], (step, busy, seconds[step])
        # the device's span of the step sits inside the same wall time
        assert tl.step_times()[step] <= 1.01 * seconds[step]


def test_backward_runs_longer_on_the_device_than_the_host_takes_to_queue_it(gpu_run):
    _build, tl, _seconds = gpu_run

    def median(track):
        return statistics.median(e.duration for e in tl.events
                                 if e.op == "B" and e.track == track and e.step in _steady(tl))
    device, host = median(Track.COMPUTE), median(Track.HOST)
    assert device > 1.2 * host, (device, host)


def test_compare_reports_the_device_clock_and_the_host_step(gpu_run, capsys):
    build, _tl, _seconds = gpu_run
    cluster = build.parent / "h100x1.yaml"
    assert main(["compare", str(build), "--cluster", str(cluster), "--no-pictures"]) == 0
    text = capsys.readouterr().out
    assert "clock: CUDA events on the device" in text and "host timeline:" in text and "host ms" in text
    assert "device-bound" in text, text
