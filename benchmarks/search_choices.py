"""What planner.optimize chooses for large models, with and without the long-sequence dimensions.

    python benchmarks/search_choices.py [--json OUT]

Cases (issue 22, "Measure"):
  - GPT-175B (gpt3-175b preset: h 12288, 96 layers, seq 2048) on 1024 A100s (128 dgx-a100-80gb
    nodes), global batch 1536 sequences;
  - a Llama-style 70B (llama-70b preset: h 8192, 80 layers, 64 heads with 8 key/value heads,
    SwiGLU MLP 28672, vocab 128256) at 32K and at 128K tokens per sequence on 512 H100s (64
    dgx-h100 nodes), global batch 16M tokens (16 x 2^20, Llama 3's final pre-training batch,
    arXiv 2407.21783 section 3.4.1): 512 sequences of 32K, 128 of 128K.

Each is searched twice: "without" pins sequence_parallel=False and context=1; "with" pins
nothing, so the search may use them. A checkout whose search does not know one of those knobs
yet (it is not in planner.search.FIXED_KNOBS) does not search it either; the script then
says so and the two variants are the same search.

The search is the cost model's (runtime=None: every configuration the cost model prices),
because the code generator cannot yet split attention whose query and key/value head counts
differ (grouped-query attention; examples/models/gpt.py) and the runtime refuses the new
dimensions until it runs them. Evaluator options are the defaults (meshplan's own runtime).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import planner  # noqa: E402
from examples.models import gpt  # noqa: E402
from planner.search import FIXED_KNOBS  # noqa: E402

# the knobs that turn the new dimensions off ("without")
WITHOUT = (("sequence_parallel", False), ("context", 1))
TOKENS_PER_BATCH = 16 * 2**20


@dataclass(frozen=True)
class Case:
    """One model on one cluster: a gpt.py preset at `seq_len`, `nodes` nodes of `cluster`, `batch` sequences."""

    label: str
    preset: str
    seq_len: int
    cluster: str
    nodes: int
    batch: int


CASES = (
    Case("GPT-175B, 1024 A100", "gpt3-175b", 2048, "dgx-a100-80gb", 128, 1536),
    Case("Llama-70B 32K, 512 H100", "llama-70b", 32768, "dgx-h100", 64, TOKENS_PER_BATCH // 32768),
    Case("Llama-70B 128K, 512 H100", "llama-70b", 131072, "dgx-h100", 64, TOKENS_PER_BATCH // 131072),
)


def constraints(variant: str) -> dict:
    """The constraints of a variant ("with" or "without"), limited to the knobs this search knows."""
    return {} if variant == "with" else {k: v for k, v in WITHOUT if k in FIXED_KNOBS}


def choose(case: Case, graph, variant: str) -> dict:
    """planner.optimize's choice for `case` under `variant`, as plain figures."""
    cluster = planner.Cluster.preset(case.cluster, nodes=case.nodes)
    t0 = time.perf_counter()
    try:
        plan = planner.optimize(graph, cluster, global_batch_size=case.batch, constraints=constraints(variant),
                                progress=False, runtime=None)
    except planner.NoFeasiblePlan as e:
        return dict(case=case.label, variant=variant, fits=False, reason=str(e),
                    search_s=time.perf_counter() - t0)
    p = plan.prediction
    return dict(case=case.label, variant=variant, fits=True, config=plan.config.short(),
                config_fields=plan.config.to_dict(), step_time_s=p.step_time, peak_memory_gib=p.peak_memory / 2**30,
                memory_capacity_gib=p.memory_capacity / 2**30, mfu=p.mfu, tokens_per_s=p.tokens_per_s,
                search_s=time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="OUT", type=Path, help="write every choice's figures here")
    args = ap.parse_args()
    unknown = [k for k, _ in WITHOUT if k not in FIXED_KNOBS]
    if unknown:
        print(f"note: this checkout's search does not know {', '.join(unknown)}, so it does not search "
              f"{'them' if len(unknown) > 1 else 'it'}; where nothing else differs, 'with' is the 'without' search")
    rows = []
    for case in CASES:
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = gpt.build(preset=case.preset, seq_len=case.seq_len)
        graph = planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset=case.preset,
                                                          seq_len=case.seq_len))
        print(f"\n{case.label}: batch {case.batch} x {case.seq_len} tokens (capture {time.perf_counter() - t0:.1f} s)")
        for variant in ("without", "with"):
            same = variant == "with" and constraints("with") == constraints("without")
            row = dict(rows[-1], variant=variant, same_search=True) if same else choose(case, graph, variant)
            rows.append(row)
            if row.get("same_search"):
                print(f"  {variant:<7}: the same search as 'without' (nothing more to search here)")
                continue
            if not row["fits"]:
                print(f"  {variant:<7}: NO CONFIGURATION FITS (search {row['search_s']:.1f} s): {row['reason']}")
                continue
            print(f"  {variant:<7}: {row['config']:<52} step {row['step_time_s']:8.2f} s  "
                  f"memory {row['peak_memory_gib']:5.1f} of {row['memory_capacity_gib']:.0f} GiB  "
                  f"MFU {row['mfu']:.1%}  search {row['search_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
