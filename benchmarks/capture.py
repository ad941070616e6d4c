"""Capture benchmark: the 1-trillion-parameter GPT on meta tensors.

Prints, for planner.capture and for the baseline (torch.fx.symbolic_trace
plus one torch.utils.flop_counter pass over the forward, the least any
capture must do), the wall time and the peak resident memory of a fresh
process, and their ratio. Targets (issue 2): capture <= 10 s, peak RSS < 3 GB.

    python benchmarks/capture.py [--preset 1t] [--batch 1]

Each measurement runs in its own process so that peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(which: str, preset: str, batch: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from examples.models import gpt

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = gpt.build(preset=preset)
    inputs = gpt.example_inputs(batch_size=batch, device="meta", preset=preset)
    t1 = time.perf_counter()
    if which == "capture":
        import planner

        graph = planner.capture(model, inputs)
        extra = {"nodes": len(graph.nodes), "layers": len(graph.layers),
                 "distinct_layers": len(graph.unique_layers()), "params": graph.num_params,
                 "fwd_flops": graph.total_fwd_flops}
    else:
        from torch.utils.flop_counter import FlopCounterMode

        gm = torch.fx.symbolic_trace(model)
        with FlopCounterMode(display=False) as fc:
            gm(*inputs)
        extra = {"nodes": len(gm.graph.nodes), "fwd_flops": fc.get_total_flops()}
    t2 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"build_s": t1 - t0, "seconds": t2 - t1, "peak_rss_bytes": rss, **extra}


def _run(which: str, preset: str, batch: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", which, "--preset", preset, "--batch", str(batch)],
        capture_output=True, text=True, env=env, check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{which} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1t", help="GPT preset from examples/models/gpt.py (default 1t)")
    ap.add_argument("--batch", type=int, default=1, help="example batch size (default 1)")
    ap.add_argument("--child", choices=["capture", "baseline"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.preset, args.batch)))
        return

    print(f"GPT preset {args.preset!r}, example batch {args.batch}, on meta tensors")
    base = _run("baseline", args.preset, args.batch)
    cap = _run("capture", args.preset, args.batch)
    gb = 1e9
    print(f"  model build on meta:        {cap['build_s']:.2f} s")
    print(f"  baseline fx trace + flop_counter: {base['seconds']:.2f} s, peak RSS {base['peak_rss_bytes'] / gb:.2f} GB")
    print(f"  planner.capture:            {cap['seconds']:.2f} s, peak RSS {cap['peak_rss_bytes'] / gb:.2f} GB "
          f"({cap['nodes']} nodes, {cap['layers']} layers, {cap['distinct_layers']} distinct, "
          f"{cap['params']:,} parameters)")
    print(f"  ratio capture / baseline:   {cap['seconds'] / base['seconds']:.2f}x time")
    same = abs(cap["fwd_flops"] - base["fwd_flops"]) <= 0.01 * base["fwd_flops"]
    print(f"  forward FLOPs agree with flop_counter within 1%: {same}")
    ok = cap["seconds"] <= 10.0 and cap["peak_rss_bytes"] < 3 * gb and same
    print(f"  target (<= 10 s, < 3 GB, FLOPs within 1%): {'met' if ok else 'MISSED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
