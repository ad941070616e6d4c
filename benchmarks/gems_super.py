"""GEMS bi-directional pipelines and SUPER sub-graph parallelism: predicted and measured (issue 6).

Three parts (all by default; pick with --part):

  bubble    predicted bubble fraction of bidirectional (T = 1, 2, 4) versus 1F1B with the same
            devices, micro-batch size and global batch (2T micro-batches per data replica), for
            p = 2, 4, 8 (GPT "small" captured on meta tensors, dgx-a100-80gb cluster of p devices);
            and the measured CPU step-time ratio bidirectional / 1F1B on 2 ranks (p = 2) and on
            4 ranks (data 2 x p 2), gloo, with the cost model's prediction for the same ratio
  subgraph  a model with heavy parallel branches (the Inception-style CNN, wide branches):
            predicted (cluster "local", this machine) and measured step time of sub-graph B=2
            versus data-only on the same 2 ranks, and data 2 x B 2 versus data 4 on 4 ranks
  search    which strategy planner.optimize picks for the zoo's examples on the preset clusters,
            and where bidirectional / sub-graph plans rank

Measured step times: each configuration is built twice and the four builds run A, B, A, B in the
same worker processes (runtime.launch.launcher.run_many), so drifting machine load hits both alike; the
figure is the median of rank 0's step seconds after --warmup steps, over both copies.

    python benchmarks/gems_super.py [--part bubble|subgraph|search] [--steps 20] [--warmup 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT_CPU = {"preset": "tiny", "hidden": 128, "num_layers": 4, "seq_len": 64, "vocab_size": 512}
INCEPTION_CPU = {"num_modules": 3, "channels": 24, "stem_channels": 16, "image_size": 16}
SGD = {"name": "sgd", "lr": 0.01, "momentum": 0.9}


def _measure(ref: str, kw: dict, configs: dict, batch: int, steps: int, warmup: int, root: Path) -> dict:
    """name -> (measured median step s, predicted step s) for configs of one world size."""
    import planner
    from codegen.emit import capture_ref, emit
    from runtime.launch.launcher import run_many

    builds, preds = [], {}
    for copy in (0, 1):
        for name, cfg in configs.items():
            graph = capture_ref(ref, kw, batch_size=cfg.micro_batch_size)
            plan = planner.make_plan(graph, planner.Cluster.preset("local", devices=cfg.num_devices), cfg,
                                     global_batch_size=batch)
            preds[name] = plan.prediction.step_time
            builds.append((name, emit(plan, ref, None, root / f"{name}_{copy}", model_kwargs=kw, graph=graph,
                                      optimizer=SGD).path))
    results = run_many([b for _, b in builds], steps=steps, backend="gloo", timeout=120)
    times: dict[str, list[float]] = {}
    for (name, _), res in zip(builds, results):
        if res.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{res.output[-2000:]}")
        times.setdefault(name, []).extend(res.seconds[0][warmup:])
    return {name: (statistics.median(times[name]), preds[name]) for name in configs}


def bubble(steps: int, warmup: int) -> None:
    import torch

    import planner
    from examples.models import gpt

    with torch.device("meta"):
        model = gpt.build(preset="small")
    graph = planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="small"))
    print("predicted bubble fraction (GPT 'small', dgx-a100-80gb, micro-batch 4, batch = 4 x 2T):")
    print(f"  {'p':>2} {'T':>2} {'1F1B bubble':>12} {'bidi bubble':>12} {'1F1B step ms':>13} {'bidi step ms':>13}")
    for p in (2, 4, 8):
        cl = planner.Cluster.preset("dgx-a100-80gb", devices=p)
        for T in (1, 2, 4):
            one = planner.evaluate(graph, cl, planner.ParallelConfig(pipeline=p, micro_batch_size=4),
                                   global_batch_size=8 * T)
            bidi = planner.evaluate(graph, cl, planner.ParallelConfig(pipeline=p, micro_batch_size=4,
                                                                     bidirectional=True, replicas_per_direction=T),
                                    global_batch_size=8 * T)
            print(f"  {p:>2} {T:>2} {one.bubble_fraction:>12.1%} {bidi.bubble_fraction:>12.1%} "
                  f"{one.step_time * 1e3:>13.3f} {bidi.step_time * 1e3:>13.3f}")
    ref = str(ROOT / "examples/models/gpt.py") + ":build"
    for label, d in (("2 ranks, pipeline 2", 1), ("4 ranks, data 2 x pipeline 2", 2)):
        configs = {"1f1b": planner.ParallelConfig(pipeline=2, data=d, micro_batch_size=4, dtype="fp32"),
                   "bidi": planner.ParallelConfig(pipeline=2, data=d, micro_batch_size=4, dtype="fp32",
                                                  bidirectional=True)}
        with tempfile.TemporaryDirectory() as tmp:
            r = _measure(ref, GPT_CPU, configs, 8 * d, steps, warmup, Path(tmp))
        print(f"measured on CPU, gloo, {label}, GPT {GPT_CPU}, batch {8 * d} (2 micro-batches of 4 per replica):")
        for name, (m, pr) in r.items():
            print(f"  {name:<5} measured {m * 1e3:8.2f} ms   predicted (local) {pr * 1e3:8.2f} ms")
        print(f"  ratio bidi / 1F1B: measured {r['bidi'][0] / r['1f1b'][0]:.3f}, "
              f"predicted {r['bidi'][1] / r['1f1b'][1]:.3f}")


def subgraph(steps: int, warmup: int) -> None:
    import planner

    ref = str(ROOT / "examples/models/inception.py") + ":build"
    for label, configs, batch in (
        ("2 ranks", {"data 2": planner.ParallelConfig(data=2, micro_batch_size=8, dtype="fp32"),
                     "sub-graph 2": planner.ParallelConfig(subgraph=2, micro_batch_size=16, dtype="fp32")}, 16),
        ("4 ranks", {"data 4": planner.ParallelConfig(data=4, micro_batch_size=4, dtype="fp32"),
                     "data 2 x sub-graph 2": planner.ParallelConfig(data=2, subgraph=2, micro_batch_size=8,
                                                                    dtype="fp32")}, 16),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            r = _measure(ref, INCEPTION_CPU, configs, batch, steps, warmup, Path(tmp))
        print(f"Inception-style CNN {INCEPTION_CPU}, batch {batch}, {label}, CPU gloo:")
        for name, (m, pr) in r.items():
            print(f"  {name:<22} measured {m * 1e3:8.2f} ms   predicted (local) {pr * 1e3:8.2f} ms")
        (a, (ma, pa)), (b, (mb, pb)) = r.items()
        print(f"  ratio {b} / {a}: measured {mb / ma:.3f}, predicted {pb / pa:.3f}")


def search() -> None:
    import torch

    import planner
    from examples.models import gpt, inception, resnet
    from planner.strategies.subgraph.regions import split_regions

    cases = []
    with torch.device("meta"):
        cases.append(("gpt small", planner.capture(gpt.build(preset="small"),
                                                   gpt.example_inputs(batch_size=1, device="meta", preset="small")), 64))
        cases.append(("gpt 175b", planner.capture(gpt.build(preset="gpt3-175b"),
                                                  gpt.example_inputs(batch_size=1, device="meta",
                                                                     preset="gpt3-175b")), 1536))
        cases.append(("resnet-56", planner.capture(resnet.build(depth=56),
                                                   resnet.example_inputs(batch_size=1, device="meta")), 256))
        kw = {"num_modules": 6, "channels": 64, "stem_channels": 64, "image_size": 64}
        cases.append(("inception", planner.capture(inception.build(**kw),
                                                   inception.example_inputs(batch_size=1, device="meta",
                                                                            image_size=64)), 256))
    clusters = [("dgx-a100-80gb", dict(devices=8)), ("dgx-h100", dict(devices=8)), ("summit", dict(nodes=2)),
                ("dgx-a100-80gb", dict(nodes=16))]
    print("search: the chosen plan, and the best plan restricted to bidirectional / sub-graph (its step time as "
          "a multiple of the chosen plan's)")
    for name, graph, batch in cases:
        for preset, size in clusters:
            cl = planner.Cluster.preset(preset, **size)
            try:
                plan = planner.optimize(graph, cl, global_batch_size=batch, progress=False)
            except ValueError as e:
                print(f"  {name:<10} {preset}({cl.num_devices}): no plan ({str(e).splitlines()[0][:80]})")
                continue
            best = plan.prediction.step_time

            def best_of(**cons):
                try:
                    alt = planner.optimize(graph, cl, global_batch_size=batch, progress=False, constraints=cons)
                except ValueError:
                    return "none fits"
                return f"{alt.prediction.step_time / best:.2f}x ({alt.config.short().split(' rc=')[0]})"
            sub = min((best_of(subgraph=b) for b in (2, 4)), key=lambda x: (x == "none fits", x)) \
                if split_regions(graph, 2) else "n/a (no independent branches)"
            print(f"  {name:<10} {preset}({cl.num_devices}): {plan.config.short()}")
            print(f"  {'':<10}   best bidirectional {best_of(bidirectional=True)};  best sub-graph {sub}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("bubble", "subgraph", "search", "all"), default="all")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args(argv)
    if args.part in ("bubble", "all"):
        bubble(args.steps, args.warmup)
    if args.part in ("subgraph", "all"):
        subgraph(args.steps, args.warmup)
    if args.part in ("search", "all"):
        search()
    return 0


if __name__ == "__main__":
    sys.exit(main())
