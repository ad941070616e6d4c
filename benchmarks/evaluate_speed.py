"""How fast planner.evaluate prices one configuration of the 1T GPT (after capture).

The search calls it thousands of times; the target (issue 3) is under 50 ms
per configuration. Prints the time of the first (cold: per-layer cost tables
filled) and of later (warm) evaluations over a grid of data x tensor x
pipeline configurations on 384 DGX A100 nodes (3072 GPUs).

    python benchmarks/evaluate_speed.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import planner  # noqa: E402
from planner.evaluator import Evaluator  # noqa: E402
from examples.models import gpt  # noqa: E402


def main() -> int:
    with torch.device("meta"):
        model = gpt.build(preset="1t")
    graph = planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="1t"))
    cluster = planner.Cluster.preset("dgx-a100-80gb", nodes=384)
    ev = Evaluator(graph, cluster)
    configs = []
    for t in (1, 2, 4, 8):
        for p in (1, 2, 4, 8, 16, 32, 64, 128):
            d = 3072 // (t * p)
            if 3072 % (t * p) or 3072 % d:
                continue
            for mb in (1, 2):
                if 3072 % (d * mb) == 0:
                    configs.append(planner.ParallelConfig(data=d, tensor=t, pipeline=p, micro_batch_size=mb,
                                                          recompute="full"))
    times = []
    for cfg in configs:
        t0 = time.perf_counter()
        ev.evaluate(cfg, 3072)
        times.append(time.perf_counter() - t0)
    cold = times[0]
    warm = times[1:]
    print(f"1T GPT ({graph.num_params:,} parameters, {len(graph.layers)} layers) on 3072 A100s: "
          f"{len(configs)} configurations")
    print(f"  first evaluation (cold caches): {cold * 1e3:.1f} ms")
    print(f"  later evaluations: median {statistics.median(warm) * 1e3:.2f} ms, max {max(warm) * 1e3:.2f} ms")
    ok = max(times) < 0.050
    print(f"  target (< 50 ms each): {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
