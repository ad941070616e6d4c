"""Everything a real run needs, together, against the single-process reference (gloo, real processes).

One build per plan the issue names (data 2 x tensor 2, data 2 x pipeline 2, ZeRO-3 over data 2) of the
example GPT reading the memory-mapped token file (a Dataset, DataLoader rows per data rank), AdamW with
weight decay on matrices only, linear warmup then cosine decay to a floor (torch.optim.lr_scheduler),
clipping at a global norm the run exceeds, fp16 autocast with dynamic loss scaling whose first scale
overflows (a skipped step) and grows back, and held-out evaluation every 2 steps. `meshplan run --verify`
compares losses, gradients, norms, skips, scales, evaluations and parameters with the single-process
loop (torch.amp.GradScaler, clip_grad_norm_, the same scheduler). Then a resume in the middle of an
epoch, with a schedule part-way and a loss scaler that has backed off, is bit-identical to the uninterrupted run.
"""

import json
from pathlib import Path

import pytest
import torch

from examples.data.tokens import write_tokens
from planner.app.cli import main
from runtime.checkpoint import step_dir
from runtime.launch.launcher import run_local, run_many
from tests.parallel_cases import assert_exact

REPO = Path(__file__).resolve().parents[2]
SEQ, SAMPLES, STEPS, CLIP, INIT_SCALE = 16, 27, 6, 0.3, 2.0 ** 20   # G 8: 3 steps per epoch
PLANS = {"d2t2": ["--data", "2", "--tensor", "2"], "d2p2": ["--data", "2", "--pipeline", "2"],
         "d2_zero3": ["--data", "2", "--zero", "3"]}
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("features")
    text = (REPO / "examples/data/corpus.txt").read_bytes()
    write_tokens(root / "train.bin", list(text[:SAMPLES * SEQ + 1]), "uint16", 256)
    write_tokens(root / "val.bin", list(text[-(4 * 8 * SEQ + 1):]), "uint16", 256)
    return root


def codegen(root: Path, name: str, plan: list[str]) -> Path:
    out = root / name
    argv = ["codegen", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--arg", "vocab_size=256",
            "--batch", "8", "--micro-batch", "2", *plan, "--dtype", "fp16",
            "--dataset", "examples/data/tokens.py:TokenFile", "--dataset-arg", f"path={root / 'train.bin'}",
            "--dataset-arg", f"seq_len={SEQ}", "--eval-dataset-arg", f"path={root / 'val.bin'}",
            "--eval-dataset-arg", f"seq_len={SEQ}", "--eval-every", "2", "--eval-batches", "2",
            "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--lr-schedule", "cosine",
            "--warmup-steps", "2", "--decay-steps", str(STEPS), "--min-lr", "0.001", "--clip-grad", str(CLIP),
            "--loss-scale-init", str(int(INIT_SCALE)), "--loss-scale-growth-interval", "3", "--bucket-mb", "0.002",
            "-o", str(out)]
    assert main(argv) == 0
    return out


def record(build: Path, rank: int = 0) -> dict:
    return json.loads((build / "run" / f"rank_{rank:04d}.json").read_text())


@pytest.fixture(scope="module")
def runs(root):
    """Every plan's verified run; data 2 x pipeline 2 also saves a checkpoint after step 4 (root/ckpt)."""
    builds = {name: codegen(root, name, plan) for name, plan in PLANS.items()}
    four = ["d2p2", "d2t2"]   # run_many starts builds of one world size together
    ckpt = ["--checkpoint-dir", str(root / "ckpt"), "--save-every", "4"]
    results = dict(zip(four, run_many([builds[n] for n in four], steps=STEPS, timeout=120, verify=True,
                                      build_args=[ckpt, []])))
    results["d2_zero3"] = run_many([builds["d2_zero3"]], steps=STEPS, timeout=120, verify=True)[0]
    return builds, results


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_training_feature_together_equals_the_single_process_run(runs, name):
    builds, results = runs
    res = results[name]
    assert_exact(res, name)
    cmp = res.comparison
    rec = record(builds[name])
    assert cmp.skips_compared == STEPS and any(rec["skipped"]) and not all(rec["skipped"]), rec["skipped"]
    assert max(n for n in rec["grad_norms"] if n is not None) > CLIP, rec["grad_norms"]   # clipping applied
    assert rec["loss_scales"][0] == INIT_SCALE and len(set(rec["loss_scales"])) > 1
    assert [e["step"] for e in rec["evals"]] == [1, 3, 5]
    lines = [json.loads(x) for x in (builds[name] / "metrics.jsonl").read_text().splitlines()]
    lrs = [x["lr"] for x in lines]
    assert lrs[0] < lrs[1] < lrs[2] and lrs[2] == pytest.approx(0.01) and lrs[-1] < lrs[3], lrs   # warmup, decay
    for r in range(res.world_size):   # every rank took the same decisions
        assert record(builds[name], r)["skipped"] == rec["skipped"]


def test_resume_mid_epoch_with_schedule_and_loss_scale_is_bit_identical(runs, root):
    """The verified 6-step run (its parameters saved) is the uninterrupted run."""
    build, full = runs[0]["d2p2"], runs[1]["d2p2"]
    ckpt = root / "ckpt"
    assert full.returncode == 0, full.output[-4000:]
    first = record(build)
    assert any(first["skipped"][:4]) and len(set(first["loss_scales"][:5])) > 1, \
        f"the checkpoint must hold a scaler that has backed off ({first['loss_scales']}, {first['skipped']})"
    p_full = {r: torch.load(build / "run" / f"params_rank_{r:04d}.pt", weights_only=True) for r in range(4)}
    # step 4 is the second step of epoch 1 (3 steps per epoch): the resume starts mid-epoch
    res = run_local(build, steps=STEPS - 4, timeout=120, extra_args=["--resume", str(step_dir(ckpt, 4)),
                                                                      "--save-params"])
    assert res.returncode == 0, res.output[-4000:]
    again = record(build)
    assert again["loss_scales"] == first["loss_scales"][4:] and again["skipped"] == first["skipped"][4:]
    for r in range(4):
        assert res.losses[r] == full.losses[r][4:], f"rank {r}: losses after the resume differ"
        p = torch.load(build / "run" / f"params_rank_{r:04d}.pt", weights_only=True)
        for s, named in p_full[r].items():
            for k, t in named.items():
                assert torch.equal(p[s][k], t), f"rank {r} {k}: 4 + resume + 2 steps != 6 steps"
