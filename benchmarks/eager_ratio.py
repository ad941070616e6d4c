"""meshplan's runtime at world size 1 against the loop a user would write: eager, and torch.compile(model).

One process trains three copies of the same model (same initial weights, same batches from the same
data factory, fused AdamW, bf16 autocast on CUDA unless --dtype says otherwise):

  eager     the plain loop: batch to the device, forward under autocast, F.cross_entropy on the logits,
            backward, optimizer step, zero_grad(set_to_none=True), loss.item();
  compiled  the same loop around torch.compile(model) (the whole model);
  meshplan  the generated build of the same model at data 1 (one micro-batch per step), run in this
            process through runtime.rank_main (Executor.run_step: batch, forward, loss, backward,
            gradient step, one host sync), with the execution options given (default: compiled
            stages, the vocabulary padded to a multiple of 64, the compiled loss on CUDA).

After warm-up steps (compilation) the variants run in alternating rounds of --steps steps (the order
rotates every round), so the machine's drifting load hits all alike. Printed: each variant's median
step time (every step ends with a device sync), the ratios (of the medians, and the median over the
rounds of each round's ratio: the steadier figure on a shared machine), and on CUDA each one's peak memory:
torch.cuda.max_memory_allocated during its rounds, less what the process held when its round began,
plus its own resident state (parameters, gradients, optimizer state; what a process training only it
would hold between steps).

    python benchmarks/eager_ratio.py --device cpu --model gpt --preset small --batch 16
    python benchmarks/eager_ratio.py --device cuda --model gpt --arg vocab_size=50304 --arg seq_len=1024 \\
        --arg hidden=768 --arg num_layers=12 --arg num_heads=12 --batch 16     (H100.md's case)
    python benchmarks/eager_ratio.py --device cuda --model hf-gpt2 --preset gpt2 --arg seq_len=1024 --batch 16
    python benchmarks/eager_ratio.py --device cuda --quick      (both of the above, few steps: 2-3 minutes)

Options --compile/--no-compile, --compile-scope blocks|stage, --loss-impl full|compiled|chunked,
--loss-chunk-tokens N and --vocab-multiple N set meshplan's execution (codegen's flags); --clip-grad X
clips in every variant alike (the loops with clip_grad_norm_); --no-grad-norm makes meshplan's build
without the per-step reported norm; --count-copies profiles one step of each variant and prints its copy
kernels (aten::copy_ and aten::_to_copy calls). Needs only the repository (PYTHONPATH at the checkout)
and torch (and transformers for hf-gpt2).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import runpy
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODELS = {"gpt": str(ROOT / "examples/models/gpt.py") + ":build",
          "hf-gpt2": str(ROOT / "examples/models/hf.py") + ":build"}
H100_GPT = {"vocab_size": 50304, "seq_len": 1024, "hidden": 768, "num_layers": 12, "num_heads": 12}
VARIANTS = ("eager", "compiled", "meshplan")


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def model_kwargs(model: str, preset: str | None, args: list[str]) -> dict:
    kw = {k: _value(v) for k, v in (a.split("=", 1) for a in args)}
    if model == "hf-gpt2":
        kw = {"arch": "gpt2", "preset": preset or "small", **kw}
    elif preset:
        kw = {"preset": preset, **kw}
    return kw


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _execution(args):
    """meshplan's Execution from the flags (None on a checkout that predates execution options)."""
    try:
        from runtime.execution import Execution
    except ImportError:
        return None
    scope = {"compile_scope": args.compile_scope} if args.compile_scope != "blocks" else {}   # older trees lack it
    return Execution(compile=args.compile, loss=args.loss_impl, loss_chunk_tokens=args.loss_chunk_tokens,
                     vocab_multiple=args.vocab_multiple, **scope)


def make_build(model_ref: str, kw: dict, batch: int, dtype: str, out: Path, execution,
               clip_grad: float | None = None, grad_norm: bool = True) -> Path:
    """The build of the model at data 1, one micro-batch of `batch` per step, fused AdamW (gradients clipped to
    a global norm of `clip_grad` where given; the norm reported every step unless `grad_norm` is False)."""
    import planner
    from codegen.emit import capture_ref, emit
    from planner.app.commands import make_fixed_plan

    cfg = planner.ParallelConfig(micro_batch_size=batch, dtype=dtype)
    graph = capture_ref(model_ref, kw, batch_size=batch)
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=1), cfg, batch)
    extra = {"execution": execution} if execution is not None and "execution" in inspect.signature(emit).parameters \
        else {}
    opt = {"name": "adamw", "lr": 1e-4, "weight_decay": 0.1, "impl": "fused"}
    if clip_grad is not None:
        extra["clip_grad"] = clip_grad
    if not grad_norm:
        extra["grad_norm"] = False
    return emit(plan, model_ref, None, out, model_kwargs=kw, graph=graph, optimizer=opt, **extra).path


class Meshplan:
    """The build's rank 0, connected in this process (world size 1)."""

    def __init__(self, build: Path, device: torch.device):
        from runtime import rank_main

        ns = runpy.run_path(str(build / "rank_0000.py"), run_name="eager_ratio")
        stages = {s: (ns[f"Stage{s}"], d) for s, d in ns["STAGE_SPECS"].items()}
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.session = rank_main.connect(rank_main.prepare(
            rank=0, program=ns["PROGRAM"], stages=stages, train=ns["TRAIN"], signature=ns["SIGNATURE"],
            argv=["--backend", backend, "--master-port", str(_free_port()), "--timeout", "600", "--no-trace",
                  "--no-progress"], build_dir=str(build)))
        self.ex = self.session.executor
        self._two = len(inspect.signature(self.ex.run_step).parameters) > 1
        self.modules = list(self.session.prepared.modules.values())

    def step(self, step: int, last: bool = False) -> float:
        """One training step; unless `last` (of a round) the next step's batch is prefetched (CUDA)."""
        if not self._two:
            return self.ex.run_step(step).loss
        return self.ex.run_step(step, None if last else step + 1).loss

    def resident(self) -> list[torch.Tensor]:
        out = [p for m in self.modules for p in m.parameters()]
        out += [p.grad for p in out if p.grad is not None]
        if self.session.grads is not None:
            out += [st.grad_flat for st in self.session.grads.states]
        return out + _state_tensors(self.ex.optimizer)

    def close(self) -> None:
        self.session.close()


def _state_tensors(opt) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)] if opt else []


class Loop:
    """The loop a user writes around `model` (compiled: torch.compile(model))."""

    def __init__(self, train, device: torch.device, compiled: bool):
        from runtime.materialize import build_model, load_factory

        self.clip = train.clip_grad   # clip_grad_norm_ before the step, as the build does (None: no clipping)
        self.model = build_model(train).to(device)
        self.model.train()
        self.run = torch.compile(self.model) if compiled else self.model
        params = list(self.model.parameters())   # weight decay as meshplan's default groups: not on 1-d tensors
        self.opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                     lr=1e-4, fused=True)
        self.data = load_factory(train.data_ref, train.root, "data")
        self.train, self.device = train, device
        self.cast = contextlib.nullcontext() if train.dtype == "fp32" else \
            torch.autocast(device.type, dtype=torch.bfloat16 if train.dtype == "bf16" else torch.float16)

    def step(self, step: int, last: bool = False) -> float:
        inputs, y = self.data(self.train.global_batch_size, self.train.data_seed + step, **self.train.data_kwargs)
        y = y.to(self.device)
        with self.cast:
            if isinstance(inputs, dict):
                out = self.run(**{k: v.to(self.device) for k, v in inputs.items()})
                logits = out["logits"] if isinstance(out, dict) else out[0]
            else:
                logits = self.run(*(x.to(self.device) for x in inputs))
            loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def resident(self) -> list[torch.Tensor]:
        out = list(self.model.parameters())
        return out + [p.grad for p in out if p.grad is not None] + _state_tensors(self.opt)


def _bytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_copies(runner, step: int) -> dict[str, int]:
    """Calls of aten::copy_ and aten::_to_copy in one step of `runner` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        runner.step(step)
    counts = {e.key: e.count for e in prof.key_averages()}
    return {k: counts.get(k, 0) for k in ("aten::copy_", "aten::_to_copy")}


def measure(model: str, kw: dict, args, device: torch.device) -> dict:
    """Warm-up, then alternating rounds; each variant's step times and (CUDA) peak memory."""
    from runtime.spec import TrainSpec

    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        build = make_build(MODELS[model], kw, args.batch, dtype, Path(tmp) / "build", _execution(args),
                           args.clip_grad, args.grad_norm)
        train = TrainSpec.from_dict(json.loads((build / "build.json").read_text())["train"])
        runners = {"eager": Loop(train, device, False), "compiled": Loop(train, device, True),
                   "meshplan": Meshplan(build, device)}
        warm = {}
        for name, r in runners.items():   # compilation happens here
            t = time.perf_counter()
            for s in range(args.warmup):
                r.step(s)
            _sync(device)
            warm[name] = time.perf_counter() - t
        times = {name: [] for name in runners}
        peak = {name: 0 for name in runners}
        step = args.warmup
        for k in range(args.rounds):
            order = VARIANTS[k % 3:] + VARIANTS[:k % 3]
            for name in order:
                r = runners[name]
                if device.type == "cuda":
                    _sync(device)
                    base = torch.cuda.memory_allocated(device)
                    own = _bytes(r.resident())
                    torch.cuda.reset_peak_memory_stats(device)
                for s in range(args.steps):
                    t = time.perf_counter()
                    r.step(step + s, last=s == args.steps - 1)
                    _sync(device)
                    times[name].append(time.perf_counter() - t)
                if device.type == "cuda":
                    peak[name] = max(peak[name], torch.cuda.max_memory_allocated(device) - base + own)
            step += args.steps
        copies = {name: count_copies(r, step) for name, r in runners.items()} if args.count_copies else None
        runners["meshplan"].close()
        info = json.loads((build / "build.json").read_text())["train"].get("execution")
    return {"model": model, "kwargs": kw, "times": times, "peak": peak, "warmup_s": warm, "copies": copies,
            "execution": info, "dtype": dtype, "setup_s": time.perf_counter() - t0}


def round_ratios(times: dict[str, list[float]], steps: int, a: str, b: str) -> list[float]:
    """Per round: a's median step over b's, the two measured minutes apart at most (the machine's load
    drifts less within a round than over the run)."""
    out = []
    for k in range(len(times[a]) // steps):
        ra, rb = times[a][k * steps:(k + 1) * steps], times[b][k * steps:(k + 1) * steps]
        out.append(statistics.median(ra) / statistics.median(rb))
    return out


def report(res: dict, args, device: torch.device) -> None:
    med = {n: statistics.median(v) for n, v in res["times"].items()}
    paired = {(a, b): statistics.median(round_ratios(res["times"], args.steps, a, b))
              for a, b in (("meshplan", "eager"), ("meshplan", "compiled"), ("compiled", "eager"))}
    ex = res["execution"] or {}
    opts = ", ".join(f"{k}={v}" for k, v in ex.items()) if ex else "this checkout's defaults"
    clip = f", gradients clipped to norm {args.clip_grad:g}" if args.clip_grad is not None else ""
    print(f"\n{res['model']} {res['kwargs']}: batch {args.batch}, {res['dtype']}, fused AdamW{clip}, {device}; "
          f"{args.rounds} alternating rounds of {args.steps} steps after {args.warmup} warm-up steps")
    print(f"  meshplan execution: {opts}")
    for n in VARIANTS:
        mem = f"   peak {res['peak'][n] / 2**20:9,.0f} MiB" if device.type == "cuda" else ""
        cp = f"   copies/step {res['copies'][n]}" if res["copies"] else ""
        print(f"  {n:<9} median step {med[n] * 1e3:9.2f} ms   warm-up {res['warmup_s'][n]:7.1f} s{mem}{cp}")
    for a, b in paired:
        print(f"  {a} / {b}: {med[a] / med[b]:.3f} of the medians, {paired[(a, b)]:.3f} the median of the "
              f"{args.rounds} rounds' ratios")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({**res, "median": med, "device": str(device),
                                "round_ratio": {f"{a}/{b}": v for (a, b), v in paired.items()}}) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    ap.add_argument("--preset", default=None, help="the model's preset (gpt: small; hf-gpt2: small)")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="model factory keyword")
    ap.add_argument("--batch", type=int, default=16, help="samples per step (one micro-batch)")
    ap.add_argument("--steps", type=int, default=5, help="steps per variant and round")
    ap.add_argument("--rounds", type=int, default=12, help="alternating rounds")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (compilation)")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                    help="autocast dtype (default bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="meshplan: compiled stages (default on)")
    ap.add_argument("--compile-scope", choices=("blocks", "stage"), default="blocks",
                    help="meshplan, with --compile: the repeated blocks (default) or each stage's whole forward")
    ap.add_argument("--loss-impl", choices=("full", "compiled", "chunked"), default=None,
                    help="meshplan: the last stage's loss (default: compiled on CUDA, the planner's choice for "
                         "H100.md's case: no fp32 copy of the logits, fused passes; full on CPU, where a compiled "
                         "call costs more than it fuses for a small vocabulary)")
    ap.add_argument("--loss-chunk-tokens", type=int, default=0, help="meshplan: tokens per loss chunk (0: auto)")
    ap.add_argument("--vocab-multiple", type=int, default=64, help="meshplan: pad the vocabulary (default 64)")
    ap.add_argument("--clip-grad", type=float, default=None,
                    help="every variant clips the gradients to this global norm (the loops with clip_grad_norm_, "
                         "meshplan's build with clip_grad); default: none clips")
    ap.add_argument("--no-grad-norm", dest="grad_norm", action="store_false",
                    help="meshplan: a build made with --no-grad-norm (no norm computed where nothing clips), as the "
                         "loops compute none; default: the norm reported every step, as meshplan's builds do")
    ap.add_argument("--count-copies", action="store_true", help="profile one step of each: its copy kernels")
    ap.add_argument("--quick", action="store_true",
                    help="H100.md's GPT case and HF GPT-2 (gpt2 preset, 1024 tokens), 2 rounds of 5 steps each")
    ap.add_argument("--json", default=None, help="append each model's results to this JSON-lines file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    args.loss_impl = args.loss_impl or ("compiled" if device.type == "cuda" else "full")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here")
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    if args.quick:
        args.steps, args.rounds, args.warmup = 5, 2, 3
        cases = [("gpt", model_kwargs("gpt", None, [f"{k}={v}" for k, v in H100_GPT.items()])),
                 ("hf-gpt2", model_kwargs("hf-gpt2", "gpt2", ["seq_len=1024"]))]
    else:
        preset = args.preset or ("small" if args.model == "gpt" and not args.arg else None)
        cases = [(args.model, model_kwargs(args.model, preset, args.arg))]
    for model, kw in cases:
        report(measure(model, kw, args, device), args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
