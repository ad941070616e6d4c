"""The GPU cost model against an op table and against the H100 end-to-end case, term by term.

    python benchmarks/gpu_cost_model.py                                  # the project's H100 table and case
    python benchmarks/gpu_cost_model.py --op-table ops.csv --cluster calibrated.yaml   # a calibration's

1. Per op family: how far the model of each row (cost_models/gpu_fit.py: the host dispatching the call's
   ops while the device runs their kernels) lies from the measured row, with the cluster's constants
   (the dgx-h100 preset's, fit to cost_models/reference/h100_ops.csv; or a calibrated file's).
2. The end-to-end case of ../shared/reference/gpu/H100.md (a 163M GPT, batch 16 x 1024, bf16 autocast,
   fused AdamW, one H100), predicted term by term under each execution option (runtime/execution.py)
   the planner can choose, beside the runs of it under today's runtime (cost_models/reference/README.md;
   H100.md's own run, 66.2-67.6 ms and 17,504 MiB, was the runtime before issue 30).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import planner  # noqa: E402
from cost_models.gpu_costs import gpu_costs  # noqa: E402
from cost_models.gpu_fit import error_report  # noqa: E402
from cost_models.hardware import Cluster  # noqa: E402
from cost_models.op_table import read_op_table  # noqa: E402
from examples.models import gpt  # noqa: E402
from planner.evaluator import Evaluator  # noqa: E402
from runtime.execution import Execution  # noqa: E402

TABLE = Path(__file__).resolve().parents[1] / "cost_models" / "reference" / "h100_ops.csv"
CASE = dict(vocab_size=50304, seq_len=1024, hidden=768, num_layers=12, num_heads=12)
# measured on an H100 on 2026-11-27 (benchmarks/gpu_session.sh): the step's median in ms and the peak of
# torch.cuda.max_memory_allocated in MiB; the compiled run with the fused loss is eager_ratio.py's (its wall
# clock), the others `meshplan compare`'s
MEASURED = {Execution(): (60.05, 16880), Execution(compile=True): (48.96, 16589),
            Execution(compile=True, loss="chunked", vocab_multiple=64): (53.00, 7672)}
MiB = 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op-table", default=str(TABLE), help="the op table (CSV) to check the model against")
    ap.add_argument("--cluster", default=None, help="a cluster file whose fit.gpu.* constants price (default: the "
                                                    "dgx-h100 preset at one device)")
    args = ap.parse_args(argv)
    cluster = Cluster.load(args.cluster) if args.cluster else Cluster.preset("dgx-h100", devices=1)
    if cluster.device.kind != "gpu":
        print(f"error: {cluster.name} is not a GPU cluster; give a GPU preset or a `meshplan calibrate --device cuda` "
              "file", file=sys.stderr)
        return 2
    costs = gpu_costs(cluster)
    print(f"constants: {costs.source}")
    print(error_report(read_op_table(args.op_table), cluster.device, costs))
    print()
    with torch.device("meta"):
        model = gpt.build(**CASE)
    graph = planner.capture(model, gpt.example_inputs(batch_size=16, device="meta", **CASE))
    one = dataclasses.replace(cluster, num_nodes=1, devices_per_node=1)
    config = planner.ParallelConfig(micro_batch_size=16, dtype="bf16")
    print("H100.md case on one H100, under each execution option:")
    for ex in (Execution(), Execution(loss="chunked"), Execution(compile=True),
               Execution(compile=True, loss="compiled"), Execution(compile=True, loss="chunked", vocab_multiple=64)):
        pred = Evaluator(graph, one, execution=ex).evaluate(config, 16)
        t, m = pred.time, pred.memory
        terms = ", ".join(f"{f.name} {getattr(t, f.name) * 1e3:.1f}" for f in dataclasses.fields(t)
                          if getattr(t, f.name) > 0)
        mem = ", ".join(f"{f.name} {getattr(m, f.name) / MiB:,.0f}" for f in dataclasses.fields(m)
                        if getattr(m, f.name) > 0)
        label = ("compiled" if ex.compile else "eager") + f", {ex.loss} loss" + \
            (f", vocabulary padded to {ex.vocab_multiple}" if ex.vocab_multiple > 1 else "")
        step, alloc = pred.step_time * 1e3, pred.allocated_memory / MiB
        if ex in MEASURED:
            ms, mib = MEASURED[ex]
            print(f"  {label}: step {step:.1f} ms (measured {ms:.2f}: {step / ms - 1:+.1%}), allocated {alloc:,.0f} MiB "
                  f"(measured {mib:,}: {alloc / mib - 1:+.1%})")
        else:
            print(f"  {label}: step {step:.1f} ms, allocated {alloc:,.0f} MiB (not measured)")
        print(f"    time (ms): {terms}")
        print(f"    memory (MiB): {mem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
