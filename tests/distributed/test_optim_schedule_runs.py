"""AdamW with weight decay 0.1 on weight-decay groups, 2 warm-up steps then a cosine decay over 6
steps, over real processes (gloo): data 2 x tensor 2, data 2 x pipeline 2 and ZeRO-3 (data 2) equal
the single-process reference (`meshplan run --verify`), which steps the same groups with the same
implementation and schedule; a checkpoint after step 3 resumes the schedule bit-exactly.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import step_dir
from runtime.launch.launcher import run_local, run_many
from runtime.execute.lr_schedule import ScheduleSpec
from runtime.execute.optim import OptimizerSpec
from runtime.program import Program
from runtime.verify import verify_build
from tests.parallel_cases import assert_exact, emit_case

ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}
SCHEDULE = ScheduleSpec("cosine", warmup_steps=2, min_lr=0.001, decay_steps=6)
STEPS = 6
pytestmark = pytest.mark.timeout(600)


def _params(build: Path) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for f in sorted((build / "run").glob("params_rank_*.pt")):
        stages = torch.load(f, weights_only=True)
        out[int(f.stem.rsplit("_", 1)[1])] = {f"{s}/{k}": v for s, named in stages.items() for k, v in named.items()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optim")
    builds = {name: emit_case(root, "gpt", name, cfg, optimizer=ADAMW, schedule=SCHEDULE)
              for name, cfg in (("d2t2", dict(data=2, tensor=2)), ("d2p2", dict(data=2, pipeline=2)),
                                ("d2_zero3", dict(data=2, zero=3)))}
    four = run_many([builds["d2t2"], builds["d2p2"]], steps=STEPS, timeout=60, verify=True)
    ckpt = root / "ckpt"
    zero3 = run_local(builds["d2_zero3"], steps=STEPS, timeout=60, verify=True,
                      extra_args=["--checkpoint-dir", str(ckpt), "--save-every", "3"])
    return builds, {"d2t2": four[0], "d2p2": four[1], "d2_zero3": zero3}, _params(builds["d2_zero3"]), ckpt


@pytest.mark.parametrize("name", ["d2t2", "d2p2", "d2_zero3"])
def test_adamw_decay_groups_and_cosine_schedule_equal_single_process(runs, name):
    builds, results, _p, _c = runs
    assert_exact(results[name], name)
    for f in sorted((builds[name] / "run").glob("rank_*.json")):
        assert json.loads(f.read_text())["optimizer_impl"] == "fused", f"{f.name}: auto on CPU is fused"


def test_zero3_buckets_hold_one_decay_class(runs):
    builds = runs[0]
    spec = OptimizerSpec(**ADAMW)
    classes = set()
    for r, d in json.loads((builds["d2_zero3"] / "programs.json").read_text()).items():
        prog = Program.from_dict(d)
        shapes = dict(_shapes(builds["d2_zero3"]))
        for b in prog.buckets:
            assert {spec.decays(len(shapes[n])) for n in b.params} == {b.decay}, f"rank {r}: {b}"
            classes.add(b.decay)
    assert classes == {True, False}


def _shapes(build: Path):
    for s, named in torch.load(build / "run" / "params_rank_0000.pt", weights_only=True).items():
        for k, v in named.items():
            yield k, tuple(v.shape)


def test_verify_notices_a_reference_without_the_schedule(runs, tmp_path):
    builds, results, _p, _c = runs
    other = tmp_path / "constant_lr"
    shutil.copytree(builds["d2_zero3"], other)
    info = json.loads((other / "build.json").read_text())
    info["train"]["schedule"] = ScheduleSpec().to_dict()
    (other / "build.json").write_text(json.dumps(info))
    cmp = verify_build(other, STEPS, results["d2_zero3"].losses)
    assert not cmp.ok, "the reference stepped with a constant lr, the run with warm-up and cosine decay"


def test_resume_after_step_3_continues_the_schedule_bit_exactly(runs):
    builds, results, p6, ckpt = runs
    b = builds["d2_zero3"]
    res = run_local(b, steps=3, timeout=60, extra_args=["--resume", str(step_dir(ckpt, 3)), "--save-params"])
    assert res.returncode == 0, res.output[-4000:]
    six = results["d2_zero3"]
    for r in range(2):
        assert res.losses[r] == six.losses[r][3:], f"rank {r}: losses of steps 3-5 differ"
    p = _params(b)
    assert p.keys() == p6.keys() and all(p[r].keys() == p6[r].keys() for r in p6)
    for r in p6:
        for name, t in p6[r].items():
            assert torch.equal(p[r][name], t), f"rank {r} {name}: 3 + resume + 3 steps != 6 steps"
