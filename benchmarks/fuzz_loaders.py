"""Throw damaged plan, cluster and Program documents at the loaders and count the outcomes.

    python benchmarks/fuzz_loaders.py [--n 5000] [--seed 0]

Outcomes: "loaded" (a harmless mutation), "rejected" (the documented
PlanFileError / ClusterFileError / ProgramError, message naming the field),
"CRASH" (any other exception: a bug). Program documents are the per-rank
Programs of three lowered GPT-tiny plans (tests/unit/fuzz_mutations.py). Exits non-zero on any crash or a load slower than 1 s.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]

import torch  # noqa: E402

import planner  # noqa: E402
from cost_models.hardware import Cluster, ClusterFileError  # noqa: E402
from examples.models import gpt  # noqa: E402
from fuzz_mutations import mutate, sample_program_docs  # noqa: E402
from planner import Plan, PlanFileError  # noqa: E402
from runtime.program import Program, ProgramError  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000, help="mutated documents per loader")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with torch.device("meta"):
        model = gpt.build(preset="tiny")
    graph = planner.capture(model, gpt.example_inputs(batch_size=2, device="meta", preset="tiny"))
    plan_doc = planner.optimize(graph, Cluster.preset("dgx-a100-80gb", nodes=2), global_batch_size=32,
                                progress=False).to_dict()
    cluster_docs = [Cluster.preset(p).to_dict() for p in ("dgx-a100-80gb", "dgx-h100", "summit")]
    program_docs = sample_program_docs()
    rng = random.Random(args.seed)
    outcomes: dict[str, collections.Counter] = {k: collections.Counter() for k in (
        "plan", "cluster", "plan file bytes", "program", "program file bytes")}
    slowest = 0.0
    crashes = []

    def run(kind, fn):
        nonlocal slowest
        t0 = time.perf_counter()
        try:
            fn()
            outcomes[kind]["loaded"] += 1
        except (PlanFileError, ClusterFileError, ProgramError):
            outcomes[kind]["rejected"] += 1
        except Exception as e:  # noqa: BLE001 - any other error is the bug we hunt
            outcomes[kind]["CRASH"] += 1
            crashes.append(f"{kind}: {type(e).__name__}: {e}")
        slowest = max(slowest, time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        ppath = Path(tmp) / "program.json"
        text = json.dumps(plan_doc).encode()
        ptexts = [json.dumps(d).encode() for d in program_docs]
        for _ in range(args.n):
            doc = mutate(plan_doc, rng, rng.randint(1, 4))
            run("plan", lambda: Plan.from_dict(doc, origin="fuzz"))
            cdoc = mutate(rng.choice(cluster_docs), rng, rng.randint(1, 4))
            run("cluster", lambda: Cluster.from_dict(cdoc, origin="fuzz"))
            cut = rng.randint(0, len(text))
            junk = bytes(rng.randrange(256) for _ in range(rng.randint(0, 4)))
            path.write_bytes(text[:cut] + junk)
            run("plan file bytes", lambda: Plan.load(path))
            pdoc = mutate(rng.choice(program_docs), rng, rng.randint(1, 4))
            run("program", lambda: Program.from_dict(pdoc))
            ptext = rng.choice(ptexts)
            ppath.write_bytes(ptext[:rng.randint(0, len(ptext))] + junk)
            run("program file bytes", lambda: Program.load(ppath))
    total = sum(sum(c.values()) for c in outcomes.values())
    print(f"{total} damaged inputs (seed {args.seed}); slowest load {slowest * 1e3:.1f} ms")
    for kind, c in outcomes.items():
        print(f"  {kind:<19} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    for line in crashes[:10]:
        print("  " + line)
    return 1 if crashes or slowest > 1.0 else 0


if __name__ == "__main__":
    sys.exit(main())
