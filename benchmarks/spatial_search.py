"""Spatial parallelism in the joint search (issue 7's Measure section).

    python benchmarks/spatial_search.py            # everything (a few minutes on 2 cores)
    python benchmarks/spatial_search.py --quick    # only the 16384^2 plan and the search times

1. ResNet-v2-110 (CIFAR stem, width 16) on 16384 x 16384 images, global batch 1, on 48 V100s
   (8 Summit nodes): the best plan with spatial tiles, its predicted peak memory per device, and
   the smallest peak memory any plan without tiles reaches (none fits in 16 GiB).
2. Search time of the joint search: GPT-1T on 3072 A100s (no convolutions: the spatial part of the
   search is empty; the time with spatial=1 forced is measured alongside, ratio reported) and the
   16384^2 ResNet-110 on 48 V100s.
3. Largest image side (multiple of 256 px) that fits one Summit node (6 x V100 16 GB) for
   ResNet-v2-110, global batch 1, with and without spatial splitting (bisection on the side).
4. Predicted step time of the joint plan vs the best layer-parallel-only plan (6 pipeline stages,
   one micro-batch: the layers run one device after another) and the best pipeline-only plan
   (6 stages, micro-batches) on one Summit node, at the largest side the pipeline-only plan fits,
   global batch 6.

All searches are what-if searches (runtime=None): V100s have no bf16, and the runtime trains in
fp32/bf16 only (no fp16 loss scaling), and codegen does not lower spatial plans yet. Numbers are
the cost model's predictions for the hardware facts in cost_models/presets.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import planner  # noqa: E402
from planner.evaluator import Evaluator  # noqa: E402
from examples.models import gpt, resnet  # noqa: E402
from planner import NoFeasiblePlan  # noqa: E402

GIB = 2**30


def resnet_graph(side: int, depth: int = 110):
    model = resnet.build(depth=depth, width=16, image_size=side)
    return planner.capture(model, resnet.example_inputs(1, "meta", image_size=side))


def best(graph, cluster, batch, cons=None):
    """(plan or None, seconds, smallest peak memory seen when nothing fits)."""
    t0 = time.perf_counter()
    try:
        plan = planner.optimize(graph, cluster, global_batch_size=batch, constraints=cons or {}, runtime=None,
                                progress=False)
        return plan, time.perf_counter() - t0, None
    except NoFeasiblePlan as e:
        return None, time.perf_counter() - t0, str(e)


def fits(side: int, cluster, spatial: bool) -> bool:
    plan, _, _ = best(resnet_graph(side), cluster, 1, None if spatial else {"spatial": 1})
    return plan is not None


def largest_side(cluster, spatial: bool, lo: int = 256, step: int = 256) -> int:
    """Largest multiple of `step` that fits (fits() is monotone in the side)."""
    if not fits(lo, cluster, spatial):
        return 0
    hi = lo
    while fits(hi * 2, cluster, spatial):
        hi *= 2
    top = hi * 2  # does not fit
    while top - hi > step:
        mid = (hi + top) // 2 // step * step
        if fits(mid, cluster, spatial):
            hi = mid
        else:
            top = mid
    return hi


def smallest_peak(graph, cluster, batch) -> float:
    """Smallest predicted peak memory per device of any configuration without tiles (GiB)."""
    ev = Evaluator(graph, cluster)
    from planner.search import _enumerate

    low = float("inf")
    for base in _enumerate(ev, cluster, batch, {"spatial": 1}, ("fp16",)):
        for rc in ("none", "full"):
            for z in ((0, 3) if base.data > 1 else (0,)):
                try:
                    p = ev.evaluate(base.replace(recompute=rc, zero=z), batch)
                except ValueError:
                    continue
                low = min(low, p.peak_memory)
    return low / GIB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()

    summit8 = planner.Cluster.preset("summit", nodes=8)
    t0 = time.perf_counter()
    g16 = resnet_graph(16384)
    cap = time.perf_counter() - t0
    plan, secs, _ = best(g16, summit8, 1)
    none_plan, _, why = best(g16, summit8, 1, {"spatial": 1})
    print("1. ResNet-v2-110, 16384 x 16384, batch 1, 48 V100 16 GB (8 Summit nodes)")
    if plan is None:
        print("  no plan found")
        return 1
    p = plan.prediction
    print(f"  joint plan: {plan.config.short()}  step {p.step_time:.3f} s, peak {p.peak_memory / GIB:.2f} GiB "
          f"of {p.memory_capacity / GIB:.0f} GiB")
    print(f"  without spatial tiles: {'no plan fits' if none_plan is None else none_plan.config.short()}; "
          f"smallest peak of any such plan {smallest_peak(g16, summit8, 1):.2f} GiB")

    print("2. search time (optimize; capture separate)")
    print(f"  ResNet-110 16384^2 on 48 V100s: capture {cap:.2f} s + search {secs:.2f} s "
          f"({dict(plan.search)['candidates']} candidates, {dict(plan.search)['evaluated']} priced)")
    with torch.device("meta"):
        model = gpt.build(preset="1t")
    t1 = time.perf_counter()
    gg = planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="1t"))
    gcap = time.perf_counter() - t1
    a100 = planner.Cluster.preset("dgx-a100-80gb", nodes=384)
    ta, tb = [], []
    for _ in range(3):  # alternate, so machine load hits both alike; the minimum is the least disturbed
        t = time.perf_counter()
        planner.optimize(gg, a100, global_batch_size=3072, progress=False)
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        planner.optimize(gg, a100, global_batch_size=3072, constraints={"spatial": 1}, progress=False)
        tb.append(time.perf_counter() - t)
    print(f"  GPT-1T on 3072 A100s: capture {gcap:.2f} s + search {min(ta):.2f} s (joint search, min of 3) vs "
          f"{min(tb):.2f} s (spatial=1 forced): ratio {min(ta) / min(tb):.3f}")
    if args.quick:
        return 0

    summit = planner.Cluster.preset("summit", nodes=1)
    print("3. largest image side on one Summit node (6 x V100 16 GB), ResNet-v2-110, batch 1")
    without = largest_side(summit, False)
    with_tiles = largest_side(summit, True)
    print(f"  without spatial: {without} px;  with spatial: {with_tiles} px")

    print("4. predicted speedup on one Summit node, batch 6, at the largest side pipeline-only fits")
    side = 256
    while best(resnet_graph(side * 2), summit, 6, {"pipeline": 6, "data": 1, "tensor": 1, "spatial": 1})[0]:
        side *= 2
    g = resnet_graph(side)
    joint = best(g, summit, 6)[0]
    layer = best(g, summit, 6, {"pipeline": 6, "data": 1, "tensor": 1, "spatial": 1, "micro_batch_size": 6})[0]
    pipe = best(g, summit, 6, {"pipeline": 6, "data": 1, "tensor": 1, "spatial": 1, "bidirectional": False})[0]
    print(f"  side {side} px: joint {joint.config.short()} {joint.prediction.step_time * 1e3:.1f} ms")
    for name, other in (("layer-parallel only", layer), ("pipeline only", pipe)):
        print(f"  vs {name} {other.config.short()} {other.prediction.step_time * 1e3:.1f} ms: "
              f"speedup {other.prediction.step_time / joint.prediction.step_time:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
