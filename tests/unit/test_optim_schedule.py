"""Optimizer implementation and weight-decay groups (runtime/execute/optim.py), lr schedules
(runtime/execute/lr_schedule.py), their build settings and flags, and buckets that never mix decay classes."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from codegen.strategies.data import make_buckets
from runtime.checkpoint import optimizer_param_names
from runtime.execute.lr_schedule import LrScheduleError, ScheduleSpec, current_lr, load_scheduler_state, scheduler_state
from runtime.execute.optim import NoDecay, OptimizerImpl, OptimizerSpec, optimizer_order, rank_optimizer
from runtime.program import Bucket, Program
from runtime.spec import TrainSpec

LR, MIN = 0.1, 0.01


def closed_form(kind: str, t: int, w: int, d: int | None, lr: float = LR, m: float = MIN) -> float:
    """The lr step t uses (runtime/execute/lr_schedule.py's module docstring)."""
    if t < w:
        return lr * (t + 1) / (w + 1)
    if kind == "constant":
        return lr
    if t >= d:
        return m
    if kind == "cosine":
        return m + (lr - m) * (1 + math.cos(math.pi * (t - w) / (d - w))) / 2
    return lr + (m - lr) * (t - w) / (d - w)


def lrs(spec: ScheduleSpec, steps: int, lr: float = LR) -> list[float]:
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=lr)
    sched = spec.build(opt)
    out = []
    for _ in range(steps):
        out.append(current_lr(opt))
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind,w,d", [("cosine", 2, 6), ("cosine", 0, 5), ("linear", 3, 7), ("linear", 0, 4),
                                      ("constant", 3, None), ("constant", 0, None)])
def test_schedule_lr_per_step_equals_the_closed_form_far_past_decay_steps(kind, w, d):
    min_lr = MIN if kind != "constant" else 0.0
    got = lrs(ScheduleSpec(kind, w, min_lr, d), 40)   # 40 steps: CosineAnnealingLR alone would climb back
    want = [closed_form(kind, t, w, d) for t in range(40)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    if w:
        assert got[0] == pytest.approx(LR / (w + 1)) and got[w] == pytest.approx(LR)


def test_cosine_to_zero_floor_stays_at_zero():
    got = lrs(ScheduleSpec("cosine", 1, 0.0, 4), 12)
    assert got[4:] == [0.0] * 8


@pytest.mark.parametrize("fields,words", [
    (dict(kind="cosine"), "needs decay_steps"),
    (dict(kind="linear", warmup_steps=4, decay_steps=4), "greater than warmup_steps"),
    (dict(kind="constant", min_lr=0.01), "belong to a decaying schedule"),
    (dict(kind="constant", decay_steps=3), "belong to a decaying schedule"),
    (dict(kind="step"), "unknown lr schedule"),
    (dict(warmup_steps=-1), "warmup_steps"),
])
def test_schedule_refuses_what_it_cannot_build(fields, words):
    with pytest.raises(LrScheduleError, match=words):
        ScheduleSpec(**fields)


def test_min_lr_above_the_peak_is_refused_by_the_build_settings():
    with pytest.raises(LrScheduleError, match="above the peak lr"):
        TrainSpec("m.py:f", "m.py:d", 8, optimizer=OptimizerSpec(lr=0.01),
                  schedule=ScheduleSpec("cosine", 0, 0.1, 5))


def test_scheduler_state_resumes_the_schedule_exactly():
    spec = ScheduleSpec("cosine", 2, MIN, 6)
    whole = lrs(spec, 10)
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=LR)
    sched = spec.build(opt)
    for _ in range(3):
        opt.step()
        sched.step()
    saved = scheduler_state(sched, opt)
    q = nn.Parameter(torch.zeros(3))
    opt2 = torch.optim.AdamW([q], lr=LR)
    sched2 = spec.build(opt2)
    load_scheduler_state(sched2, opt2, saved)
    resumed = []
    for _ in range(7):
        resumed.append(current_lr(opt2))
        opt2.step()
        sched2.step()
    assert resumed == whole[3:]


def test_train_spec_round_trips_schedule_and_optimizer_settings():
    spec = TrainSpec("m.py:f", "m.py:d", 8,
                     optimizer=OptimizerSpec("adamw", lr=0.01, weight_decay=0.1, impl="foreach", no_decay="none"),
                     schedule=ScheduleSpec("linear", 2, 0.001, 9))
    back = TrainSpec.from_dict(spec.to_dict())
    assert back == spec
    assert back.optimizer.impl is OptimizerImpl.FOREACH and back.optimizer.no_decay is NoDecay.NONE
    assert TrainSpec.from_dict({k: v for k, v in spec.to_dict().items() if k != "schedule"}).schedule == ScheduleSpec()
    with pytest.raises(ValueError, match="unknown schedule field"):
        TrainSpec.from_dict({**spec.to_dict(), "schedule": {"kind": "cosine", "period": 3}})
    with pytest.raises(ValueError, match="unknown optimizer implementation 'fast'"):
        OptimizerSpec(impl="fast")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))


def test_weight_decay_groups_leave_biases_and_norm_weights_undecayed():
    m = _model()
    opt = OptimizerSpec("adamw", lr=0.01, weight_decay=0.1).build(m.parameters())
    decayed, other = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and other["weight_decay"] == 0.0
    assert [p.dim() for p in decayed["params"]] == [2, 2] and [p.dim() for p in other["params"]] == [1, 1, 1]
    # numbers: an undecayed parameter with zero gradient does not move under AdamW; a decayed one shrinks
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt.step()
    assert torch.equal(m[1].weight, before["1.weight"]) and torch.equal(m[0].bias, before["0.bias"])
    assert torch.equal(m[0].weight, before["0.weight"] * (1 - 0.01 * 0.1))
    one = OptimizerSpec("sgd", weight_decay=0.1, no_decay="none").build(_model().parameters())
    assert len(one.param_groups) == 1 and one.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_implementations_are_the_flags_torch_reads_and_step_alike(name):
    results = {}
    for impl in (OptimizerImpl.FOR_LOOP, OptimizerImpl.FOREACH, OptimizerImpl.FUSED):
        m = _model()
        opt = OptimizerSpec(name, lr=0.01, momentum=0.9, weight_decay=0.1, impl=impl).build(m.parameters())
        assert opt.defaults["foreach"] is (impl is OptimizerImpl.FOREACH)
        assert opt.defaults["fused"] is (impl is OptimizerImpl.FUSED)
        for _ in range(3):
            for p in m.parameters():
                p.grad = torch.sin(p.detach() * 7)
            opt.step()
        results[impl] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    base = results[OptimizerImpl.FOR_LOOP]
    for impl, r in results.items():
        torch.testing.assert_close(r, base, rtol=1e-6, atol=1e-7, msg=f"{name} {impl.value}")


def test_auto_resolves_by_device():
    assert OptimizerSpec("adamw").resolve_impl("cuda") is OptimizerImpl.FUSED
    assert OptimizerSpec("sgd").resolve_impl("cuda") is OptimizerImpl.FOREACH
    assert OptimizerSpec("adamw").resolve_impl("cpu") is OptimizerImpl.FUSED   # benchmarks/optimizer_impl.py
    assert OptimizerSpec("sgd").resolve_impl("cpu") is OptimizerImpl.FUSED
    assert OptimizerSpec("sgd", impl="for-loop").resolve_impl("cuda") is OptimizerImpl.FOR_LOOP


PARAMS = [("b.weight", (8, 4), "float32"), ("b.bias", (8,), "float32"), ("ln.weight", (8,), "float32"),
          ("ln.bias", (8,), "float32"), ("a.weight", (4, 4), "float32"), ("a.bias", (4,), "float32")]


def test_buckets_never_mix_decay_classes_and_record_theirs():
    spec = OptimizerSpec("adamw", weight_decay=0.1)
    buckets = make_buckets(0, PARAMS, 2, cap_bytes=1 << 20, decay_of=spec.decays)
    assert [(b.params, b.decay) for b in buckets] == [
        (("b.weight",), True), (("b.bias", "ln.weight", "ln.bias"), False), (("a.weight",), True),
        (("a.bias",), False)]
    assert [b.params for b in make_buckets(0, PARAMS, 2, cap_bytes=1 << 20)] == [tuple(n for n, _s, _d in PARAMS)]
    prog = Program(rank=0, world_size=2, mesh=(("data", 2),), coords=(0,), stages=(0,), num_stages=1,
                   num_micro_batches=1, micro_batch_size=1, instrs=(), zero=1, buckets=tuple(buckets))
    assert Program.from_dict(prog.to_dict()).buckets == prog.buckets


def _zero_grads(buckets, params_by_bucket):
    states = [SimpleNamespace(index=i, bucket=b, params=ps, shard=nn.Parameter(torch.zeros(2)))
              for i, (b, ps) in enumerate(zip(buckets, params_by_bucket))]
    return SimpleNamespace(zero=1, shards=True, states=states)


def test_zero_shards_take_their_buckets_group_and_mixed_buckets_are_refused():
    spec = OptimizerSpec("adamw", weight_decay=0.1)
    w, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    grads = _zero_grads([Bucket(0, ("b",), 2, 8, decay=False), Bucket(0, ("w",), 4, 16)], [[b], [w]])
    shards = [st.shard for st in grads.states]
    opt = rank_optimizer(spec, shards, grads, "cpu")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert optimizer_order(opt) == [shards[1], shards[0]]
    names = optimizer_param_names({}, grads, optimizer_order(opt))
    assert names == ["bucket/1", "bucket/0"]
    mixed = _zero_grads([Bucket(0, ("w", "b"), 6, 24)], [[w, b]])
    with pytest.raises(ValueError, match="generate the build again"):
        rank_optimizer(spec, [mixed.states[0].shard], mixed, "cpu")
    rank_optimizer(OptimizerSpec("adamw"), [mixed.states[0].shard], mixed, "cpu")   # no decay: nothing to split


def test_codegen_flags_make_the_settings_and_name_bad_values():
    from planner.app.cli import build_parser

    base = ["codegen", "examples/models/mlp.py:build", "--batch", "8", "--optimizer", "adamw", "--lr", "0.01"]
    args = build_parser().parse_args(base + ["--optimizer-impl", "foreach", "--no-decay", "none", "--lr-schedule",
                                             "cosine", "--warmup-steps", "2", "--decay-steps", "6", "--min-lr",
                                             "0.001"])
    from codegen.train_flags import optimizer_and_schedule

    opt, sched = optimizer_and_schedule(args)
    assert opt.impl is OptimizerImpl.FOREACH and opt.no_decay is NoDecay.NONE
    assert sched == ScheduleSpec("cosine", 2, 0.001, 6)
    with pytest.raises(LrScheduleError, match="--decay-steps"):
        optimizer_and_schedule(build_parser().parse_args(base + ["--lr-schedule", "linear"]))
