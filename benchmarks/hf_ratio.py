"""Hugging Face models on this machine (gloo, CPU): meshplan's runtime versus PyTorch's own stack.

  ddp:      Llama (transformers' LlamaForCausalLM, preset "small": 4 layers, width 256, grouped-query
            attention) at data 2, against torch DDP on the same model, batches, optimizer and bucket size.
  pipeline: GPT-2 (GPT2LMHeadModel, preset "small": 4 layers, width 256, the 50257-token vocabulary,
            tied embeddings) at data 2 x pipeline 2 with 1F1B, against the same split made by
            torch.distributed.pipelining itself: `pipeline()` cuts the model at the layer meshplan's plan
            starts its second stage with, each stage is wrapped in DDP over the data ranks, and
            Schedule1F1B runs the same micro-batches. pipeline() gives each stage its own copy of the
            tied weight and leaves it to the user to sum their gradients; this benchmark does so (one
            all-reduce over the two stages, as meshplan's ALLREDUCE tied does), so both sides compute
            the same step. It also leaves the tied weight's second name on the first stage, where
            nothing reads it, so DDP there needs find_unused_parameters=True.

Both sides run in the same processes, step by step in alternation (which goes first alternates too),
so the machine's drifting load hits both alike; the ratio compares the medians of rank 0's step times
after warm-up.

    python benchmarks/hf_ratio.py ddp [--steps 30] [--batch 16] [--seq 64]
    python benchmarks/hf_ratio.py pipeline [--steps 20] [--batch 16] [--micro 4] [--seq 64]
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

HF = str(ROOT / "examples/models/hf.py") + ":build"
SGD = {"name": "sgd", "lr": 0.01, "momentum": 0.9}

_DDP = WORKER_PREAMBLE + r'''
from torch.nn.parallel import DistributedDataParallel as DDP
from runtime.data import call_model, map_inputs
model = build_model(train)
ddp = DDP(model, bucket_cap_mb={bucket_mb})
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
data = load_factory(train.data_ref, train.root, "data")
G, per = train.global_batch_size, train.global_batch_size // world

def torch_step(step):
    t0 = time.perf_counter()
    x, y = data(G, train.data_seed + step, **train.data_kwargs)
    x, y = map_inputs(x, lambda t: t[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]
    opt.zero_grad(set_to_none=False)
    loss = compute_loss(train.loss, call_model(ddp, x), y)
    loss.backward()
    opt.step()
    loss.item()
    return time.perf_counter() - t0
''' + ALTERNATE_STEPS

_PIPELINE = WORKER_PREAMBLE + r'''
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, SplitPoint, pipeline
from torch.nn.parallel import DistributedDataParallel as DDP
d = 2
pos, drank = divmod(rank, d)                                  # meshplan's layout: pipe outermost
pp_groups = [dist.new_group([k, d + k]) for k in range(d)]
dp_groups = [dist.new_group([p * d, p * d + 1]) for p in range(2)]
pp, dp = pp_groups[drank], dp_groups[pos]
data = load_factory(train.data_ref, train.root, "data")
G, per, micro = train.global_batch_size, train.global_batch_size // d, {micro}
x0, _ = data(G, train.data_seed, **train.data_kwargs)
mb = {{k: v[:per // micro] for k, v in x0.items()}}
pipe = pipeline(build_model(train), mb_args=(), mb_kwargs=mb, split_spec={{{split!r}: SplitPoint.BEGINNING}})
module = pipe.get_stage_module(pos)
named = dict(module.named_parameters())
tied = named["transformer.wte.weight" if pos == 0 else "lm_head.weight"]
# pipeline() keeps the tied weight's second name on stage 0, where nothing reads it: DDP must be told
stage = PipelineStage(DDP(module, process_group=dp, bucket_cap_mb={bucket_mb}, find_unused_parameters=True), pos, 2,
                      torch.device("cpu"), group=pp)
sched = Schedule1F1B(stage, micro, loss_fn=lambda out, y: compute_loss(train.loss, out, y))
opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9, foreach=False)

def torch_step(step):
    t0 = time.perf_counter()
    x, y = data(G, train.data_seed + step, **train.data_kwargs)
    x, y = {{k: v[drank * per:(drank + 1) * per] for k, v in x.items()}}, y[drank * per:(drank + 1) * per]
    opt.zero_grad(set_to_none=False)
    if pos == 0:
        sched.step(**x)
    else:
        sched.step(target=y, losses=[])
    dist.all_reduce(tied.grad, group=pp)                      # the tied copies' gradients summed
    opt.step()
    return time.perf_counter() - t0
''' + ALTERNATE_STEPS


def _build(kind: str, args, out: Path) -> Path:
    import planner
    from planner.app.commands import make_fixed_plan
    from codegen.emit import capture_ref, emit

    if kind == "ddp":
        kw = {"arch": "llama", "preset": "small", "seq_len": args.seq}
        cfg = planner.ParallelConfig(data=2, micro_batch_size=args.batch // 2, dtype="fp32")
    else:
        kw = {"arch": "gpt2", "preset": "small", "seq_len": args.seq}
        cfg = planner.ParallelConfig(data=2, pipeline=2, schedule="1f1b", dtype="fp32",
                                     micro_batch_size=args.batch // 2 // args.micro)
    graph = capture_ref(HF, kw, batch_size=cfg.micro_batch_size)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=cfg.num_devices), cfg, args.batch)
    return emit(plan, HF, None, out, model_kwargs=kw, graph=graph, optimizer=SGD,
                bucket_bytes=int(args.bucket_mb * 2**20)).path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("ddp", "pipeline"))
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sample")
    ap.add_argument("--micro", type=int, default=4, help="pipeline: micro-batches per data rank and step")
    ap.add_argument("--steps", type=int, default=None, help="steps of each side (default 30 ddp, 20 pipeline)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket size for both (MiB)")
    args = ap.parse_args(argv)
    steps = args.steps or (30 if args.kind == "ddp" else 20)
    with tempfile.TemporaryDirectory() as tmp:
        build = _build(args.kind, args, Path(tmp) / "build")
        fields = dict(root=str(ROOT), build=str(build), bucket_mb=args.bucket_mb, steps=steps)
        if args.kind == "ddp":
            res = run_pair(_DDP.format(**fields), world=2)
        else:
            stages = json.loads((build / "plan.json").read_text())["stages"]
            split = stages[1]["layers"][0]
            res = run_pair(_PIPELINE.format(**fields, micro=args.micro, split=split), world=4)
    ours = statistics.median(res["ours"][args.warmup:])
    theirs = statistics.median(res["torch"][args.warmup:])
    if args.kind == "ddp":
        print(f"HF Llama (small), global batch {args.batch} x {args.seq} tokens, data 2 (gloo, CPU), "
              f"{steps} alternating steps each (median after {args.warmup} warm-up)")
        other = "torch DDP"
    else:
        print(f"HF GPT-2 (small, vocabulary 50257, tied embeddings), global batch {args.batch} x {args.seq} tokens, "
              f"data 2 x pipeline 2 1F1B, {args.micro} micro-batches per data rank, second stage from {split!r} "
              f"(gloo, CPU), {steps} alternating steps each (median after {args.warmup} warm-up)")
        other = "torch.distributed.pipelining (its own split) + DDP"
    print(f"  meshplan step: {ours * 1e3:9.1f} ms")
    print(f"  {other} step: {theirs * 1e3:9.1f} ms")
    print(f"  ratio meshplan / torch: {ours / theirs:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
