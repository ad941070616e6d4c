"""How long `meshplan run` takes after training ends, against the number of steps.

Post-processing is everything after the last step's metrics line is written: the ranks save
their records and Timelines, the launcher merges the Timelines into timeline.json and
trace.json, and `run` prints the steps and the all-reduce overlap. Measured as the time from
metrics.jsonl's last write to `run` returning, on a tiny MLP build (examples/models/mlp.py,
batch 4) on 1 rank and 2 data-parallel ranks (gloo), with the default trace window and with
--trace (every step traced).

    PYTHONPATH=. python benchmarks/post_processing.py [--steps 100 1000 10000] [--ranks 1 2]

Measured on the 2-core development VM, shared with other work (seconds after training):

    before (trace of every step, pairwise overlap measure):
        1 rank:   1,000 steps 1.3     4,000 steps 2.5
        2 ranks:  1,000 steps 2.9     2,000 steps 7.4   (quadratic: 10,000 steps ~3 min;
                                                          the probe's 20,000 steps: > 20 min)
    after (default: a window of TRACE_WINDOW_STEPS = 100 steps; --trace: every step):
                   100 steps        1,000 steps      10,000 steps
                   default  trace   default  trace   default  trace
        1 rank:    1.9      2.1     1.7      3.1     2.1      5.0
        2 ranks:   2.4      3.4     2.4      2.6     2.2      5.5
    (about 2 s of it is the ranks' exit and the launcher's start-up of the store; training 10,000
    steps took 28-35 s)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from pathlib import Path


def post_seconds(build: Path, steps: int, trace: bool) -> tuple[float, float]:
    """(seconds of the whole `meshplan run`, seconds after its last step's metrics line)."""
    from planner.app.cli import main

    t0 = time.time()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["run", str(build), "--steps", str(steps), "--timeout", "120", *(["--trace"] if trace else [])])
    end = time.time()
    if rc != 0:
        raise SystemExit(f"meshplan run {build} --steps {steps} failed (exit {rc})")
    return end - t0, end - os.path.getmtime(build / "metrics.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    from planner.app.cli import main as cli

    with tempfile.TemporaryDirectory(prefix="meshplan-post-") as tmp:
        for ranks in args.ranks:
            build = Path(tmp) / f"mlp_d{ranks}"
            with contextlib.redirect_stdout(io.StringIO()):
                assert cli(["codegen", "examples/models/mlp.py:build", "--batch", "4", "--data", str(ranks),
                            "-o", str(build)]) == 0
            for steps in args.steps:
                for trace in (False, True):
                    total, post = post_seconds(build, steps, trace)
                    print(f"{ranks} rank(s) {steps:>6} steps {'--trace' if trace else 'default'}: "
                          f"post-processing {post:6.2f} s (run {total:6.1f} s)", flush=True)


if __name__ == "__main__":
    main()
