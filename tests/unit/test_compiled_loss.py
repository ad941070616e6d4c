"""The compiled loss (Execution.loss "compiled", runtime/losses.compiled_loss): the same cross-entropy as the
eager loss through torch.compile, values and gradients, over the layouts and dtypes the runtime feeds it; the
stage runner's use of it; its price (cost_models/step_costs.compiled_loss_cost); the refusals that name why
a build cannot run it."""

from __future__ import annotations

import runpy
import types

import pytest
import torch

import planner
from codegen.emit import ExecutionError, check_execution
from cost_models.gpu_costs import gpu_costs
from cost_models.gpu_fit import gpu_of
from cost_models.step_costs import compiled_loss_cost, full_loss_cost
from planner.app.cli import main
from runtime.execute.stage import StageRunner
from runtime.execution import Execution, LossImpl
from runtime.losses import LossError, compiled_loss, compute_loss, padded_base
from tests.parallel_cases import plan_for

GPT = "examples/models/gpt.py:build"


def _pair(fn, logits: torch.Tensor, targets: torch.Tensor, autocast: bool = False):
    """(loss, gradient of the logits) of fn over a leaf copy of `logits`."""
    x = logits.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(x, targets)
    loss.backward()
    return loss.detach(), x.grad


def _eager(x, y):
    return compute_loss("cross_entropy", x, y)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_compiled_loss_equals_the_eager_one_with_ignored_targets(backend):
    torch.manual_seed(0)
    logits = torch.randn(3, 10, 37) * 4
    targets = torch.randint(0, 37, (3, 10))
    targets[0, :4] = -100   # F.cross_entropy's ignore_index: left out of the mean and of the gradient
    fn = compiled_loss("cross_entropy", backend)
    (a, ga), (b, gb) = _pair(fn, logits, targets), _pair(_eager, logits, targets)
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
    assert ga[0, :4].abs().sum() == 0


def test_16_bit_logits_give_the_fp32_loss_and_a_16_bit_gradient():
    torch.manual_seed(1)
    logits = (torch.randn(4, 8, 50) * 3).bfloat16()
    targets = torch.randint(0, 50, (4, 8))
    fn = compiled_loss("cross_entropy", "aot_eager")
    (a, ga), (b, gb) = _pair(fn, logits, targets, autocast=True), _pair(_eager, logits, targets, autocast=True)
    assert a.dtype == torch.float32 and ga.dtype == torch.bfloat16
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga.float(), gb.float(), rtol=1e-2, atol=1e-5)


def test_class_dimension_second_and_a_padded_view_of_the_logits():
    torch.manual_seed(2)
    fn = compiled_loss("cross_entropy", "aot_eager")
    images, labels = torch.randn(2, 5, 3, 3), torch.randint(0, 5, (2, 3, 3))   # (N, C, d1, d2): segmentation
    for (a, ga), (b, gb) in [(_pair(fn, images, labels), _pair(_eager, images, labels))]:
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(ga, gb)
    # a vocabulary padded to 64 rows, the loss over the real 50 columns (the stage's view of its logits)
    padded, targets = torch.randn(2, 6, 64), torch.randint(0, 50, (2, 6))
    view = lambda f: (lambda x, y: f(x[..., :50], y))  # noqa: E731
    (a, ga), (b, gb) = _pair(view(fn), padded, targets), _pair(view(_eager), padded, targets)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ga, gb)
    assert ga[..., 50:].abs().sum() == 0


def test_padded_logits_are_narrowed_inside_the_compiled_loss_with_the_same_gradients():
    torch.manual_seed(3)
    head = torch.nn.Linear(8, 64)   # 50 real classes padded to 64, as codegen/head.py narrows them
    fn = compiled_loss("cross_entropy", "aot_eager")
    for x in (torch.randn(2, 5, 8), torch.randn(7, 8)):   # a 3-d output is a view of the 2-d GEMM's
        targets = torch.randint(0, 50, x.shape[:-1])
        logits = torch.narrow(head(x), -1, 0, 50)
        wide = padded_base(logits)
        assert wide.shape == (*x.shape[:-1], 64) and torch.equal(wide[..., :50], logits)
        head.zero_grad()
        loss = fn(wide, targets, 50)
        loss.backward()
        fused = [p.grad.clone() for p in head.parameters()]
        head.zero_grad()
        want = compute_loss("cross_entropy", torch.narrow(head(x), -1, 0, 50), targets)
        want.backward()
        torch.testing.assert_close(loss, want)
        for got, ref in zip(fused, (p.grad for p in head.parameters())):
            torch.testing.assert_close(got, ref)
            assert got[50:].abs().sum() == 0   # the padding's rows take no gradient
    # not a narrow of a padded tensor: whole logits, another dimension narrowed, a transpose
    whole = head(torch.randn(3, 8))
    assert padded_base(whole) is None
    assert padded_base(torch.narrow(whole, 0, 0, 2)) is None
    assert padded_base(torch.narrow(whole, -1, 0, 50).t()) is None


def test_an_unknown_loss_is_refused_by_name():
    with pytest.raises(LossError, match="unknown loss 'hinge'"):
        compiled_loss("hinge", "aot_eager")


def _last_stage_spec():
    return types.SimpleNamespace(is_last=True, head=None, inputs=(), outputs=(), compiled=())


def test_the_stage_runner_compiles_the_loss_of_a_dict_output_and_refuses_split_logits():
    spec = _last_stage_spec()
    module = torch.nn.Linear(4, 7)
    runner = StageRunner(spec, lambda x: {"logits": module(x)}, compiled_loss="aot_eager")
    x, y = torch.randn(3, 4), torch.randint(0, 7, (3,))
    assert runner._compiled is not None
    torch.testing.assert_close(runner._loss({"logits": module(x)}, y), compute_loss("cross_entropy", module(x), y))
    # a padded output layer's narrowed logits: the runner hands the compiled loss the whole tensor
    seen = []
    runner._compiled = lambda *a: seen.append([t.shape if isinstance(t, torch.Tensor) else t for t in a]) or 0.0
    runner._loss(torch.narrow(torch.nn.Linear(4, 16)(x), -1, 0, 7), y)
    assert seen == [[(3, 16), (3,), 7]]
    with pytest.raises(ValueError, match="compiled loss needs the whole logits"):
        StageRunner(spec, module, class_split=(0, object(), 7), compiled_loss="aot_eager")
    assert StageRunner(spec, module)._compiled is None


# A last stage as a build's rank script holds one: a linear layer of 16 rows whose logits are narrowed to 7
# classes (a padded vocabulary), through a helper the script defines (a global of the script's module).
_HEAD_SCRIPT = """
import torch

def narrowed(x):
    return torch.narrow(torch.tanh(x), -1, 0, 7)

class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 16)

    def forward(self, x):
        return narrowed(self.linear(x))
"""


def test_a_stage_compiled_whole_runs_its_forward_and_the_compiled_loss_as_one_graph(tmp_path):
    from runtime.execute.compiled import compiled_graphs

    script = tmp_path / "rank_0000.py"
    script.write_text(_HEAD_SCRIPT)
    # run as codegen's run_rank.py runs a rank script: under a module name no import finds
    head = runpy.run_path(str(script), run_name="meshplan_rank")["Head"]
    torch._dynamo.reset()
    torch.manual_seed(0)
    module, reference = head(), head()
    reference.load_state_dict(module.state_dict())
    # as compile_stage does for compile scope "stage": the instance's forward is the compiled one
    object.__setattr__(module, "forward", torch.compile(module.forward, dynamic=False, backend="aot_eager"))
    spec = types.SimpleNamespace(is_last=True, head=None, outputs=(), compiled=("forward",),
                                 inputs=(types.SimpleNamespace(requires_grad=False),))
    runner = StageRunner(spec, module, compiled_loss="aot_eager", loss_scale=0.5)
    assert runner._joint is not None
    x, y = torch.randn(2, 3, 4), torch.randint(0, 7, (2, 3))
    before = compiled_graphs()
    for micro in range(2):   # static shapes: the second micro-batch compiles nothing
        loss = runner.forward(micro, [x], y)
        runner.backward(micro)
    assert compiled_graphs() - before == 1   # forward and loss in one graph; the instance's forward never ran
    want = compute_loss("cross_entropy", reference(x), y)
    (want * 0.5 * 2).backward()
    torch.testing.assert_close(loss, want)
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert module.linear.weight.grad[7:].abs().max() == 0   # the padded rows take no gradient
    # without a compiled forward, or without the compiled loss, the stage and the loss run apart
    eager_spec = types.SimpleNamespace(**{**vars(spec), "compiled": ()})
    assert StageRunner(eager_spec, head(), compiled_loss="aot_eager")._joint is None
    assert StageRunner(spec, head())._joint is None


def test_execution_names_the_compiled_loss_and_round_trips():
    ex = Execution(compile=True, loss="compiled")
    assert ex.compiled_loss and not ex.chunked and ex.loss == LossImpl.COMPILED
    assert ex.options() == ["--compile", "--loss-impl compiled"]
    assert Execution.from_dict(ex.to_dict()) == ex


def test_its_price_reads_the_logits_in_their_dtype_and_holds_no_fp32_copy():
    h100 = planner.Cluster.preset("dgx-h100", devices=1)
    gpu = gpu_of(h100.device, "bf16", gpu_costs(h100))
    tokens, vocab = 16 * 1024, 50304
    e = tokens * vocab
    full = full_loss_cost(gpu, tokens, vocab, logits_bytes=2)
    fused = compiled_loss_cost(gpu, tokens, vocab, logits_bytes=2)
    # kept: the bf16 logits and two fp32 values a row, where the eager loss keeps fp32 log-probabilities
    assert fused.kept_bytes == 2 * e + 8 * tokens and full.kept_bytes == 4 * e
    assert fused.peak_bytes == fused.kept_bytes + 2 * e < full.peak_bytes / 2
    # 8 bytes a logit moved against the eager loss's 48: far less time each way
    assert fused.forward.device < full.forward.device / 3 and fused.backward.device < full.backward.device / 3
    # the logits held at their padded width
    padded = compiled_loss_cost(gpu, tokens, 50257, logits_bytes=2, held_vocab=50304)
    assert padded.kept_bytes == 2 * tokens * 50304 + 8 * tokens


def test_builds_that_cannot_run_the_compiled_loss_are_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(ExecutionError, match="loss is mse: use --loss-impl full"):
        check_execution(plan_for("mlp"), Execution(loss="compiled"), "mse")
    spatial = types.SimpleNamespace(config=planner.ParallelConfig(spatial=2, spatial_until="conv"), subgraph=())
    with pytest.raises(ExecutionError, match="--loss-impl compiled does not run with spatial parallelism"):
        check_execution(spatial, Execution(loss="compiled"), "cross_entropy")
    # tensor parallelism splits the GPT's output layer over the vocabulary: its loss exchanges statistics
    out = tmp_path / "t2"
    assert main(["codegen", GPT, "--arg", "preset=tiny", "--batch", "4", "--tensor", "2", "--loss-impl", "compiled",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--loss-impl compiled needs the whole logits on each rank" in err and "Traceback" not in err
    assert not out.exists()
    # data parallelism keeps them whole
    assert main(["codegen", GPT, "--arg", "preset=tiny", "--batch", "4", "--data", "2", "--loss-impl", "compiled",
                 "-o", str(tmp_path / "d2")]) == 0


def test_the_calibration_times_it_and_its_row_is_priced_by_the_same_passes():
    from cost_models.calibration.gpu_ops import gpu_op_specs
    from cost_models.gpu_fit import family, predict_row
    from cost_models.op_table import OpRow

    h100 = planner.Cluster.preset("dgx-h100", devices=1)
    quick = [s for _, specs in gpu_op_specs(True) for s in specs if s.op == "xent_compiled_fwd_bwd"]
    assert [s.shape for s in quick] == ["N16384 V50304"]   # one shape in the quick mode: each compiles
    row = OpRow("xent_compiled_fwd_bwd", "N16384 V50304", "bf16->fp32", 1.0)
    priced = compiled_loss_cost(gpu_of(h100.device, "bf16", gpu_costs(h100)), 16384, 50304, logits_bytes=2)
    # a row this large is device-bound: its model is the first op's dispatch, then the kernels' time, which
    # is what the step's loss adds
    assert predict_row(row, h100.device, gpu_costs(h100)) == pytest.approx(
        gpu_costs(h100).host_op + priced.forward.device + priced.backward.device, rel=1e-9)
    assert family(row.op) == "loss"
