"""Data parallelism on 2 ranks (gloo, CPU): meshplan's runtime versus torch DDP.

Both train the same model (GPT "small" by default) with the same per-step
batches, optimizer and gradient bucket size, one process per rank,
OMP_NUM_THREADS=1. They run in the *same* two processes, step by step in
alternation (which one goes first alternates too), so that the machine's
drifting load hits both alike: meshplan's step is the generated build's
Executor.run_step (batch read, forward, backward with bucketed gradient
all-reduce issued from backward hooks, optimizer step, loss to every rank),
DDP's step is the usual loop. The ratio compares the medians of rank 0's
step times after warm-up. Also prints the fraction of meshplan's gradient
all-reduce time hidden behind backward (from its Timeline). Target: ratio <= 1.05.

    python benchmarks/ddp_ratio.py [--steps 40] [--preset small] [--batch 16] [--bucket-mb 0.25]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Shared by both ratio benchmarks: each rank loads its generated program (ours) and opens a
# second gloo group for the torch baseline, so both run in the same processes, alternating steps.
WORKER_PREAMBLE = r'''
import json, os, runpy, sys, time, datetime
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from runtime import rank_main
from runtime.losses import compute_loss
from runtime.materialize import build_model, build_stage, load_factory
from runtime.spec import StageSpec, TrainSpec
torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ns = runpy.run_path({build!r} + f"/rank_{{rank:04d}}.py", run_name="bench")
stages = {{s: (ns[f"Stage{{s}}"], d) for s, d in ns["STAGE_SPECS"].items()}}
session = rank_main.connect(rank_main.prepare(
    rank=rank, program=ns["PROGRAM"], stages=stages, train=ns["TRAIN"], signature=ns["SIGNATURE"],
    argv=["--master-port", os.environ["OURS_PORT"], "--timeout", "120"], build_dir={build!r}))
ex = session.executor
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
train = TrainSpec.from_dict(ns["TRAIN"])
'''

# The end of a worker whose torch side is `torch_step(step) -> seconds`: both sides alternate
# steps (which goes first alternates too), and rank 0 prints both lists of step times.
ALTERNATE_STEPS = r'''
ours, theirs = [], []
for step in range({steps}):
    if step % 2 == 0:
        ours.append(ex.run_step(step).seconds); theirs.append(torch_step(step))
    else:
        theirs.append(torch_step(step)); ours.append(ex.run_step(step).seconds)
if rank == 0:
    print("RESULT " + json.dumps({{"ours": ours, "torch": theirs}}))
dist.destroy_process_group()
session.close()
'''

_WORKER = WORKER_PREAMBLE + r'''
from torch.nn.parallel import DistributedDataParallel as DDP
model = build_model(train)
ddp = DDP(model, bucket_cap_mb={bucket_mb})
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
data = load_factory(train.data_ref, train.root, "data")
G, per = train.global_batch_size, train.global_batch_size // world

def ddp_step(step):
    t0 = time.perf_counter()
    (x,), y = data(G, train.data_seed + step, **train.data_kwargs)
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    opt.zero_grad(set_to_none=False)
    loss = compute_loss(train.loss, ddp(x), y)
    loss.backward()
    opt.step()
    loss.item()
    return time.perf_counter() - t0

ours, theirs = [], []
for step in range({steps}):
    if step % 2 == 0:
        ours.append(ex.run_step(step).seconds); theirs.append(ddp_step(step))
    else:
        theirs.append(ddp_step(step)); ours.append(ex.run_step(step).seconds)
tl = ex.recorder.timeline()
if rank == 0:
    print("RESULT " + json.dumps({{"ours": ours, "ddp": theirs, "overlap": tl.overlap_fraction()}}))
dist.destroy_process_group()
session.close()
'''


def make_build(preset: str, batch: int, bucket_mb: float, out: Path) -> Path:
    import planner
    from planner.app.commands import make_fixed_plan
    from codegen.emit import capture_ref, emit

    ref = str(ROOT / "examples/models/gpt.py") + ":build"
    kw = {"preset": preset}
    graph = capture_ref(ref, kw, batch_size=batch // 2)
    cfg = planner.ParallelConfig(data=2, micro_batch_size=batch // 2, dtype="fp32")
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=2), cfg, batch)
    return emit(plan, ref, None, out, model_kwargs=kw, graph=graph,
                optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9}, bucket_bytes=int(bucket_mb * 2**20)).path


def run_pair(code: str, world: int = 2) -> dict:
    """Run `code` as ranks 0 .. world-1; the dict rank 0 prints after RESULT."""
    from runtime.launch.launcher import free_port

    ports = dict(MASTER_PORT=str(free_port()), OURS_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world),
                                                  MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", **ports))
             for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, o in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"benchmark worker failed:\n{o[-4000:]}")
    return json.loads(next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))[7:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per step over both ranks)")
    ap.add_argument("--steps", type=int, default=40, help="steps of each side")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--bucket-mb", type=float, default=0.25,
                    help="gradient bucket size for both (MiB); small enough that several buckets overlap backward")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        build = make_build(args.preset, args.batch, args.bucket_mb, Path(tmp) / "build")
        res = run_pair(_WORKER.format(root=str(ROOT), build=str(build), bucket_mb=args.bucket_mb, steps=args.steps))
    ours = statistics.median(res["ours"][args.warmup:])
    ddp = statistics.median(res["ddp"][args.warmup:])
    print(f"GPT preset {args.preset!r}, global batch {args.batch} on 2 ranks (gloo, CPU), buckets {args.bucket_mb} MiB, "
          f"{args.steps} alternating steps each (median after {args.warmup} warm-up)")
    print(f"  meshplan step:  {ours * 1e3:8.2f} ms")
    print(f"  torch DDP step: {ddp * 1e3:8.2f} ms")
    print(f"  ratio meshplan / DDP: {ours / ddp:.3f}  (target <= 1.05)")
    if res["overlap"] is not None:
        print(f"  gradient all-reduce hidden behind backward (meshplan Timeline): {res['overlap']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
