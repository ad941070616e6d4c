#!/usr/bin/env bash
# Everything this project checks on a lent GPU, in one call (a lent machine gives a session minutes,
# not hours): the GPU calibration, a model of our own predicted against measured (with the dgx-h100
# preset and with the calibration), the H100.md case under today's runtime, meshplan's runtime against
# the eager and compiled loops, and the gpu test tier. Each part has its own time limit, writes its log
# under OUT_DIR and prints its tail, so one part's failure leaves the others' figures.
#
#   benchmarks/gpu_session.sh WHEELS_DIR OUT_DIR
#
# OUT_DIR gets session.log (every step's whole output), calibrated.yaml and ops_quick.csv.
# WHEELS_DIR: the wheels the GPU machine lacks (see tests/gpu/run_on_gpu_machine.sh for the pip download
# line); the checkout goes first on PYTHONPATH, nothing is installed into the machine's Python.
# DRY_RUN=1 runs the same steps on this CPU at toy sizes (gloo, the CPU calibration skipped), to check the
# script before spending GPU time on it.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -eq 2 ] || { echo "usage: $0 WHEELS_DIR OUT_DIR" >&2; exit 2; }
wheels=$1
out=$(mkdir -p "$2" && cd "$2" && pwd)
py=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/meshplan-gpu-session.XXXXXX")
trap 'rm -rf "$work"' EXIT
dry=${DRY_RUN:-0}
deadline=$((SECONDS + ${DEADLINE:-560}))   # the whole session's seconds: a step gets what is left, at most its own limit

if [ "$dry" != 1 ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "$wheels"/*.whl \
    || { echo "installing the wheels from $wheels failed" >&2; exit 2; }
fi
export PYTHONPATH="$here:$work/site${PYTHONPATH:+:$PYTHONPATH}"
export MESHPLAN_CACHE_DIR="$work/cache" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
cd "$here"
mp() { "$py" -m planner.app.cli "$@"; }
export -f mp
export py

step() {   # step NAME SECONDS COMMAND...: run it under a limit, its output in OUT/NAME.log, its tail printed
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return;; esac   # ONLY="a b": run just those steps
  local left=$((deadline - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then echo "=== $name: skipped, the session's time is spent"; return; fi
  echo "=== $name (limit ${limit} s)"
  # through bash, so the exported shell functions (mp, model_check) run too
  timeout -k 10 "$limit" bash -c '"$@"' _ "$@" >"$work/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  # the whole log into one file that comes back even when the session is cut short (few files return)
  { echo "=== $name: exit $rc after $((SECONDS - t0)) s"; cat "$work/$name.log"; } >>"$out/session.log"
  tail -n "${TAIL:-30}" "$work/$name.log"
}

if [ "$dry" = 1 ]; then
  backend=gloo; cluster_args=(--cluster local --devices 1); steps=4
  ours=(--arg preset=tiny); ours_batch=4
  h100=(--arg preset=tiny); h100_batch=4
  ratio=(--device cpu --model gpt --preset tiny --batch 4 --steps 2 --rounds 2)
  ratio_case=("${ratio[@]}")
else
  backend=nccl; steps=12
  ours=(--arg vocab_size=32768 --arg seq_len=1024 --arg hidden=1024 --arg num_layers=8 --arg num_heads=16)
  ours_batch=8
  h100=(--arg vocab_size=50304 --arg seq_len=1024 --arg hidden=768 --arg num_layers=12 --arg num_heads=12)
  h100_batch=16
  ratio=(--device cuda --quick)
  ratio_case=(--device cuda --model gpt --arg vocab_size=50304 --arg seq_len=1024 --arg hidden=768 --arg num_layers=12
              --arg num_heads=12 --batch 16)
fi

step env 60 "$py" -c '
import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}")
import ortools, planner  # the carried wheels and the checkout import
print("ortools", ortools.__version__)
'


# 1. the GPU calibration: the op table with CUDA events, the constants fit to it (issue 29, quick: < 2 min)
if [ "$dry" = 1 ]; then
  mp cluster dgx-h100 --devices 1 -o "$out/calibrated.yaml" --force >/dev/null
else
  step calibrate 120 mp calibrate --device cuda --quick --out "$out/calibrated.yaml" --op-table "$out/ops_quick.csv"
fi

# 2. a model of our own (not the H100.md case), eager with the full loss, predicted against measured on the
#    dgx-h100 preset and on the calibration (time per instruction on the device clock, peak allocated memory)
model_check() {   # model_check NAME BATCH CODEGEN-ARGS...
  local name=$1 batch=$2
  shift 2
  if [ "$dry" = 1 ]; then cp "$out/calibrated.yaml" "$work/h1.yaml"; else mp cluster dgx-h100 --devices 1 -o "$work/h1.yaml" --force; fi \
  && mp codegen examples/models/gpt.py:build "$@" --batch "$batch" --micro-batch "$batch" --dtype bf16 \
       --optimizer adamw --lr 3e-4 --cluster "$work/h1.yaml" -o "$work/$name" \
  && mp run "$work/$name" --backend "$backend" --steps "$steps" --track-memory --no-progress \
  && cat "$work/$name/metrics.jsonl" \
  && mp compare "$work/$name" --cluster "$work/h1.yaml" --no-pictures \
  && { [ ! -f "$out/calibrated.yaml" ] || mp compare "$work/$name" --cluster "$out/calibrated.yaml" --no-pictures; }
}
export -f model_check
export out work dry backend steps
step ours 100 model_check ours "$ours_batch" "${ours[@]}" --no-compile --loss-impl full
# 3. the H100.md case under today's runtime, eager with the full loss (as H100.md measured it), then with the
#    execution options the planner chooses for it (compiled stages and the compiled loss: not yet measured)
step h100_eager 90 model_check h100_eager "$h100_batch" "${h100[@]}" --no-compile --loss-impl full
step h100_planned 120 model_check h100_planned "$h100_batch" "${h100[@]}"

# 4. meshplan's runtime against the eager loop and torch.compile(model) (issue 30)
step eager_ratio 230 "$py" benchmarks/eager_ratio.py "${ratio[@]}"

# 5. the gpu test tier (skipped by name on a CPU); its quick calibration is step 1's, through the same code
step tier 200 "$py" -m pytest tests/gpu -q -p no:cacheprovider -rs --deselect tests/gpu/test_gpu_calibrate.py

# 6. the loss alone over the H100.md case's logits: full, compiled and chunked, time and peak memory
loss_args=(--device cuda --tokens 16384 --vocab 50304 --hidden 768)
[ "$dry" = 1 ] && loss_args=(--tokens 256 --vocab 1000 --hidden 64)
step loss_kernels 90 "$py" benchmarks/chunked_loss.py "${loss_args[@]}" --dtypes bf16 --rounds 3
# 7. meshplan on the H100.md case with compiled stages and the full loss, against the two loops
step ratio_full 150 "$py" benchmarks/eager_ratio.py "${ratio_case[@]}" --loss-impl full
# 8. the same with each stage's whole forward compiled (--compile-scope stage) and the compiled loss: the last
#    stage's forward and loss as one graph, against the two loops
step ratio_stage 150 "$py" benchmarks/eager_ratio.py "${ratio_case[@]}" --loss-impl compiled --compile-scope stage
echo "=== logs in $out"
