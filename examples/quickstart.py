"""meshplan's main example: plan GPT-3 175B for 16 DGX A100 nodes, print the plan and why it won.

    python examples/quickstart.py [--preset gpt3-175b] [--cluster dgx-a100-80gb] [--nodes 16] [--batch 1536]

Nothing is allocated: the model is built under torch.device("meta"), so a
175-billion-parameter model is captured and planned in seconds on a laptop.
The plan, its pictures and report are written under out/quickstart/ (out/ is in .gitignore;
codegen turns the plan into per-rank programs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

import torch  # noqa: E402

import planner  # noqa: E402
from planner.app.report import write_report  # noqa: E402
from examples.models import gpt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt3-175b", choices=sorted(gpt.PRESETS))
    ap.add_argument("--cluster", default="dgx-a100-80gb", help="cluster preset or file")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1536, help="global batch size")
    ap.add_argument("-o", "--output", default="out/quickstart/plan.json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = gpt.build(preset=args.preset)
    graph = planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset=args.preset))
    print(graph.summary())
    print(f"\ncaptured in {time.perf_counter() - t0:.1f} s without allocating parameter memory\n")

    if args.cluster in planner.Cluster.preset_names():
        cluster = planner.Cluster.preset(args.cluster, nodes=args.nodes)
    else:
        cluster = planner.Cluster.load(args.cluster)
    print(cluster.summary())
    need = graph.param_bytes
    have = cluster.device.memory_bytes * cluster.num_devices
    print(f"\nfp32 weights alone: {need / 2**30:,.0f} GiB; the cluster holds {have / 2**30:,.0f} GiB "
          f"in {cluster.num_devices} devices of {cluster.device.memory_bytes / 2**30:.0f} GiB each.\n")

    plan = planner.optimize(graph, cluster, global_batch_size=args.batch)
    print(plan.summary())
    print()
    print(planner.explain(plan))
    plan.save(args.output)
    stem = str(Path(args.output).with_suffix(""))
    pictures = planner.visualize(plan, stem)
    report = write_report(plan, f"{stem}_report.html")
    print(f"\nwrote {args.output}, {len(pictures)} pictures ({stem}_mesh.png, {stem}_schedule.png, ...) and {report}")

if __name__ == "__main__":
    main()
