"""A build that reads a torch Dataset (the memory-mapped token file of examples/data) instead of a batch
factory: data 2 x pipeline 2 (4 gloo ranks) equals the single-process reference (--verify), and a run
resumed in the middle of an epoch continues bit-identically; DataLoader workers read what the rank
process reads."""

from pathlib import Path

import pytest
import torch

from examples.data.tokens import write_tokens
from planner.app.cli import main
from runtime.checkpoint import step_dir
from runtime.datasets import DatasetSpec, open_dataset
from runtime.launch.launcher import run_local
from tests.parallel_cases import assert_exact, saved_params

REPO = Path(__file__).resolve().parents[2]
SEQ, SAMPLES = 16, 27   # G 8: 3 steps per epoch, 3 samples dropped from each
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    text = (REPO / "examples/data/corpus.txt").read_bytes()[:SAMPLES * SEQ + 1]
    return write_tokens(tmp_path_factory.mktemp("tokens") / "corpus.bin", list(text), "uint16", 256)


def test_token_dataset_d2p2_verifies_and_resumes_mid_epoch_bit_exactly(tmp_path, token_file, capsys):
    build, ckpt = tmp_path / "build", tmp_path / "ckpt"
    assert main(["codegen", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--arg", "vocab_size=256",
                 "--batch", "8", "--data", "2", "--pipeline", "2", "--micro-batch", "2",
                 "--optimizer", "sgd", "--momentum", "0.9",
                 "--dataset", "examples/data/tokens.py:TokenFile", "--dataset-arg", f"path={token_file}",
                 "--dataset-arg", f"seq_len={SEQ}", "-o", str(build)]) == 0, capsys.readouterr().err
    full = run_local(build, steps=5, timeout=60, verify=True,
                     extra_args=["--checkpoint-dir", str(ckpt), "--save-every", "2"])
    assert_exact(full, "token dataset, data 2 x pipeline 2")
    p5 = saved_params(build)
    # step 2 starts at sample 16 of epoch 0; steps 3 and 4 are epoch 1's first two
    res = run_local(build, steps=3, timeout=60, extra_args=["--resume", str(step_dir(ckpt, 2)), "--save-params"])
    assert res.returncode == 0, res.output[-4000:]
    for r in range(4):
        assert res.losses[r] == full.losses[r][2:], f"rank {r}: losses of steps 2-4 differ after the resume"
    p = saved_params(build)
    assert p.keys() == p5.keys() == set(range(4))
    for r in range(4):
        assert p[r].keys() == p5[r].keys() and p[r]
        for name, t in p5[r].items():
            assert torch.equal(p[r][name], t), f"rank {r} {name}: 2 + resume + 3 steps != 5 steps"


def test_dataloader_workers_read_the_same_micro_batches(token_file):
    def batches(workers):
        spec = DatasetSpec("examples/data/tokens.py:TokenFile", {"path": str(token_file), "seq_len": SEQ},
                           workers=workers)
        src = open_dataset(spec, 8, 2, 1, 2)
        return [mb for step in range(4) for mb in src.micro_batches(step)]

    for ((x0,), y0), ((x2,), y2) in zip(batches(0), batches(2), strict=True):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)
