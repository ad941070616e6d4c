"""One rank of `meshplan calibrate`: measure compute and communication from inside a rank process.

    python -m cost_models.calibration.worker --rank R --world W --port P --out DIR [--full] [--backend gloo]

Every rank runs the same measurements at the same time, as the ranks of a
training run do (one thread each, OMP_NUM_THREADS=1), so the figures include
the contention of W busy processes on this machine:

1. compute: the per-kind op and layer timings of cost_models.calibration.ops, the op curves
   and the probe block of cost_models.calibration.curves, the runtime's fixed costs (a stage call,
   the loss, zeroing gradients) of cost_models.calibration.stage, the executor's own time per
   instruction (cost_models.calibration.executor: a reference pipeline run by the runtime), the
   peak fp32 GEMM rate and copy bandwidth of cost_models.local_machine, and the
   share of a core a rank gets while it computes in a training step's rhythm
   (run_like_share: below 1 when other processes load the machine);
2. communication through the runtime's own communicator (runtime.comm:
   torch.distributed gloo/NCCL, or MPI): all-reduce, all-gather,
   reduce-scatter and broadcast over the group of ranks 0..g-1 for every
   group size g, and p2p ping-pong between ranks 0 and 1, over a range of
   message sizes. Each figure is the mean over all the rounds' back-to-back
   operations (each waited before the next), seconds per operation: on gloo
   over loopback a call's time is bimodal (a call that finds its peer's thread
   asleep waits for it to wake; benchmarks/calibration_timing.py shows the sizes), and
   a step pays the sum of its calls, so the mean is what a run pays, not the median.

Writes DIR/calib_rank_RRRR.json: {"ops": [...], "block": [...], "curves": [[family, size, fwd s, bwd s], ...],
"probe": [fwd s, bwd s], "cpu_share", "sync_all_reduce" (of the quieter of two "rhythm_windows": [share, s]),
"overlap": [hidden, compute s, all-reduce s, overlapped s] (overlap_hidden),
"after_reduce": [optimizer s/byte, zeroing s/byte, 4 raw medians] (after_reduce),
"optimizer": {kind: s per parameter tensor of a step}, "optimizer_fixed": {kind: s per step}
(calibration.ops.time_optimizer_steps), "stage": {"call": [fwd s, bwd s], "loss": [[elements, fwd s, bwd s], ...],
"zero_grad": [s per tensor, s per byte],
"tensor_parallel": {part: [[elements, fwd s, bwd s], ...]}} (calibration.stage),
"executor": {"gap": {op: s}, "issue": {op: s}, "extra": {"F": s, "B": s}} (calibration.executor), "peak_flops", "memory_bandwidth",
"comm": [[op, group_size, nbytes, seconds], ...]} (communication only on rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from cost_models.calibration.curves import time_op_curves, time_probe_block
from cost_models.calibration.executor import time_executor
from cost_models.calibration.ops import _block_case, time_block, time_op_kinds, time_optimizer_steps
from cost_models.calibration.stage import time_stage_calls, time_strategy_extras, time_zero_grad
from runtime.parallel.registry import STRATEGIES as RUNTIME_STRATEGIES
from cost_models.local_machine import _measure_compute_and_memory
from runtime.comm.torch_dist import TorchCommunicator
from runtime.comm.mpi import MpiCommunicator
from runtime.vocab import Backend

QUICK_SIZES = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
FULL_SIZES = (8, 256, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 17, 1 << 18, 1 << 20, 1 << 21, 1 << 22, 1 << 24)
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")


def _make_comm(backend: str, rank: int, world: int, port: int, timeout: float):
    if backend == Backend.MPI:
        return MpiCommunicator(timeout=timeout)
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if backend == Backend.NCCL else None
    return TorchCommunicator(backend, rank, world, "127.0.0.1", port, timeout=timeout, device=device)


def _collective_runner(comm, op: str, ranks: tuple[int, ...], nbytes: int, device) -> Callable[[], None]:
    """A function that runs one `op` of `nbytes` over `ranks` and waits for it (this rank is in ranks)."""
    g = len(ranks)
    group = comm.group(ranks) if op != "p2p" else None
    numel = max(nbytes // 4, 1)
    if op in ("all_gather", "reduce_scatter"):
        numel = max(-(-numel // g) * g, g)  # nbytes is the gathered output / the scattered input
    buf = torch.ones(numel, device=device)
    part = torch.ones(numel // g, device=device) if op in ("all_gather", "reduce_scatter") else None
    peer = ranks[1 - ranks.index(comm.rank)] if op == "p2p" else -1
    tag = [0]

    def once() -> None:
        if op == "all_reduce":
            group.all_reduce(buf, async_op=True).wait()
        elif op == "all_gather":
            group.all_gather(buf, part, async_op=True).wait()
        elif op == "reduce_scatter":
            group.reduce_scatter(part, buf, async_op=True).wait()
        elif op == "broadcast":
            group.broadcast(buf, ranks[0], async_op=True).wait()
        else:  # ping-pong: one round trip is two one-way messages
            tag[0] += 1
            if comm.rank == ranks[0]:
                comm.isend(buf, peer, tag[0]).wait()
                comm.irecv(buf, peer, tag[0]).wait()
            else:
                comm.irecv(buf, peer, tag[0]).wait()
                comm.isend(buf, peer, tag[0]).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return once


def measure_comm(comm, world: int, sizes, trials: int, device, progress) -> list[list]:
    """[[op, group_size, nbytes, seconds], ...] measured on rank 0 (every rank takes part).

    Per op and group size, `trials` rounds each time every message size once (a few
    back-to-back operations, each waited before the next), so that a change in the
    machine's load touches every size alike; the figure is the mean over rounds (the
    expected cost of one call, which is what a sum of calls in a step adds up to).
    """
    rows = []
    for g in range(2, world + 1):
        ranks = tuple(range(g))
        inside = comm.rank in ranks
        sync = comm.group(ranks) if inside else None
        for op in COMM_OPS:
            if op == "p2p" and g != 2:
                continue  # p2p is between two ranks
            if inside:
                runners = {n: _collective_runner(comm, op, ranks, n, device) for n in sizes}
                for run in runners.values():
                    run()  # warm-up: connections, buffers
                times: dict[int, list[float]] = {n: [] for n in sizes}
                for _ in range(trials):
                    for n, run in runners.items():
                        repeat = 4 if n <= 1 << 17 else 2
                        sync.all_reduce(torch.zeros(1, device=device))  # start together
                        t0 = time.perf_counter()
                        for _ in range(repeat):
                            run()
                        times[n].append((time.perf_counter() - t0) / repeat)
                if comm.rank == 0:
                    for n in sizes:
                        t = statistics.mean(times[n])
                        rows.append([op, g, n, t / 2 if op == "p2p" else t])
                    got = [r for r in rows if r[0] == op and r[1] == g]
                    progress(f"  {op:14s} group {g}: " + ", ".join(f"{_fmt(n)} {t * 1e6:.0f} us" for _, _, n, t in got))
        comm.barrier()
    return rows


def after_reduce(comm, device, nbytes: int = 2 << 20, rounds: int = 16) -> list[float]:
    """[optimizer s per byte, zeroing s per byte, ...raw medians (s)]: what reading and zeroing a
    gradient buffer costs beyond the same on a buffer of its own, when an all-reduce over all
    ranks has just gone through it, as the runtime's STEP and next ZERO_GRAD do.

    Under MPI on one node the peer copies the buffer straight out of this rank's memory (CMA
    single copy), so its lines sit in the peer's cache: SGD with momentum reading them fetches
    them across cores, and zeroing them must first take them back (in some launches ~0.3-0.4
    ns per byte on the rank whose buffer was read, against ~0.02 for a buffer of its own).
    Each round all-reduces `nbytes` (or, for the reference, 8 bytes), runs an SGD-momentum
    update reading it, a layer's forward and backward, then zeroes it. Medians over `rounds`."""
    build, _ = _block_case()
    fwd, grad_of = build(2)
    group = comm.group(range(comm.world_size))
    n = max(nbytes // 4, 1)
    grad, param, momentum = torch.ones(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    small = torch.zeros(2, device=device)
    times = []
    for reduce in (True, False):
        step_s, zero_s = [], []
        for _ in range(rounds):
            group.all_reduce(grad if reduce else small, async_op=True).wait()
            t0 = time.perf_counter()
            momentum.mul_(0.9).add_(grad)
            param.add_(momentum, alpha=-1e-3)
            t1 = time.perf_counter()
            y = fwd()
            torch.autograd.backward(y, grad_of(y))
            t2 = time.perf_counter()
            grad.zero_()
            step_s.append(t1 - t0)
            zero_s.append(time.perf_counter() - t2)
            grad.fill_(1.0)
        times += [statistics.median(step_s), statistics.median(zero_s)]
    return [max(times[0] - times[2], 0.0) / (4 * n), max(times[1] - times[3], 0.0) / (4 * n)] + times


def run_like_share(comm, seconds: float) -> tuple[float, float]:
    """(share, sync) in a run's rhythm: the share of a core this rank gets while it computes,
    and the median seconds of a small all-reduce right after computing.

    The op timings are medians of unpreempted runs; a step is not. On a machine with
    more runnable processes than cores a rank computes at a fraction of a core, and
    the fraction depends on its rhythm (the scheduler favours processes that wake from
    waits), so this loop has a training step's: a layer's forward and backward, then
    a small all-reduce with the other ranks. CPU time over wall time of the compute
    segments only (the waits are not compute). The all-reduce after compute waits for the
    slower rank and for this rank's wake-up, which back-to-back collectives do not show.
    """
    build, _ = _block_case()
    fwd, grad_of = build(4)
    group = comm.group(range(comm.world_size))
    flag = torch.zeros(1)
    cpu = wall = 0.0
    waits = []
    deadline = time.perf_counter() + seconds
    while True:
        c0, w0 = time.process_time(), time.perf_counter()
        y = fwd()
        torch.autograd.backward(y, grad_of(y))
        cpu += time.process_time() - c0
        wall += time.perf_counter() - w0
        flag[0] = 1.0 if time.perf_counter() > deadline else 0.0
        w1 = time.perf_counter()
        group.all_reduce(flag)  # every rank stops after the same round
        waits.append(time.perf_counter() - w1)
        if flag[0] > 0:
            break
    return (min(cpu / wall, 1.0) if wall > 0 else 1.0), statistics.median(waits)


def overlap_hidden(comm, device, nbytes: int = 1 << 20, rounds: int = 40) -> tuple[float, float, float, float]:
    """(hidden, compute s, all-reduce s, overlapped s): how much of an asynchronous all-reduce
    of `nbytes` over all ranks a compute running meanwhile hides, as the runtime overlaps the
    gradient all-reduces with the backward.

    On a machine with as many ranks as cores the communicator's threads compete with the
    compute for the cores, so the overlapped total is more than max(compute, all-reduce).
    hidden = (compute + all-reduce - overlapped) / all-reduce, clamped to [-1, 1] (1: free
    overlap; 0: as slow as one after the other; below 0: slower than that, as under MPI on this
    VM, where a rank that computes while its request is pending progresses the request only
    when it next tests it, and the peer waits meanwhile). The compute is a layer's forward and
    backward repeated to last about three all-reduces; each figure is a median over `rounds`
    (every rank starts together): one all-reduce stalled for milliseconds moves a mean of a
    dozen rounds by a share of its own time (the share swung from -0.9 to +0.3 between
    calibrations a minute apart with means of 12).
    """
    build, _ = _block_case()
    fwd, grad_of = build(4)
    group = comm.group(range(comm.world_size))
    buf = torch.ones(max(nbytes // 4, 1), device=device)

    def layer() -> None:
        y = fwd()
        torch.autograd.backward(y, grad_of(y))

    def median_time(f) -> float:
        ts = []
        for _ in range(rounds):
            group.all_reduce(torch.zeros(1, device=device))  # start together
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    one = median_time(layer)
    reduce_s = median_time(lambda: group.all_reduce(buf, async_op=True).wait())
    # every rank must repeat the layer equally often: agree on the largest count
    count = torch.tensor([float(max(1, math.ceil(3 * reduce_s / max(one, 1e-9))))])
    group.all_reduce(count)  # sum over ranks; the same on every rank
    k = int(count.item())

    def compute() -> None:
        for _ in range(k):
            layer()

    def both() -> None:
        h = group.all_reduce(buf, async_op=True)
        compute()
        h.wait()
    compute_s, overlapped_s = median_time(compute), median_time(both)
    hidden = (compute_s + reduce_s - overlapped_s) / reduce_s if reduce_s > 0 else 1.0
    return min(max(hidden, -1.0), 1.0), compute_s, reduce_s, overlapped_s


def _fmt(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale}{unit}"
    return f"{n}B"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(1)
    comm = _make_comm(args.backend, args.rank, args.world, args.port, args.timeout)
    rank = comm.rank  # under mpiexec, MPI numbers the ranks

    def progress(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == Backend.NCCL else torch.device("cpu")
    rhythm_s = 1.0 if args.full else 0.5
    try:
        comm.barrier()
        compute = _time_compute(args.world, not args.full, progress)
        comm.barrier()
        machine = _time_machine(comm, device, rhythm_s, progress)
        comm.barrier()
        progress(f"communication ({args.backend}):")
        # 16 rounds in quick mode: the call times are bimodal, so fewer rounds leave the mean of
        # a size too loose (benchmarks/calibration_timing.py)
        rows = measure_comm(comm, args.world, FULL_SIZES if args.full else QUICK_SIZES, 25 if args.full else 16,
                            device, progress)
        comm.barrier()
        windows = _rhythm_again(comm, machine.rhythm, rhythm_s, progress)
        out = _rank_figures(rank, compute, machine, windows, rows)
        Path(args.out, f"calib_rank_{rank:04d}.json").write_text(json.dumps(out))
        comm.barrier()
    finally:
        comm.shutdown()
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default=Backend.GLOO.value, choices=tuple(Backend))
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0)
    return ap.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class _ComputeTimes:
    """What one rank's compute costs, every rank measuring at once (seconds; see the module's docstring)."""

    ops: list           # OpTiming per op kind (calibration.ops.time_op_kinds)
    block: tuple        # a layer of alternating kinds: fwd s, bwd s, fixed fwd s, fixed bwd s
    curves: list        # [[family, size, fwd s, bwd s], ...]
    probe: tuple        # the probe transformer block: fwd s, bwd s
    optim: dict         # {kind: (fixed s per step, s per parameter tensor)}
    stage: dict         # the runtime's stage call, loss, zeroing and tensor-parallel costs


def _time_compute(world: int, quick: bool, progress: Callable[[str], None]) -> _ComputeTimes:
    """Times the cost model's op kinds, a layer, the op curves, the probe block, the optimizer step and
    the runtime's stage costs, printing each on rank 0."""
    progress(f"compute, per op kind ({world} ranks at once, 1 thread each):")
    ops = time_op_kinds(quick=quick, progress=progress)
    block = time_block(quick=quick)
    progress(f"  a layer of alternating kinds: forward {block[0] * 1e6:.1f} us, backward {block[1] * 1e6:.1f} us; "
             f"fixed cost per call {block[2] * 1e6:.1f} / {block[3] * 1e6:.1f} us")
    curves = time_op_curves(quick=quick, progress=progress)
    probe = time_probe_block(quick=quick)
    progress(f"  probe transformer block: forward {probe[0] * 1e6:.0f} us, backward {probe[1] * 1e6:.0f} us")
    optim = time_optimizer_steps()
    progress("  optimizer step, fixed + per parameter tensor: "
             + ", ".join(f"{k} {f * 1e6:.1f} + {t * 1e6:.1f} us" for k, (f, t) in optim.items()))
    return _ComputeTimes(ops, block, curves, probe, optim, _time_stage(quick, progress))


def _time_stage(quick: bool, progress: Callable[[str], None]) -> dict:
    """The runtime's fixed costs around a stage: a call, the loss, zeroing gradients, the strategies' work
    besides their collectives (tensor parallelism's wrappers: calibration.stage)."""
    stage = time_stage_calls(quick=quick)
    stage["zero_grad"] = time_zero_grad()
    extras = time_strategy_extras(quick=quick)
    stage.update(extras)
    progress(f"  runtime stage call: forward {stage['call'][0] * 1e6:.1f} us, backward {stage['call'][1] * 1e6:.1f} us; "
             + "; ".join(f"loss over {int(n)} logits {f * 1e6:.1f} / {b * 1e6:.1f} us" for n, f, b in stage["loss"]))
    titles = {s.calibration_key: s.calibration_title for s in RUNTIME_STRATEGIES}
    for key, parts in extras.items():
        progress(f"  {titles[key]}: " + "; ".join(
            f"{part.replace('_', ' ')} " + ", ".join(f"{int(n)} elements {f * 1e6:.1f} / {b * 1e6:.1f} us" for n, f, b in pts)
            for part, pts in parts.items()))
    return stage


@dataclasses.dataclass(frozen=True)
class _MachineTimes:
    """How this machine runs a rank's step beside the others (seconds unless said)."""

    executor: dict          # {"gap": {op: s}, "issue": {op: s}, "extra": {...}} (calibration.executor)
    peak_flops: float       # fp32 GEMM, FLOP/s per rank
    bandwidth: float        # copy bandwidth, bytes/s per rank
    rhythm: tuple           # run_like_share: (CPU share, s of a small all-reduce after computing)
    hidden: tuple           # overlap_hidden: (hidden, compute s, all-reduce s, overlapped s)
    reduced: list           # after_reduce: [optimizer s/byte, zeroing s/byte, 4 raw medians s]


def _time_machine(comm, device, rhythm_s: float, progress: Callable[[str], None]) -> _MachineTimes:
    """Times the executor, the peak GEMM rate and copy bandwidth, a rank's share of a core in a training
    step's rhythm (for `rhythm_s` seconds), overlap, and the cost of a buffer just all-reduced."""
    executor = time_executor(comm)
    progress("  runtime executor, between instructions: "
             + ", ".join(f"after {op} {t * 1e6:.1f} us" for op, t in executor["gap"].items())
             + "; issuing: " + ", ".join(f"{op} {t * 1e6:.1f} us" for op, t in executor["issue"].items()))
    comm.barrier()
    peak, bandwidth = _measure_compute_and_memory()
    comm.barrier()
    share, sync = run_like_share(comm, rhythm_s)
    progress(f"  CPU share of a rank while it computes between collectives: {share:.2f}; "
             f"an 8-byte all-reduce after computing: {sync * 1e6:.0f} us")
    hidden = overlap_hidden(comm, device)
    progress(f"  an asynchronous 1 MiB all-reduce ({hidden[2] * 1e3:.2f} ms) under {hidden[1] * 1e3:.2f} ms of compute: "
             f"{hidden[3] * 1e3:.2f} ms together, " + (f"{hidden[0]:.0%} of it hidden" if hidden[0] >= 0 else
                                                        f"{-hidden[0]:.0%} of it more than alone"))
    reduced = after_reduce(comm, device)
    progress(f"  right after a 2 MiB all-reduce through it, an optimizer step reading the buffer takes "
             f"{reduced[2] * 1e6:.0f} us (its own: {reduced[4] * 1e6:.0f}), zeroing it {reduced[3] * 1e6:.0f} us "
             f"({reduced[5] * 1e6:.0f}) on rank 0")
    progress(f"  peak fp32 GEMM {peak / 1e9:.1f} GFLOP/s, copy bandwidth {bandwidth / 1e9:.1f} GB/s per rank")
    return _MachineTimes(executor, peak, bandwidth, (share, sync), hidden, reduced)


def _rhythm_again(comm, first: tuple[float, float], rhythm_s: float,
                  progress: Callable[[str], None]) -> list[tuple[float, float]]:
    """The two (CPU share, s) windows of the training rhythm: `first`, and one measured now."""
    # The training rhythm again, some seconds later: a window can be disturbed (another
    # process, the host) and a small all-reduce after compute then waits many times longer;
    # the window whose all-reduce waited less is the machine's own rhythm.
    windows = [first, run_like_share(comm, rhythm_s)]
    share, sync = min(windows, key=lambda w: w[1])
    progress(f"  the training rhythm again: an 8-byte all-reduce after computing {windows[1][1] * 1e6:.0f} us "
             f"(first {windows[0][1] * 1e6:.0f} us); kept {sync * 1e6:.0f} us, CPU share {share:.2f}")
    return windows


def _rank_figures(rank: int, compute: _ComputeTimes, machine: _MachineTimes, windows: list[tuple[float, float]],
                  rows: list[list]) -> dict:
    """The JSON document of calib_rank_RRRR.json (its keys in the module's docstring); the rhythm kept is
    the window whose all-reduce waited less."""
    share, sync = min(windows, key=lambda w: w[1])
    optim = compute.optim
    return {"rank": rank, "ops": [dataclasses.asdict(t) for t in compute.ops], "block": list(compute.block),
            "curves": compute.curves, "probe": list(compute.probe), "cpu_share": share, "sync_all_reduce": sync,
            "rhythm_windows": [list(w) for w in windows],
            "overlap": list(machine.hidden), "after_reduce": machine.reduced,
            "optimizer": {k: t for k, (_, t) in optim.items()},
            "optimizer_fixed": {k: f for k, (f, _) in optim.items()}, "stage": compute.stage,
            "executor": machine.executor, "peak_flops": machine.peak_flops,
            "memory_bandwidth": machine.bandwidth, "comm": rows}


if __name__ == "__main__":
    sys.exit(main())
