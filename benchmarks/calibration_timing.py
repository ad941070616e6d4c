"""How long a quick calibration takes on this machine, and the size of the effects the
calibration code works around (cost_models/calibration: the comments there give the reasons).

    PYTHONPATH=. python benchmarks/calibration_timing.py [--ranks 2] [--full]

Prints the wall time of `meshplan calibrate`'s measurement, the back-to-back and the
after-compute 8-byte all-reduce, the 1 KiB - 1 MiB all-reduces of the largest group, the
stage-call figures, and the op curves of a few families.

Seen on the 2-core development VM (gloo over loopback, 2 ranks):
- a quick calibration: 10-20 s;
- gloo all-reduces of 1 KiB - 1 MiB are bimodal: about half take ~4 ms instead of ~0.4 ms,
  so the mean of 16 calls per size is within about +-30% and 64 calls give about +-12%;
- an 8-byte all-reduce right after compute: ~0.03 ms in a quiet window, ~0.4-0.6 ms in a
  disturbed one (about one window in six); the rank that arrives last is late by its own
  compute noise, up to ~0.6 ms on one calibration in six (once 0.43 ms on both ranks at once);
- a stage call timed in the layer chain (caches cold): about 80 us per forward, against
  ~15 us for a stage run in a row through the runtime's StageRunner;
- the op kinds in quick mode take about 2 s and the op curves 3-5 s on an idle core;
- GELU costs ~2.5 ns per element, and a GEMM of 128 x 128 x 384 reaches a third of the rate
  of a 512 x 256 x 256 one.
"""

from __future__ import annotations

import argparse
import time

from cost_models.calibration.calibrate import calibrate

SHOWN = ("raw.sync.", "raw.block.", "raw.curve.gelu.", "raw.curve.linear.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="the full calibration instead of the quick one")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cluster = calibrate(args.ranks, quick=not args.full, progress=print)
    print(f"calibration of {args.ranks} ranks ({'full' if args.full else 'quick'}): "
          f"{time.perf_counter() - t0:.1f} s")
    largest = f".g{args.ranks}."
    for name, value in cluster.measurements:
        comm = name.startswith("raw.comm.all_reduce") and largest in name
        if isinstance(value, float) and (comm or name.startswith(SHOWN)):
            print(f"  {name:50s} {value * 1e6:10.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
