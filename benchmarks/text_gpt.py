"""Train the example GPT on the shipped text with data 2 x pipeline 2, against the single-process run.

What it does (the README's training example, end to end):
  1. tokenizes examples/data/corpus.txt byte by byte (vocabulary 256) into a train and a validation
     token file (examples/data/tokenize_text.py);
  2. `meshplan codegen` of the GPT "small" preset (4 layers, width 128, 64 tokens) reading the token
     file (examples/data/tokens.py:TokenFile): data 2 x pipeline 2, 1F1B, micro-batch 4, global batch
     16, AdamW (weight decay 0.1 on matrices only), linear warmup then cosine decay to a floor,
     clipping at global norm 1, evaluation on the validation file every EVAL_EVERY steps;
  3. `meshplan run` of STEPS steps on 4 gloo processes (metrics.jsonl, TensorBoard event files);
  4. the same training in one process (runtime.reference.reference_run: same model, data, optimizer,
     schedule and clipping);
  5. compares the two loss curves and draws them (with the evaluation losses) into a PNG.

It exits 1 when the parallel run's final loss (the mean of its last 20 steps) is not below
FINAL_LOSS_BELOW, or when a step's loss differs from the single-process run's by more than
CURVE_RTOL (relative).

    python benchmarks/text_gpt.py [--steps 300] [--out /tmp/text_gpt] [--picture docs/text_gpt_loss.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FINAL_LOSS_BELOW = 2.4
CURVE_RTOL = 0.02
EVAL_EVERY = 50


def codegen_args(data: Path, build: Path, steps: int) -> list[str]:
    """The `meshplan codegen` arguments of the example (the README shows the same command)."""
    return ["codegen", "examples/models/gpt.py:build", "--arg", "preset=small", "--arg", "vocab_size=256",
            "--batch", "16", "--data", "2", "--pipeline", "2", "--micro-batch", "4",
            "--dataset", "examples/data/tokens.py:TokenFile",
            "--dataset-arg", f"path={data / 'corpus.bin'}", "--dataset-arg", "seq_len=64",
            "--eval-dataset-arg", f"path={data / 'corpus.val.bin'}", "--eval-dataset-arg", "seq_len=64",
            "--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.1",
            "--lr-schedule", "cosine", "--warmup-steps", "30", "--decay-steps", str(steps), "--min-lr", "3e-4",
            "--clip-grad", "1.0", "--eval-every", str(EVAL_EVERY), "--eval-batches", "4", "-o", str(build)]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def draw(picture: Path, run: list[dict], ref: list[float], steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in run], [r["loss"] for r in run], lw=1.4, label="meshplan, data 2 x pipeline 2")
    ax.plot(range(len(ref)), ref, lw=1.0, ls="--", color="black", label="single process (reference)")
    ev = [r for r in run if r.get("eval_loss") is not None]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o", color="tab:red",
                label="validation loss (meshplan)")
    ax.axhline(math.log(256), color="grey", lw=0.6, ls=":")
    ax.text(steps * 0.55, math.log(256) + 0.05, "uniform over 256 bytes", color="grey", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(f"Example GPT (0.8 M parameters) on examples/data/corpus.txt, {steps} steps")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    picture.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(picture)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="/tmp/meshplan_text_gpt", help="work directory (token files, build)")
    ap.add_argument("--picture", default=None, help="PNG of the loss curves (default OUT/text_gpt_loss.png)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    from examples.data import tokenize_text
    from planner.app.cli import main as meshplan
    from runtime.reference import reference_run
    from runtime.spec import TrainSpec

    out = Path(args.out).resolve()
    data, build, tb = out / "data", out / "build", out / "tensorboard"
    tokenize_text.main(["examples/data/corpus.txt", "-o", str(data / "corpus.bin"), "--val-fraction", "0.1"])
    if meshplan(codegen_args(data, build, args.steps)) != 0:
        return 1
    t0 = time.perf_counter()
    if meshplan(["run", str(build), "--steps", str(args.steps), "--tensorboard", str(tb), "--no-trace",
                 "--checkpoint-dir", str(out / "checkpoints"), "--save-every", "100"]) != 0:
        return 1
    run_seconds = time.perf_counter() - t0
    run = read_metrics(build / "metrics.jsonl")
    spec = TrainSpec.from_dict(json.loads((build / "build.json").read_text())["train"])
    t0 = time.perf_counter()
    ref = reference_run(spec, args.steps, micro_batch_size=4).losses
    ref_seconds = time.perf_counter() - t0
    losses = [r["loss"] for r in run]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    final = sum(losses[-20:]) / len(losses[-20:])
    picture = Path(args.picture) if args.picture else out / "text_gpt_loss.png"
    draw(picture, run, ref, args.steps)
    evals = [(r["step"], round(r["eval_loss"], 4)) for r in run if r.get("eval_loss") is not None]
    events = sorted(p.name for p in tb.rglob("events.out.tfevents.*")) if tb.is_dir() else []
    print(json.dumps({"steps": args.steps, "first_loss": losses[0], "final_loss_mean_last_20": final,
                      "reference_final_loss_mean_last_20": sum(ref[-20:]) / len(ref[-20:]),
                      "max_relative_step_loss_difference": worst, "eval_losses": evals,
                      "tensorboard_files": events, "parallel_run_seconds": round(run_seconds, 1),
                      "reference_seconds": round(ref_seconds, 1), "picture": str(picture)}, indent=1))
    ok = final < FINAL_LOSS_BELOW and worst <= CURVE_RTOL and len(losses) == args.steps and events
    if not ok:
        print(f"FAILED: final loss {final:.4f} (must be < {FINAL_LOSS_BELOW}), largest step difference "
              f"{worst:.3g} (must be <= {CURVE_RTOL}), {len(losses)} steps, TensorBoard files {events}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
