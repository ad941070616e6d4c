"""The pieces of `meshplan run --verify` (runtime/verify/__init__.py) and the BatchNorm statistics it checks."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.recompute import keep_statistics
from runtime.reference import reference_step
from runtime.spec import TrainSpec
from runtime.verify.rounding import NUDGE, nudge


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


def _adamw_trajectory(grads: list[torch.Tensor], lr: float = 0.1) -> torch.Tensor:
    """The parameter after one AdamW step per gradient in `grads`, from zeros."""
    from runtime.execute.optim import OptimizerSpec

    p = nn.Parameter(torch.zeros_like(grads[0]))
    opt = OptimizerSpec(name="adamw", lr=lr).build([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_adam_turns_rounding_level_gradients_into_a_part_of_lr_and_the_allowance_covers_it():
    """A gradient element that cancels to 0 in one summation order and to a rounding residue in another
    moves its AdamW parameter by a sizeable part of lr (SGD would move it by lr x 1e-9): the
    allowance counts such elements from their measured noise and allows them Adam's step; a
    gradient that is really different still exceeds it."""
    from runtime.execute.optim import OptimizerSpec
    from runtime.verify.rounding import MARGIN, TOLERANCES, adam_allowance, adam_sensitive

    torch.manual_seed(0)
    steps, n, adamw = 5, 64, OptimizerSpec(name="adamw", lr=0.1)
    fraction = TOLERANCES["fp32"]["adam_steps"]
    grads = [torch.randn(n) for _ in range(steps)]
    for g in grads:
        g[:4] = 0.0                      # cancelled exactly in the reference's order (an attention key bias)
    rounded = [g.clone() for g in grads]
    for g in rounded:
        g[:4] = 1e-9                     # a rounding residue in the run's order
    ref, run = _adamw_trajectory(grads), _adamw_trajectory(rounded)
    diff = float((run - ref).norm())
    assert diff > 0.1 * 0.1              # a tenth of lr: far beyond the parameter's own rounding (~1e-8)
    # what check 1 measures: rounding-level twins' gradients scatter ~1e-9 around the exact one
    noise = MARGIN * torch.full((n,), 1e-9)
    sensitive = sum(adam_sensitive(g, noise, fraction, adamw.eps) for g in grads)
    assert sensitive == 4 * steps        # only the cancelled elements: the others' |g| ~ 1 dwarfs the noise
    allow = adam_allowance(adamw, steps, n, fraction, sensitive)
    assert diff <= allow
    assert adam_allowance(adamw, steps, n, fraction) < diff      # without them, the false MISMATCH
    wrong = [g.clone() for g in grads]
    for g in wrong:
        g[n // 2:] = -g[n // 2:]         # half the gradient wrong (a bucket from another rank, say)
    assert float((_adamw_trajectory(wrong) - ref).norm()) > 2 * allow
    assert adam_allowance(OptimizerSpec(name="sgd", lr=0.1), steps, n, fraction, sensitive) == 0.0


def test_non_finite_names_nan_before_inf():
    import math

    from runtime.verify.rounding import non_finite

    assert non_finite(torch.tensor([1.0, math.inf, math.nan])) == "NaN"
    assert non_finite(torch.tensor([1.0, -math.inf])) == "inf"
    assert non_finite(math.nan) == "NaN" and non_finite(2.0) is None
    assert non_finite(torch.tensor([1, 2])) is None


def test_a_run_whose_ranks_left_no_results_fails_saying_so(tmp_path):
    from pathlib import Path

    from runtime.verify import verify_build
    from tests.parallel_cases import emit_case

    build = Path(emit_case(tmp_path, "mlp", "d2", dict(data=2)))
    (build / "run").mkdir(exist_ok=True)
    cmp = verify_build(build, 3, {0: [1.0, 1.0, 1.0]})
    assert not cmp.ok and cmp.summary().startswith("FAILED: the run left no results to compare")
    assert "rank(s) 0, 1 left no results" in cmp.summary()
