"""runtime/execute/evaluation.py: the evaluation settings and their flags, the forward part of each kind of
Program, accuracy (also over vocabulary-parallel logits), and how results are combined and compared."""

import contextlib
import io
import json

import pytest
import torch
from torch import nn

from codegen.lower import lower
from planner.app.cli import main
from runtime.execute.eval_support import check_program, check_supported
from runtime.execute.evaluation import (EvalError, EvalResult, EvalSpec, compare_evals, count_correct, eval_setting,
                                        forward_only)
from runtime.execute.evaluation import evaluate_held_out as evaluate
from runtime.program import Program
from runtime.spec import TrainSpec
from runtime.vocab import MeshAxis
from tests.parallel_cases import graph_of, plan_for
from tests.tp_threads import run_ranks

# ---- settings ---------------------------------------------------------------------------


@pytest.mark.parametrize("every,batches,flag", [(0, 1, "--eval-every"), (-2, 1, "--eval-every"),
                                                (True, 1, "--eval-every"), (2, 0, "--eval-batches"),
                                                (2, 1.5, "--eval-batches")])
def test_eval_spec_refuses_what_is_not_a_positive_whole_number(every, batches, flag):
    with pytest.raises(EvalError, match=flag):
        EvalSpec(every, batches)


def test_eval_spec_is_due_after_every_nth_step_and_round_trips_through_build_json():
    spec = EvalSpec(3, 2)
    assert [s for s in range(10) if spec.due(s)] == [2, 5, 8]
    train = TrainSpec("m.py:build", "m.py:batch", 8, eval=spec)
    assert TrainSpec.from_dict(json.loads(json.dumps(train.to_dict()))) == train
    assert TrainSpec.from_dict(TrainSpec("m.py:build", "m.py:batch", 8).to_dict()).eval is None
    with pytest.raises(EvalError, match="build field 'eval'"):
        TrainSpec.from_dict({**train.to_dict(), "eval": {"every": 2, "often": 1}})


def test_run_flags_override_the_builds_setting_field_by_field():
    own = EvalSpec(4, 3)
    assert eval_setting(own, None, None) == own
    assert eval_setting(None, None, None) is None
    assert eval_setting(own, 2, None) == EvalSpec(2, 3)
    assert eval_setting(own, None, 5) == EvalSpec(4, 5)
    assert eval_setting(None, 2, None) == EvalSpec(2, 1)
    with pytest.raises(EvalError, match="--eval-batches needs --eval-every"):
        eval_setting(None, None, 2)


@pytest.mark.parametrize("axes,bidirectional,feature",
                         [((MeshAxis.PIPELINE, "data", "spatial", "tensor"), False, "spatial"),
                          ((MeshAxis.PIPELINE, "data", MeshAxis.SUBGRAPH, "tensor"), False, "sub-graph"),
                          ((MeshAxis.PIPELINE, "data", "tensor"), True, "bi-directional")])
def test_plans_evaluation_does_not_run_on_are_refused_by_name(axes, bidirectional, feature):
    with pytest.raises(EvalError, match=feature):
        check_supported(axes, bidirectional)
    check_supported((MeshAxis.PIPELINE, "data", "tensor"), False)


def test_the_ranks_refuse_a_bidirectional_program_by_name():
    plan = lower(plan_for("mlp", global_batch=4, micro_batch=2, pipeline=2, bidirectional=True), graph_of("mlp"))
    with pytest.raises(EvalError, match="bi-directional"):
        check_program(plan[0])
    check_program(_programs(CASES["d2p2"])[0])


def _cli(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:   # argparse's own errors
            code = e.code
    return code, err.getvalue()


@pytest.mark.parametrize("flag,value", [("--eval-every", "0"), ("--eval-batches", "-1"), ("--eval-every", "two")])
def test_codegen_and_run_refuse_a_bad_count(tmp_path, flag, value):
    for argv in (["codegen", "examples/models/mlp.py:build", "--batch", "4", flag, value, "-o", str(tmp_path / "b")],
                 ["run", str(tmp_path / "b"), flag, value]):
        code, err = _cli(argv)
        assert code == 2 and flag in err and "Traceback" not in err


def _fake_build(path, mesh: dict, eval_doc=None):
    path.mkdir()
    train = TrainSpec("examples/models/mlp.py:build", "examples/models/mlp.py:example_batch", 4).to_dict()
    train["eval"] = eval_doc
    (path / "build.json").write_text(json.dumps({"train": train, "world_size": 2, "mesh": mesh}))
    return path


def test_run_refuses_eval_flags_the_build_cannot_use_before_starting_ranks(tmp_path):
    plain = _fake_build(tmp_path / "plain", {MeshAxis.PIPELINE: 1, "data": 2, "tensor": 1})
    code, err = _cli(["run", str(plain), "--eval-batches", "2"])
    assert code == 2 and "--eval-batches needs --eval-every" in err
    tiles = _fake_build(tmp_path / "tiles", {MeshAxis.PIPELINE: 1, "data": 1, "spatial": 2, "tensor": 1},
                        {"every": 1, "batches": 1})
    code, err = _cli(["run", str(tiles), "--steps", "1"])
    assert code == 2 and "spatial parallelism" in err


def test_codegen_refuses_evaluation_of_a_bidirectional_pipeline(tmp_path):
    code, err = _cli(["codegen", "examples/models/mlp.py:build", "--batch", "4", "--micro-batch", "2",
                      "--pipeline", "2", "--bidirectional", "--eval-every", "1", "-o", str(tmp_path / "b")])
    assert code == 2 and "bi-directional" in err and not (tmp_path / "b" / "build.json").exists()


# ---- the forward part of a Program -----------------------------------------------------------

CASES = {
    "p2_gpipe": dict(pipeline=2, schedule="gpipe"),
    "p2_1f1b": dict(pipeline=2, schedule="1f1b"),
    "p2_interleaved": dict(pipeline=2, schedule="interleaved", virtual_stages=2),
    "d2t2": dict(data=2, tensor=2),
    "d2p2": dict(data=2, pipeline=2),
    "d2_zero1": dict(data=2, zero=1),
    "d2_zero3": dict(data=2, zero=3),
    "d2p2_zero3": dict(data=2, pipeline=2, zero=3),
}
FORWARD = {("F", ""), ("SEND", "act"), ("RECV", "act"), ("WAIT", ""), ("ALLREDUCE", "loss"), ("BROADCAST", "loss"),
           ("ALLGATHER", "params")}


def _programs(cfg: dict) -> dict[int, Program]:
    return lower(plan_for("gpt", global_batch=8, micro_batch=1, **cfg), graph_of("gpt"), bucket_bytes=2048)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_part_keeps_every_forward_and_what_it_needs_and_drops_the_rest(name):
    programs = _programs(CASES[name])
    kept_by_rank = {}
    for r, prog in programs.items():
        keep = forward_only(prog)
        assert list(keep) == sorted(set(keep))
        kept = [prog.instrs[k] for k in keep]
        kept_by_rank[r] = kept
        assert {(i.op, i.kind) for i in kept} <= FORWARD
        assert [i for i in kept if i.op == "F"] == [i for i in prog.instrs if i.op == "F"]
        # no handle is left without its WAIT, no WAIT without the instruction that made its handle
        made = [i.handle for i in kept if i.op != "WAIT" and i.is_async]
        assert sorted(made) == sorted(i.handle for i in kept if i.op == "WAIT")
        assert any(i.kind == "loss" for i in kept) == any(i.kind == "loss" for i in prog.instrs)
        gathers = [k for k in keep if prog.instrs[k].op == "ALLGATHER"]
        if prog.zero < 3:
            assert not gathers
        else:  # one gather before each forward of a stage, none of those before a backward
            for k in gathers:
                g = prog.instrs[k]
                nxt = next(i for i in prog.instrs[k + 1:] if i.op in ("F", "B") and i.stage == g.stage)
                assert nxt.op == "F"
            assert len({prog.instrs[k].bucket for k in gathers}) == len(prog.buckets)
    # the messages still pair up: rank r's SEND act (s, m) to q is q's RECV act (s, m) from r
    sends = sorted((r, i.peer, i.stage, i.micro) for r, kept in kept_by_rank.items() for i in kept if i.op == "SEND")
    recvs = sorted((i.peer, r, i.stage, i.micro) for r, kept in kept_by_rank.items() for i in kept if i.op == "RECV")
    assert sends == recvs and (sends or MeshAxis.PIPELINE not in dict(programs[0].mesh)
                               or programs[0].mesh_dict[MeshAxis.PIPELINE] == 1)
    # every member of a group issues the same collectives in the same order
    for axis in ("data", MeshAxis.PIPELINE, "tensor"):
        if programs[0].mesh_dict.get(axis, 1) < 2:
            continue
        for r, prog in programs.items():
            mine = [(i.op, i.kind, i.bucket) for i in kept_by_rank[r] if i.axis == axis]
            for q in prog.group(axis):
                assert [(i.op, i.kind, i.bucket) for i in kept_by_rank[q] if i.axis == axis] == mine


def test_forward_part_of_a_pipeline_drops_backward_gradient_messages_and_the_step():
    prog = _programs(CASES["p2_1f1b"])[0]
    text = [str(prog.instrs[k]) for k in forward_only(prog)]
    assert not any(t.startswith(("B ", "SEND grad", "RECV grad", "STEP", "ZERO_GRAD")) for t in text)
    assert any(t.startswith("SEND act") for t in text)


# ---- accuracy ---------------------------------------------------------------------------------------


def test_count_correct_reads_both_logit_layouts_and_counts_nothing_without_class_targets():
    logits = torch.tensor([[[0.1, 2.0, 0.3], [5.0, 0.0, 0.0]]])      # (B=1, T=2, C=3)
    targets = torch.tensor([[1, 2]])
    assert count_correct("cross_entropy", logits, targets) == (1, 2)
    images = logits.permute(0, 2, 1)                                  # (N=1, C=3, d=2)
    assert count_correct("cross_entropy", images, targets) == (1, 2)
    assert count_correct("cross_entropy", {"logits": logits}, targets) == (1, 2)
    assert count_correct("mse", logits, logits) == (0, 0)
    assert count_correct("cross_entropy", logits, torch.softmax(logits, -1)) == (0, 0)


@pytest.mark.parametrize("vocab,world", [(10, 2), (9, 2), (7, 3)])
def test_argmax_over_vocabulary_parallel_logits_equals_the_whole_vocabularys(vocab, world):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 5, vocab, generator=g)
    logits[0, 0, 1] = logits[0, 0, 6 % vocab] = logits[0, 0].max() + 1   # a tie across ranks: the lower class wins
    targets = logits.argmax(-1)
    targets[1] = (targets[1] + 1) % vocab                            # some wrong
    want = count_correct("cross_entropy", logits, targets)
    width = -(-vocab // world)                                        # classes per rank, the last padded

    def rank_fn(r, group):
        lo, hi = r * width, min((r + 1) * width, vocab)
        local = torch.full((3, 5, width), 1e6)                        # padding classes that must not count
        local[..., :hi - lo] = logits[..., lo:hi]
        return count_correct("cross_entropy", local, targets, (lo, group, hi - lo))

    assert run_ranks(world, rank_fn) == [want] * world
    assert want[0] == 10 and want[1] == 15


# ---- results ----------------------------------------------------------------------------------------


def test_results_combine_batches_and_round_trip():
    ev = EvalResult.combine(3, [(2.0, 3, 4), (4.0, 1, 4)])
    assert ev == EvalResult(3, 3.0, 0.5, 8)
    assert EvalResult.from_dict(json.loads(json.dumps(ev.to_dict()))) == ev
    assert ev.metrics() == {"eval_loss": 3.0, "eval_accuracy": 0.5}
    assert EvalResult.combine(1, [(1.0, 0, 0)]).accuracy is None


def test_comparison_with_the_reference_names_the_step_that_differs():
    ref = [EvalResult(1, 2.0, 0.5, 100), EvalResult(3, 1.5, 0.6, 100)]
    twin = [EvalResult(1, 2.0 + 1e-7, 0.5, 100), EvalResult(3, 1.5 + 1e-7, 0.6, 100)]
    ok, worst = compare_evals([EvalResult(1, 2.0 + 1e-7, 0.51, 100), ref[1]], ref, twin, 1e-4, 10.0)
    assert ok == [] and worst <= 1.0
    bad, _ = compare_evals([EvalResult(1, 2.0, 0.5, 100), EvalResult(3, 1.6, 0.5, 100)], ref, twin, 1e-4, 10.0)
    assert len(bad) == 2 and all("after step 3" in p for p in bad)
    missing, _ = compare_evals([EvalResult(1, 2.0, 0.5, 100)], ref, twin, 1e-4, 10.0)
    assert "after steps [1]" in missing[0]


class _Runner:
    def __init__(self):
        self.module = nn.Linear(2, 2)


class _Executor:
    """evaluate_batch as runtime.executor.Executor's: (loss, correct, counted); records the modules' mode."""

    def __init__(self, fail_at: int | None = None):
        self.stages = {0: _Runner(), 1: _Runner()}
        self.modes, self.fail_at = [], fail_at

    def evaluate_batch(self, step, j):
        self.modes.append([r.module.training for r in self.stages.values()])
        if j == self.fail_at:
            raise RuntimeError("peer failed")
        return torch.tensor([1.0 + j, j, 2.0], dtype=torch.float64)


def test_evaluate_runs_in_eval_mode_and_gives_the_modules_back_in_train_mode():
    ex = _Executor()
    assert evaluate(ex, EvalSpec(1, 3), 7) == EvalResult(7, 2.0, 0.5, 6)
    assert ex.modes == [[False, False]] * 3
    assert all(r.module.training for r in ex.stages.values())
    failing = _Executor(fail_at=1)
    with pytest.raises(RuntimeError):
        evaluate(failing, EvalSpec(1, 3), 0)
    assert all(r.module.training for r in failing.stages.values())
