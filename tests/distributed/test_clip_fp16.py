"""Global-norm gradient clipping and fp16 dynamic loss scaling over real processes (gloo).

GPT (tiny) in fp16 autocast, clipped to a norm its gradients exceed (0.5; they are about 0.6), with a
first loss scale (2**22) at which its fp16 backward overflows and a growth interval (3) short enough
that the scale also grows back into an overflow: on data 2 x tensor 2, data 2 x pipeline 2 (tied
embedding copies on two stages) and ZeRO-3, `meshplan run --verify` passes: the per-step gradients
(unscaled, unclipped) and global norms equal the exact ones from the same parameters, the skipped
steps are those where the reference at the same scale overflows, and the trajectory, the scales and
the skips equal the single-process loop with torch.amp.GradScaler and clip_grad_norm_.
Then a resume from a checkpoint saved after the scale changed is bit-identical to the run that went on.
"""

import json
from pathlib import Path

import pytest
import torch

import planner
from planner.app.commands import make_fixed_plan
from codegen.emit import emit
from runtime.checkpoint import step_dir
from runtime.launch.launcher import run_local, run_many
from runtime.execute.loss_scale import LossScaleSpec
from tests.parallel_cases import MODELS, SGD, assert_exact, graph_of

pytestmark = pytest.mark.timeout(600)

CLIP = 0.5
SCALING = LossScaleSpec(init_scale=2.0 ** 22, growth_interval=3)
STEPS = 6
PLANS = {"d2t2": dict(data=2, tensor=2), "d2p2": dict(data=2, pipeline=2), "d2_zero3": dict(data=2, zero=3)}


def emit_fp16(root: Path, name: str, cfg: dict) -> Path:
    """GPT tiny, fp16 with loss scaling and clipping, on `cfg` (global batch 8, micro-batch 2)."""
    ref, kw = MODELS["gpt"]
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp16", **cfg)
    cluster = planner.Cluster.preset("local", devices=config.num_devices)   # its fp16 rate is measured
    plan = make_fixed_plan(graph_of("gpt"), cluster, config, 8)
    return emit(plan, ref, None, root / name, model_kwargs=kw, graph=graph_of("gpt"), optimizer=SGD,
                bucket_bytes=2048, clip_grad=CLIP, loss_scale=SCALING).path


def outcomes(build: Path, rank: int = 0) -> dict:
    return json.loads((build / "run" / f"rank_{rank:04d}.json").read_text())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("clip_fp16")


@pytest.fixture(scope="module")
def runs(root):
    """Every plan's verified run; data 2 x pipeline 2 also saves a checkpoint after step 3 (root/ckpt_d2p2)."""
    builds = {name: emit_fp16(root, name, cfg) for name, cfg in PLANS.items()}
    four = [n for n in builds if n != "d2_zero3"]
    ckpt = ["--checkpoint-dir", str(root / "ckpt_d2p2"), "--save-every", "3"]
    results = dict(zip(four, run_many([builds[n] for n in four], steps=STEPS, timeout=60, verify=True,
                                      build_args=[ckpt if n == "d2p2" else [] for n in four])))
    results["d2_zero3"] = run_many([builds["d2_zero3"]], steps=STEPS, timeout=60, verify=True)[0]
    return builds, results


@pytest.mark.parametrize("name", sorted(PLANS))
def test_clipped_fp16_run_with_skipped_steps_equals_grad_scaler_reference(runs, name):
    builds, results = runs
    assert_exact(results[name], name)
    cmp = results[name].comparison
    assert cmp.skips_compared == STEPS, cmp.summary()
    rec = outcomes(builds[name])
    skipped, norms, scales = rec["skipped"], rec["grad_norms"], rec["loss_scales"]
    assert any(skipped) and not all(skipped), f"{name}: the run must overflow at least once and step at least once"
    assert cmp.norms_compared == skipped.count(False)
    assert max(n for n in norms if n is not None) > CLIP, f"{name}: no step was clipped ({norms})"
    assert scales[0] == SCALING.init_scale and len(set(scales)) > 1
    for r in range(results[name].world_size):   # every rank took the same decisions
        assert outcomes(builds[name], r)["skipped"] == skipped
    assert "the step is skipped on every rank" in results[name].output


def test_resume_after_the_scale_changed_is_bit_identical(runs, root):
    """The verified 6-step run (its parameters saved) is the run that went on from the checkpoint."""
    b, six = runs[0]["d2p2"], runs[1]["d2p2"]
    ckpt = root / "ckpt_d2p2"
    assert six.returncode == 0, six.output[-4000:]
    first = outcomes(b)
    assert first["loss_scales"][3] != SCALING.init_scale, "the checkpoint must hold a changed scale"
    p6 = {r: torch.load(b / "run" / f"params_rank_{r:04d}.pt", weights_only=True) for r in range(4)}
    res = run_local(b, steps=STEPS - 3, timeout=60, extra_args=["--resume", str(step_dir(ckpt, 3)), "--save-params"])
    assert res.returncode == 0, res.output[-4000:]
    again = outcomes(b)
    assert again["loss_scales"] == first["loss_scales"][3:] and again["skipped"] == first["skipped"][3:]
    for r in range(4):
        assert res.losses[r] == six.losses[r][3:], f"rank {r}: losses of steps 3-5 differ"
        p = torch.load(b / "run" / f"params_rank_{r:04d}.pt", weights_only=True)
        for s, named in p6[r].items():
            for k, t in named.items():
                assert torch.equal(p[s][k], t), f"rank {r} {k}: 3 + resume + 3 steps != 6 steps"
