"""What rank 0's per-step report costs: metrics.jsonl + progress display (+ TensorBoard) against none of them.

Two ranks (gloo, CPU, OMP_NUM_THREADS=1) train a data-parallel GPT build. In the same processes,
step by step in alternation (ddp_ratio.ALTERNATE_STEPS: which side goes first alternates too), a
step runs bare (Executor.run_step, its own seconds) or with rank 0's full report around it, timed
from before StepLog.start_step to after StepLog.write: the CUDA peak reset (none on CPU), the
line's fields (a getrusage call), one json line written and flushed, the TensorBoard scalars and the
progress bar (tqdm, drawn to a terminal that is /dev/null: the costlier of the two displays). The
ratio compares the medians after warm-up, the paired ratio is the median of (step with the
report / the bare step next to it); beside them, the report's own time per step (median) over the
bare step's median, which the machine's drifting load disturbs least. Target: < 1 %.

    python benchmarks/metrics_overhead.py [--steps 80] [--preset small] [--batch 16] [--no-tensorboard]

Measured on this machine (2 cores shared with five other jobs), 2026-11-24, `--steps 100`, the rest
defaults (GPT small, batch 16, bare step 100-116 ms under that load):
  with TensorBoard, two runs: the report's own time 363 us and 329 us per step = 0.31 % and 0.33 %;
    ratio of medians 1.001 and 1.045, paired ratio 0.980 and 1.016
  --no-tensorboard: own time 195 us = 0.18 %; ratio of medians 1.019, paired ratio 1.008
The own time is under 1 %. The side-by-side ratios scatter by some 4 % from run to run in both
directions: the load of the other jobs, not the report, which is a few tenths of a millisecond.
(Before TensorBoard's events went to its writer thread every 2 s instead of every step, the own
time was 1.4 ms, 1.2 %: each hand-over woke the thread, which took the interpreter lock.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ddp_ratio import ALTERNATE_STEPS, WORKER_PREAMBLE, make_build, run_pair  # noqa: E402

_WORKER = WORKER_PREAMBLE + r'''
from pathlib import Path
from runtime.metrics import StepLog
report = None
if rank == 0:
    screen = open(os.devnull, "w")
    screen.isatty = lambda: True          # tqdm's bar, as on a terminal
    os.environ["TERM"] = "xterm"
    report = StepLog(Path({out!r}) / "metrics.jsonl", 0, {steps}, train.global_batch_size, train.work,
                     torch.device("cpu"), tensorboard={board!r}, progress=True, stream=screen)
costs = []

def torch_step(step):   # the side with the report (named as ALTERNATE_STEPS calls it)
    t0 = time.perf_counter()
    if report is None:
        return ex.run_step(step).seconds
    report.start_step()
    t1 = time.perf_counter()
    r = ex.run_step(step)
    t2 = time.perf_counter()
    report.write(report.fields(r))
    t3 = time.perf_counter()
    costs.append((t1 - t0) + (t3 - t2))
    return t3 - t0
''' + ALTERNATE_STEPS + r'''
if report is not None:
    report.close()
    Path({out!r}, "costs.json").write_text(json.dumps(costs))
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per step over both ranks)")
    ap.add_argument("--steps", type=int, default=80, help="steps of each side")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--no-tensorboard", action="store_true", help="measure metrics.jsonl and progress only")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        build = make_build(args.preset, args.batch, 0.25, Path(tmp) / "build")
        board = None if args.no_tensorboard else str(Path(tmp) / "tb")
        res = run_pair(_WORKER.format(root=str(ROOT), build=str(build), out=tmp, steps=args.steps, board=board))
        costs = json.loads((Path(tmp) / "costs.json").read_text())
    bare = statistics.median(res["ours"][args.warmup:])
    full = statistics.median(res["torch"][args.warmup:])
    cost = statistics.median(costs[args.warmup:])
    # a step with the report and the bare step next to it saw the same load: their ratio drifts less
    paired = statistics.median(f / b for f, b in zip(res["torch"][args.warmup:], res["ours"][args.warmup:]))
    what = "metrics.jsonl + progress bar" + ("" if args.no_tensorboard else " + TensorBoard")
    print(f"GPT preset {args.preset!r}, global batch {args.batch} on 2 ranks (gloo, CPU), {args.steps} alternating "
          f"steps each (median after {args.warmup} warm-up); rank 0 reports {what}")
    print(f"  bare step:               {bare * 1e3:9.2f} ms")
    print(f"  step with the report:    {full * 1e3:9.2f} ms")
    print(f"  ratio with / without:    {full / bare:9.4f}  (medians; target < 1.01)")
    print(f"  paired ratio:            {paired:9.4f}  (median over the pairs of neighbouring steps)")
    print(f"  the report's own time:   {cost * 1e6:9.1f} us per step = {cost / bare:.3%} of the bare step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
