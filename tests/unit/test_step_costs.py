"""The step outside the captured graph on a GPU (cost_models/step_costs.py): the loss, the optimizer phase,
host-to-device copies and the host's dispatch, by hand on the dgx-h100 preset's fitted constants."""

from __future__ import annotations

import pytest
import torch

import planner
from cost_models.hardware import Cluster
from cost_models.step_costs import NORM_KERNELS, StepSetup, chunked_loss_cost, full_loss_cost, optimizer_cost
from runtime.execute.chunked_loss import auto_chunk_tokens
from examples.models import gpt
from planner import ParallelConfig
from planner.evaluator import Evaluator
from runtime.execution import Execution

H100 = Cluster.preset("dgx-h100", devices=1)
N, V = 16384, 50304


@pytest.fixture(scope="module")
def gpu():
    with torch.device("meta"):
        model = gpt.build(preset="tiny")
    graph = planner.capture(model, gpt.example_inputs(batch_size=2, device="meta", preset="tiny"))
    return Evaluator(graph, H100).gpu("bf16")


def test_the_full_loss_reads_the_logits_in_fp32_passes(gpu):
    c = gpu.costs
    got = full_loss_cost(gpu, N, V, logits_bytes=2)
    e = N * V
    bw = 3.35e12
    # forward: the cast (2 + 4 bytes), log_softmax (4 + 4), nll_loss; backward: the gradient's zero fill (4),
    # log_softmax_backward (4 + 4 + 4), the cast back (4 + 2)
    fwd = 6 * e / (bw * c.cast_efficiency) + 8 * e / (bw * c.softmax_efficiency) + 3 * c.kernel_gap
    bwd = 4 * e / (bw * c.stream_efficiency) + 12 * e / (bw * c.softmax_efficiency) + 6 * e / (bw * c.cast_efficiency) \
        + 3 * c.kernel_gap
    assert got.forward.device == pytest.approx(fwd) and got.backward.device == pytest.approx(bwd)
    # the measured H100 row (xent_fp32_fwd_bwd N16384 V50304: 14.04 ms) within 10%
    assert got.forward.device + got.backward.device == pytest.approx(14.04e-3, rel=0.10)
    # memory: the fp32 log-probabilities kept, then their gradient and the input gradient beside them
    assert (got.kept_bytes, got.peak_bytes) == (4 * e, 12 * e)


def test_the_chunked_loss_holds_a_chunk_and_runs_the_head_s_three_gemms(gpu):
    # priced at the runtime's own chunk (runtime/execute/chunked_loss.py): aligned rows whose fp32 logits take at
    # most 256 MiB
    chunk = auto_chunk_tokens(N, V)
    assert chunk == 1280 and chunk % 64 == 0 and chunk * V * 4 <= 256 * 2**20
    got = chunked_loss_cost(gpu, N, V, 768)
    # one rank: the gradients of the hidden states (bf16) and of the weight (fp32) are formed in forward and
    # kept; at the peak one chunk's logits (6 bytes each) and the weight's casts (2 + 4 bytes each) besides
    kept = 2 * N * 768 + 4 * V * 768
    assert got.kept_bytes == kept and got.peak_bytes == pytest.approx(kept + 6 * chunk * V + 6 * V * 768)
    assert got.peak_bytes < full_loss_cost(gpu, N, V, logits_bytes=2).peak_bytes / 10
    # the head's forward and its two gradient GEMMs are in it: more than the logits GEMM alone three times
    one = gpu.gemm(__import__("cost_models.gemm", fromlist=["GemmShape"]).GemmShape(N, V, 768),
                   (N * 768 + V * 768 + N * V) * 2)
    assert got.forward.device > 2.5 * one


def test_the_optimizer_phase_by_implementation_and_what_the_runtime_adds(gpu):
    c = gpu.costs
    p, t = 1e8, 100
    fused = optimizer_cost(gpu, p, t, impl="fused", clip=False, zero_in_place=False, norm=False)
    foreach = optimizer_cost(gpu, p, t, impl="foreach", clip=False, zero_in_place=False, norm=False)
    # the H100 table: fused 1.60 ms, foreach 3.74 ms for 1e8 parameters in 100 tensors
    assert fused.device == pytest.approx(1.60e-3, rel=0.10) and foreach.device == pytest.approx(3.74e-3, rel=0.15)
    full = optimizer_cost(gpu, p, t, impl="fused", clip=True, zero_in_place=True, norm=True)
    bw = 3.35e12 * c.stream_efficiency
    # foreach kernels, not one per tensor: the norm reads each gradient once in NORM_KERNELS kernels, the clip
    # reads and writes each in two, and the in-place zeroing is a kernel per gradient bucket (one here)
    norm = 4 * p / bw + NORM_KERNELS * c.kernel_gap
    clip = 8 * p / bw + 2 * c.kernel_gap
    zero = 4 * p / bw + c.kernel_gap
    assert full.device == pytest.approx(fused.device + norm + clip + zero)
    assert full.host == pytest.approx(fused.host + (NORM_KERNELS + 2 + 1) * c.host_op)
    assert NORM_KERNELS < t / 10    # a few kernels however many tensors: what runtime/execute/grad_norm.py runs
    # without buckets the runtime sets the gradients to None: no zeroing at all
    freed = optimizer_cost(gpu, p, t, impl="fused", clip=True, zero_in_place=False, norm=True)
    assert full.device - freed.device == pytest.approx(zero)


def test_a_small_model_waits_for_the_host_and_a_large_one_does_not():
    def predict(batch, **kw):
        with torch.device("meta"):
            model = gpt.build(**kw)
        graph = planner.capture(model, gpt.example_inputs(batch_size=batch, device="meta", **kw))
        return Evaluator(graph, H100).evaluate(ParallelConfig(micro_batch_size=batch, dtype="bf16"), batch)
    small = predict(2, preset="tiny")
    # its forward's ops take the host longer to dispatch than the device to run: the forward is the host's
    stage = small.stages[0]
    assert stage.host_forward > small.time.forward + small.time.loss / 2
    assert stage.forward == pytest.approx(stage.host_forward) and small.time.host > 0
    big = predict(16, vocab_size=32768, seq_len=1024, hidden=1024, num_layers=2, num_heads=16)
    assert big.time.host < 0.05 * big.step_time


def test_the_setup_names_what_it_does_not_know():
    with pytest.raises(ValueError, match="optimizer"):
        StepSetup(optimizer="lion")
    with pytest.raises(ValueError, match="optimizer_impl"):
        StepSetup(optimizer_impl="cuda")
    assert StepSetup().impl_on_gpu() == "fused" and StepSetup(optimizer="sgd").impl_on_gpu() == "foreach"
    assert Execution(loss="chunked").loss == "chunked"


def test_a_build_without_the_reported_norm_is_priced_without_it():
    """--no-grad-norm (build.json's "grad_norm": false) prices no norm unless the step clips or scales the loss,
    and the predicted step is shorter by the norm's kernels."""
    from planner.app.build_costs import setup_of

    assert setup_of({}).grad_norm and not setup_of({"grad_norm": False}).grad_norm
    assert setup_of({"grad_norm": False, "clip_grad": 1.0}).grad_norm
    assert setup_of({"grad_norm": False, "loss_scale": {"init_scale": 65536.0}}).grad_norm
    with torch.device("meta"):
        model = gpt.build(preset="small")
    graph = planner.capture(model, gpt.example_inputs(batch_size=4, device="meta", preset="small"))
    cfg = ParallelConfig(micro_batch_size=4, dtype="bf16")
    on, off = (Evaluator(graph, H100, setup=StepSetup(grad_norm=g)).evaluate(cfg, 4) for g in (True, False))
    assert off.step_time < on.step_time
