"""The pieces of `meshplan run --verify` (runtime/verify.py) and the BatchNorm statistics it checks."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.recompute import keep_statistics
from runtime.reference import reference_step
from runtime.spec import TrainSpec
from runtime.verify import NUDGE, nudge


class BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _spec():
    return TrainSpec(model_ref="x.py:build", data_ref="x.py:data", global_batch_size=8)


def test_reference_statistics_follow_each_data_rank_then_average():
    """Groups [0, 0, 1, 1]: ranks 0 and 1 each update the statistics from the step's start over their
    two micro-batches, then the mean is kept (as the runtime's ALLREDUCE stats does)."""
    torch.manual_seed(0)
    model = BN()
    chunks = [((torch.randn(2, 2, 6, 6),), torch.randint(0, 3, (2,))) for _ in range(4)]
    manual = []
    for half in (chunks[:2], chunks[2:]):
        m = copy.deepcopy(model)
        for (x,), _y in half:
            m(x)
        manual.append(m.bn)
    reference_step(model, _spec(), chunks, [0, 0, 1, 1])
    torch.testing.assert_close(model.bn.running_mean, (manual[0].running_mean + manual[1].running_mean) / 2)
    torch.testing.assert_close(model.bn.running_var, (manual[0].running_var + manual[1].running_var) / 2)
    assert int(model.bn.num_batches_tracked) == 2
    with pytest.raises(ValueError, match="micro-batch size"):
        reference_step(model, _spec(), chunks, [0, 1])


def test_recomputation_does_not_update_batchnorm_statistics_twice():
    torch.manual_seed(0)
    model, x = BN(), torch.randn(4, 2, 6, 6)
    plain = copy.deepcopy(model)
    plain(x).sum().backward()
    checkpoint(model, x, use_reentrant=False, context_fn=keep_statistics(model)).sum().backward()
    assert torch.equal(model.bn.running_mean, plain.bn.running_mean)
    assert torch.equal(model.bn.num_batches_tracked, plain.bn.num_batches_tracked)
    twice = copy.deepcopy(plain)
    checkpoint(twice, x, use_reentrant=False).sum().backward()   # without it: updated in the recomputation too
    assert not torch.equal(twice.bn.running_mean, model.bn.running_mean)


def test_rounding_level_twin_moves_every_parameter_by_one_step():
    torch.manual_seed(0)
    model = nn.Linear(5, 7)
    before = [p.detach().clone() for p in model.parameters()]
    nudge(model, seed=1)
    for p, b in zip(model.parameters(), before):
        up, down = torch.nextafter(b, torch.tensor(float("inf"))), torch.nextafter(b, torch.tensor(-float("inf")))
        assert torch.all((p == up) | (p == down))
    model = nn.Linear(5, 7)
    before = [p.detach().clone() for p in model.parameters()]
    nudge(model, seed=1, dtype="bf16")
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close((p - b).abs(), b.abs() * NUDGE["bf16"])
