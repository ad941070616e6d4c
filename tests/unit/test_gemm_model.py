"""Compute by shape (cost_models/gemm.py, cost_models/kernels.py): hand-computed cases on the
A100 preset (312 TFLOP/s bf16, 108 SMs, 2.0 TB/s; Efficiency defaults 0.80 of peak, 0.80 of
bandwidth, 5 us per kernel)."""

import pytest
import torch

import planner
from cost_models.compute import Efficiency
from cost_models.gemm import GemmShape, shape_efficiency, tile_rate
from cost_models.hardware import Cluster
from cost_models.kernels import (AttentionShape, flash_efficiency, fused_attention_seconds, gpu_for, pass_bytes,
                                 unfused_attention_seconds)
from cost_models.memory import adam_step_bytes
from cost_models.overlap import Overlap
from cost_models.step_costs import NORM_KERNELS
from examples.models import gpt
from planner.evaluator import Evaluator

A100 = Cluster.preset("dgx-a100-80gb", nodes=1)
GPU = gpu_for(A100.device, "bf16", Efficiency.default_for(A100.device))
RATE = 312e12 * 0.80      # the large-GEMM FLOP rate
BW = 2.0e12 * 0.80        # streaming bytes/s
LAUNCH = 5e-6


def test_tile_rates_fall_with_tile_size():
    # reuse r = bm bn / (bm + bn), rate r / (r + 16) over 256x128's (r = 256/3: 0.8421)
    assert tile_rate(256, 128) == 1.0
    assert tile_rate(128, 128) == pytest.approx((64 / 80) / ((256 / 3) / (256 / 3 + 16)))  # 0.950
    assert tile_rate(64, 64) == pytest.approx((32 / 48) / ((256 / 3) / (256 / 3 + 16)))    # 0.792


def test_square_8192_gemm_is_near_the_published_large_gemm_rate():
    # 256x128 tiles: 32 x 64 = 2048 tiles over 108 SMs = 18.96 -> 19 waves; the K loop adds 64
    # fill elements to 8192: efficiency 2048 / (19 x 108) x 8192 / 8256 = 0.99031.
    shape = GemmShape(8192, 8192, 8192)
    assert shape_efficiency(shape, 108) == pytest.approx(2048 / (19 * 108) * 8192 / 8256)
    seconds = GPU.gemm(shape, 3 * 8192 * 8192 * 2)
    # 1.0995e12 FLOPs at 249.6 x 0.99031 TFLOP/s = 4.448 ms (the 0.40 GB of operands take 0.25 ms)
    assert seconds == pytest.approx(shape.flops / (RATE * 0.99031) + LAUNCH, rel=1e-4)
    tflops = shape.flops / seconds / 1e12
    # ~247 TFLOP/s: the published large-GEMM ~0.8 of the A100's 312 (Stas Bekman's MAMF table: the
    # best shape found reaches 268-271)
    assert 240 < tflops < 280


def test_small_gemm_is_far_below_peak():
    # M = N = 128, K = 8192: the best plan is 64x64 tiles (4) split 16 ways over K: 64 blocks in
    # one wave, each 4096 x (512 + 64) / 0.792 MAC slots, against 128 x 128 x 8192 / 108 ideal.
    shape = GemmShape(128, 128, 8192)
    eff = (128 * 128 * 8192 / 108) / (4096 * (512 + 64) / tile_rate(64, 64))
    assert shape_efficiency(shape, 108) == pytest.approx(eff)          # 0.417
    # compute 2.68e8 / (249.6e12 x 0.417) = 2.58 us < reading A and B (4.2 MB) at 1.6 TB/s = 2.64 us
    nbytes = (128 * 8192 * 2 + 128 * 128) * 2
    seconds = GPU.gemm(shape, nbytes)
    assert seconds == pytest.approx(nbytes / BW + LAUNCH)
    assert shape.flops / seconds < 0.12 * 312e12                        # 35 TFLOP/s


def test_wave_quantization_108_vs_109_tiles():
    # M = 108 x 256, N = 128: 108 256x128 tiles are one full wave on 108 SMs (only the K fill).
    one_wave = shape_efficiency(GemmShape(108 * 256, 128, 4096), 108)
    assert one_wave == pytest.approx(4096 / 4160)
    # 109 tiles: 2 waves of 256x128; the best other tile is 64x64: 872 tiles = 9 waves of
    # 4096 x 4160 / 0.792 MAC slots against 27904 x 128 x 4096 / 108 ideal: 0.699.
    two_waves = shape_efficiency(GemmShape(109 * 256, 128, 4096), 108)
    assert two_waves == pytest.approx((109 * 256 * 128 * 4096 / 108) / (9 * 4096 * 4160 / tile_rate(64, 64)))
    assert two_waves < 0.75 * one_wave


def test_gemm_time_and_rate_grow_with_size():
    times, rates = [], []
    for s in (256, 512, 1024, 2048, 4096, 8192, 16384):
        shape = GemmShape(s, s, s)
        t = GPU.gemm(shape, 3 * s * s * 2)
        times.append(t)
        rates.append(shape.flops / t)
    assert times == sorted(times) and rates == sorted(rates)
    assert rates[0] < 0.05 * 312e12 and rates[-1] > 0.78 * 312e12


def test_cpu_devices_get_no_shape_penalty():
    assert shape_efficiency(GemmShape(7, 3, 5), 0) == 1.0


def test_causal_attention_takes_half_the_time():
    full = AttentionShape(1, 16, 8192, 8192, 128)
    causal = AttentionShape(1, 16, 8192, 8192, 128, causal=True)
    # 64 x 64 blocks of 128: the causal kernel computes 64 x 65 / 2 of 4096 = 65/128 of them
    assert causal.computed_fraction == pytest.approx(65 / 128)
    nbytes = 4 * 16 * 8192 * 128 * 2
    f_full, b_full = fused_attention_seconds(full, GPU, nbytes)
    f_causal, b_causal = fused_attention_seconds(causal, GPU, nbytes)
    assert (f_causal - LAUNCH) / (f_full - LAUNCH) == pytest.approx(65 / 128)
    assert (b_causal - 2 * LAUNCH) / (b_full - 2 * LAUNCH) == pytest.approx(65 / 128)


def test_flash_attention_rate_by_sequence_and_head_dim():
    # long sequence, head dim 128: 0.73 of peak x 16384 / (16384 + 128) = 72.4% (FA2: up to 73%)
    long = AttentionShape(1, 16, 16384, 16384, 128)
    f, _ = fused_attention_seconds(long, GPU, 4 * 16 * 16384 * 128 * 2)
    assert long.full_flops / (f - LAUNCH) / 312e12 == pytest.approx(0.73 * 16384 / 16512)
    # head dim 64 at the same width (32 heads): equal FLOPs, 64/80 x 144/128 = 0.9 of the rate
    assert flash_efficiency(AttentionShape(1, 32, 4096, 4096, 64)) == pytest.approx(
        0.9 * flash_efficiency(AttentionShape(1, 16, 4096, 4096, 128)))
    # sequence 512, head dim 64: 0.73 x 512/640 x 0.9 = 52.6% (FA2's low end: 50%)
    short = AttentionShape(32, 32, 512, 512, 64)
    assert 0.73 * flash_efficiency(short) == pytest.approx(0.73 * 0.8 * 0.9)


def test_unfused_attention_is_gemms_plus_score_passes():
    # B H = 16, T = 4096, D = 64, no dropout: scores S = 16 x 4096^2 x 2 B = 537 MB; q = k = v = o
    # = 8.4 MB. Every kernel is memory-bound here (Q K^T: K = 64 keeps it at half the GEMM rate:
    # 0.276 ms of compute < 0.346 ms of bytes), so the forward is Q K^T (q + k + S), softmax (2 S)
    # and P V (S + v + o): 4 S + 4 q over 1.6 TB/s, plus 3 launches.
    shape = AttentionShape(1, 16, 4096, 4096, 64)
    s, q = 16 * 4096 * 4096 * 2, 16 * 4096 * 64 * 2
    f, b = unfused_attention_seconds(shape, GPU)
    assert f == pytest.approx((4 * s + 4 * q) / BW + 3 * LAUNCH)
    # backward: dP = dO V^T (2 q + S), softmax backward (3 S), dV = P^T dO, dQ = dS K, dK = dS^T Q
    # (S + 2 q each): 7 S + 8 q, 5 kernels
    assert b == pytest.approx((7 * s + 8 * q) / BW + 5 * LAUNCH)
    # with dropout: a 1-byte mask and 2 more passes each way
    fd, bd = unfused_attention_seconds(AttentionShape(1, 16, 4096, 4096, 64, dropout=True), GPU)
    assert fd - f == pytest.approx((2 * s + s / 2) / BW + LAUNCH)
    assert bd - b == pytest.approx((2 * s + s / 2) / BW + LAUNCH)


def test_pass_bytes_by_hand():
    x = 4 * 1024 * 2048 * 2            # (4, 1024, 2048) in bf16
    rows, w = 4 * 1024, 2 * 2048 * 2   # LayerNorm weight and bias
    # LayerNorm: reads x, w; writes y and 2 fp32 stats per row. Backward reads x, dy, stats, w;
    # writes dx and the weight gradients.
    assert pass_bytes("norm", x, x, 2, rows, w) == (2 * x + 8 * rows + w, 3 * x + 8 * rows + 2 * w)
    # GELU: x -> y; backward reads x and dy, writes dx
    assert pass_bytes("unary", x, x, 2) == (2 * x, 3 * x)
    # dropout: writes y and a 1-byte mask (x / 2 bytes); backward reads dy and the mask, writes dx
    assert pass_bytes("dropout", x, x, 2) == (2.5 * x, 2.5 * x)
    # residual add: a + b -> y; backward: the meeting gradients summed (2 reads, 1 write)
    assert pass_bytes("add", 2 * x, x, 2) == (3 * x, 3 * x)
    assert pass_bytes("softmax", x, x, 2) == (2 * x, 3 * x)
    assert pass_bytes("identity", x, x, 2) == (0.0, 0.0)


@pytest.fixture(scope="module")
def small_gpt():
    with torch.device("meta"):
        model = gpt.build(preset="small", dropout=0.1)
    return planner.capture(model, gpt.example_inputs(batch_size=2, device="meta", preset="small"))


def test_layer_norm_and_gelu_nodes_priced_by_their_bytes(small_gpt):
    # a stack that runs 16-bit activations throughout (no autocast: tests/unit/test_autocast_costs.py prices
    # the fp32 norms and the casts autocast adds)
    ev = Evaluator(small_gpt, A100, overlap=Overlap.preset("megatron"))
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="bf16")
    nodes = {n.target: n for n in small_gpt.nodes if n.module_path.startswith("blocks.0")}
    x = 2 * 64 * 128 * 2               # (B, T, C) = (2, 64, 128) in bf16
    ln = ev.node_cost(nodes["torch.nn.LayerNorm"], "replicate", cfg)
    w = 2 * 128 * 2
    assert ln.fwd == pytest.approx((2 * x + 8 * 128 + w) / BW + LAUNCH)
    assert ln.bwd == pytest.approx((3 * x + 8 * 128 + 2 * w) / BW + 2 * LAUNCH)
    gelu = ev.node_cost(nodes["torch.nn.GELU"], "replicate", cfg)   # (2, 64, 512)
    assert gelu.fwd == pytest.approx(2 * 4 * x / BW + LAUNCH)
    assert gelu.bwd == pytest.approx(3 * 4 * x / BW + LAUNCH)


def test_adam_step_bytes_by_hand():
    # mixed precision: reads fp32 master, m, v (12) and the 2-byte gradient, writes master, m, v (12)
    # and the 2-byte weight copy: 28. fp32: reads weight, m, v, gradient (16), writes weight, m, v (12).
    assert adam_step_bytes("bf16") == 12 + 2 + 12 + 2
    assert adam_step_bytes("fp32") == 16 + 12


def test_optimizer_phase_is_the_fused_step_the_norm_and_one_sync(small_gpt):
    # One A100, AdamW fused (what the runtime runs on a GPU): a cost per parameter tensor, and 28 bytes a
    # parameter at its share of the 2.0 TB/s (cost_models/gpu_costs.py defaults: 5.5 us, 0.70). The global
    # gradient norm (runtime/execute/grad_norm.py) is NORM_KERNELS foreach kernels reading each fp32 gradient once.
    # One data rank has no gradient buckets, so the runtime sets the gradients to None: nothing to zero.
    # The host dispatches the fused step in 4 ops per parameter group (2 groups: decayed or not) and the
    # norm's kernels, 10.1 us each; the phase takes the longer of the host's dispatching and the device's
    # kernels, and after the step's one sync (the loss and the norm read together) the host dispatches again.
    one = Cluster.preset("dgx-a100-80gb", devices=1)
    pred = planner.evaluate(small_gpt, one, planner.ParallelConfig(dtype="bf16"), global_batch_size=2)
    params = small_gpt.num_params
    tensors = sum(len(n.param_names) for n in small_gpt.nodes if n.param_count)
    norm = params * 4 / BW + NORM_KERNELS * LAUNCH
    device = tensors * 5.5e-6 + params * 28 / (2.0e12 * 0.70) + norm
    host = (2 * 4 + NORM_KERNELS) * 10.1e-6
    assert pred.num_micro_batches == 2
    assert pred.time.optimizer == pytest.approx(max(device, host) + 10.1e-6)
    # the kernel per tensor of the fused step outweighs the host's dozen dispatches
    assert device > host


def test_calibrated_gpu_efficiency_sets_the_large_gemm_rate(small_gpt):
    # a cluster file calibrated on a GPU (fit.eff.*) replaces the published 0.80: a compute-bound
    # GEMM at a measured 0.40 of peak takes twice as long
    data = A100.to_dict()
    data["measurements"] = {"fit.eff.matmul": 0.4, "fit.eff.conv": 0.7, "fit.eff.memory": 0.8,
                            "fit.eff.kernel_overhead": 5e-6}
    ev = Evaluator(small_gpt, Cluster.from_dict(data))
    assert ev.eff.matmul == 0.4
    shape = GemmShape(8192, 8192, 8192)
    slow = gpu_for(A100.device, "bf16", ev.eff).gemm(shape, 3 * 8192 * 8192 * 2)
    assert slow - LAUNCH == pytest.approx(2 * (GPU.gemm(shape, 3 * 8192 * 8192 * 2) - LAUNCH))
