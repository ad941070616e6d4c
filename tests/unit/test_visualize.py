"""Plan pictures and the HTML report: files written, readable, and bad input refused."""

import dataclasses

import matplotlib.image
import pytest
import torch

import planner
from examples.models import gpt
from planner.report import write_report
from planner.visualize import ScheduleRecord, predicted_schedule, visualize


@pytest.fixture(scope="module")
def small():
    with torch.device("meta"):
        model = gpt.build(preset="small")
    return planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="small"))


@pytest.fixture(scope="module")
def plan(small):
    return planner.optimize(small, planner.Cluster.preset("dgx-a100-80gb", nodes=2), global_batch_size=64,
                            progress=False, constraints={"pipeline": 4})


def test_pictures_are_written_and_readable(plan, tmp_path):
    files = visualize(plan, tmp_path / "gpt")
    names = sorted(f.name for f in files)
    for kind in ("mesh", "memory", "time", "alternatives", "schedule"):
        assert f"gpt_{kind}.png" in names and f"gpt_{kind}.svg" in names
    for f in files:
        assert f.stat().st_size > 1000
        if f.suffix == ".png":
            img = matplotlib.image.imread(f)
            assert img.shape[0] > 200 and img.shape[1] > 400
        else:
            assert "Device mesh" in f.read_text() or "GPT" in f.read_text()


def test_large_cluster_draws_one_replica(small, tmp_path):
    big = planner.make_plan(small, planner.Cluster.preset("dgx-a100-80gb", nodes=64),
                            planner.ParallelConfig(data=128, pipeline=4), global_batch_size=512)
    files = visualize(big, tmp_path, formats=("svg",))
    mesh = next(f for f in files if f.name == "mesh.svg").read_text()
    assert "data replicas" in mesh


def test_predicted_1f1b_makespan(small):
    cfg = planner.ParallelConfig(data=4, pipeline=4, micro_batch_size=2)
    plan = planner.make_plan(small, planner.Cluster.preset("dgx-a100-80gb", nodes=2), cfg, global_batch_size=64)
    # uniform stages make the makespan exactly (m + p - 1) (f + b)
    st = plan.prediction.stages[0]
    uniform = dataclasses.replace(plan.prediction, stages=tuple(dataclasses.replace(s, forward=st.forward,
                                                                                    backward=st.backward)
                                                               for s in plan.prediction.stages))
    plan = dataclasses.replace(plan, prediction=uniform)
    recs = predicted_schedule(plan, max_micro_batches=8)
    m, p = 8, 4
    per_rank = {}
    for r in recs:
        per_rank.setdefault(r.rank, []).append(r)
    assert len(per_rank) == p and all(len(v) == 2 * m for v in per_rank.values())
    makespan = max(r.end for r in recs) - min(r.start for r in recs)
    assert makespan == pytest.approx((m + p - 1) * (st.forward + st.backward))


def test_html_report_is_self_contained(plan, tmp_path):
    out = write_report(plan, tmp_path / "sub" / "report.html")
    text = out.read_text()
    assert text.count("<svg") == 5 and "Summary" in text and "mesh:" in text and "chosen:" in text
    assert "src=\"http" not in text and "<script" not in text


def test_bad_input(plan, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create directory|not a directory"):
        visualize(plan, blocker / "deeper" / "gpt")
    with pytest.raises(ValueError, match="end"):
        visualize(plan, tmp_path / "x", timeline=[ScheduleRecord(0, "F s0 m0", "forward", 2.0, 1.0)])
    with pytest.raises(ValueError, match=".html"):
        write_report(plan, tmp_path / "report.txt")
