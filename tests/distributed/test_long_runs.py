"""Long runs through `meshplan run` (gloo, 2 ranks): the trace window, metrics.jsonl history across a
resume, step numbers from the checkpoint, and a NaN loss stopping every rank at its step."""

import json

from planner.app.cli import main
from runtime.launch.launcher import run_local
from runtime.program.trace import TRACE_WINDOW_STEPS, Timeline


def _metric_steps(build):
    return [json.loads(line)["step"] for line in (build / "metrics.jsonl").read_text().splitlines()]


def _printed_losses(out: str) -> dict[str, str]:
    """'step N' -> 'loss X' as `meshplan run` prints them (without the step's time)."""
    return {ln.split(":")[0]: ln.split(":")[1].split("(")[0].strip() for ln in out.splitlines()
            if ln.startswith("step ")}


def test_trace_window_then_resume_numbers_steps_on_and_keeps_the_history(tmp_path, capsys):
    build, ckpt = tmp_path / "build", tmp_path / "ckpt"
    assert main(["codegen", "examples/models/mlp.py:build", "--batch", "4", "--data", "2", "-o", str(build)]) == 0
    steps = TRACE_WINDOW_STEPS + 3
    assert main(["run", str(build), "--steps", str(steps), "--timeout", "60", "--checkpoint-dir", str(ckpt),
                 "--save-every", str(steps - 2)]) == 0
    first = capsys.readouterr().out
    # by default only the first TRACE_WINDOW_STEPS steps are traced
    assert {e.step for e in Timeline.load(build / "timeline.json").events} == set(range(TRACE_WINDOW_STEPS))
    assert _metric_steps(build) == list(range(steps))

    resume_at = steps - 2
    assert main(["run", str(build), "--steps", "2", "--timeout", "60", "--resume", str(ckpt / f"step_{resume_at:08d}"),
                 "--no-trace"]) == 0
    text = capsys.readouterr().out
    assert f"resumed from checkpoint {ckpt / f'step_{resume_at:08d}'} (step {resume_at})" in text
    resumed = _printed_losses(text)
    assert list(resumed) == [f"step {resume_at}", f"step {resume_at + 1}"]
    # the resumed steps repeat the first run's losses exactly (same parameters, optimizer state and data)
    assert resumed == {k: _printed_losses(first)[k] for k in resumed}
    # the history before the checkpoint is kept, the resumed steps are not written twice
    assert _metric_steps(build) == list(range(resume_at + 2))
    # --no-trace: no trace, and the first run's is not left to pass for this one's
    assert not (build / "timeline.json").exists() and not (build / "trace.json").exists()
    assert "(no trace)" in text


def test_a_nan_loss_stops_every_rank_at_its_step(tmp_path):
    build = tmp_path / "build"
    # a two-stage pipeline: the last stage's rank sees the loss, the first stage's rank is told
    assert main(["codegen", "examples/models/mlp.py:build", "--batch", "4", "--pipeline", "2", "--micro-batch", "2",
                 "--data-ref", "tests/nan_batch.py:batch_with_nan", "--data-arg", "nan_seed=1002",
                 "-o", str(build)]) == 0
    res = run_local(build, steps=5, timeout=60)
    assert res.returncode != 0 and set(res.returncodes) == {0, 1} and all(res.returncodes.values())
    assert "meshplan rank 1: error: the loss is nan at step 2 (rank 1" in res.output
    assert "meshplan rank 0: stopping because another rank failed" in res.output
    assert "the loss is nan at step 2" in res.output.split("meshplan rank 0: stopping")[1].splitlines()[0]
    assert _metric_steps(build) == [0, 1, 2]
    assert "Traceback" not in res.output


def test_adamw_data_parallel_verifies_and_nan_is_named_not_diffed(tmp_path):
    import math

    import torch

    from runtime.verify import verify_build

    build = tmp_path / "build"
    assert main(["codegen", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--batch", "4", "--data", "2",
                 "--optimizer", "adamw", "-o", str(build)]) == 0
    res = run_local(build, steps=3, timeout=60, verify=True)
    assert res.returncode == 0 and res.comparison.ok, res.comparison.summary()
    # the same run's records with a NaN put in: each named where it is, never as a difference
    nan_loss = {r: [math.nan, *ls[1:]] for r, ls in res.losses.items()}
    cmp = verify_build(build, 3, nan_loss)
    assert not cmp.ok and "NaN in the run's loss at step 0" in cmp.summary()
    assert "NaN in rank 0's loss at step 0" in cmp.summary() and "diff" not in cmp.summary()
    params = build / "run" / "params_rank_0001.pt"
    saved = torch.load(params, weights_only=True)
    stage, tensors = next(iter(saved.items()))
    name = next(iter(tensors))
    tensors[name].view(-1)[0] = math.inf
    torch.save(saved, params)
    cmp = verify_build(build, 3, res.losses)
    assert not cmp.ok and f"inf in parameter {name} on rank 1 after step 2" in cmp.summary()
    assert "differs from the reference" not in cmp.summary()
