"""1F1B on 2 pipeline stages (gloo, CPU): meshplan's runtime versus torch.distributed.pipelining.

Both sides run the *same* two stage modules: the classes meshplan generated
(rank_0000.py's Stage0, rank_0001.py's Stage1), each side with its own copy
built with the same parameters; torch's side wraps them in PipelineStage and
runs Schedule1F1B with the same micro-batches, loss and optimizer. Both run
in the same two processes, step by step in alternation (the order alternates
too), so the machine's drifting load hits both alike. The ratio compares the
medians of rank 0's step times (batch read, pipelined forward/backward,
optimizer step) after warm-up. Target: ratio <= 1.05.

    python benchmarks/pipeline_ratio.py [--steps 40] [--preset small] [--batch 16] [--micro 4]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_ratio import ALTERNATE_STEPS, WORKER_PREAMBLE, run_pair  # noqa: E402

_WORKER = WORKER_PREAMBLE + r'''
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
(idx, (cls, spec_dict)), = stages.items()
module = build_stage(cls, StageSpec.from_dict(spec_dict), train)
stage = PipelineStage(module, idx, world, torch.device("cpu"))
sched = Schedule1F1B(stage, {micro}, loss_fn=lambda out, y: compute_loss(train.loss, out, y))
opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9, foreach=False)
data = load_factory(train.data_ref, train.root, "data")
G = train.global_batch_size

def torch_step(step):
    t0 = time.perf_counter()
    (x,), y = data(G, train.data_seed + step, **train.data_kwargs)
    opt.zero_grad(set_to_none=False)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    opt.step()
    return time.perf_counter() - t0
''' + ALTERNATE_STEPS


def make_build(preset: str, batch: int, micro: int, out: Path) -> Path:
    import planner
    from planner.app.commands import make_fixed_plan
    from codegen.emit import capture_ref, emit

    ref = str(ROOT / "examples/models/gpt.py") + ":build"
    kw = {"preset": preset}
    graph = capture_ref(ref, kw, batch_size=batch // micro)
    cfg = planner.ParallelConfig(pipeline=2, micro_batch_size=batch // micro, schedule="1f1b", dtype="fp32")
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=2), cfg, batch)
    return emit(plan, ref, None, out, model_kwargs=kw, graph=graph,
                optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9}).path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=40, help="steps of each side")
    ap.add_argument("--warmup", type=int, default=6)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        build = make_build(args.preset, args.batch, args.micro, Path(tmp) / "build")
        layers = json.loads((build / "plan.json").read_text())["stages"]
        res = run_pair(_WORKER.format(root=str(ROOT), build=str(build), micro=args.micro, steps=args.steps))
    o = statistics.median(res["ours"][args.warmup:])
    t = statistics.median(res["torch"][args.warmup:])
    print(f"GPT preset {args.preset!r}, batch {args.batch} in {args.micro} micro-batches, 2 stages "
          f"({layers[0]['layers'][0]}..{layers[0]['layers'][-1]} | {layers[1]['layers'][0]}..{layers[1]['layers'][-1]}), "
          f"gloo CPU, {args.steps} alternating steps each (median after {args.warmup} warm-up)")
    print(f"  meshplan 1F1B step:                        {o * 1e3:8.2f} ms")
    print(f"  torch.distributed.pipelining Schedule1F1B: {t * 1e3:8.2f} ms")
    print(f"  ratio meshplan / torch: {o / t:.3f}  (target <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
