"""The launchers a build holds: launch_torchrun.sh, launch_mpirun.sh and launch_srun.sh, each starting the
build's entry script in every process (codegen/emit.py writes them; the torch target's build too). Several
nodes: the README's "Run on several nodes" says what each expects. The build's directory and entry
are quoted for the shell (shlex.quote); nothing a user gives becomes code.
"""

from __future__ import annotations

import shlex

from planner.plan import Plan
from runtime.vocab import DeviceKind

_SECRET = """# meshplan signs its failure messages and heartbeats with a job secret passed in the environment
# (never on a command line); one is made here unless MESHPLAN_JOB_SECRET is set.
export MESHPLAN_JOB_SECRET="${MESHPLAN_JOB_SECRET:-$("${PYTHON:-python3}" -c 'import secrets; print(secrets.token_hex(32))')}"
"""


def launch_scripts(plan: Plan, world: int, build_dir: str, entry: str = "run_rank.py") -> dict[str, str]:
    """launch_torchrun.sh, launch_mpirun.sh, launch_srun.sh: each starts `entry` (a file of the build) in
    every process. Several nodes: the README's "Run on several nodes" says what each expects."""
    nodes = plan.cluster.num_nodes
    per_node = max(1, min(world, plan.cluster.devices_per_node))
    gpu = plan.cluster.device.kind == DeviceKind.GPU if hasattr(plan.cluster.device, "kind") else False
    return {"launch_torchrun.sh": _torchrun(world, entry), "launch_mpirun.sh": _mpirun(world, entry),
            "launch_srun.sh": _srun(world, entry, build_dir, nodes, per_node, gpu)}


def _torchrun(world: int, entry: str) -> str:
    """torchrun on one node (its store on loopback), or on NNODES nodes after they meet (runtime.join)."""
    return f'''#!/usr/bin/env bash
# Start this build with torchrun: {world} processes.
#   ./launch_torchrun.sh --steps 10 [--backend gloo|nccl] [--timeout S] [--out DIR]
# One node by default. For N nodes run it on every node with NNODES=N, NODE_RANK (0 .. N-1; node 0
# holds rank 0 and hosts the rendezvous), MASTER_ADDR (node 0's address, reachable from every node),
# MASTER_PORT (default 29500) and the same MESHPLAN_JOB_SECRET; the build must be the same on every
# node (shared storage). The nodes first meet (python -m runtime.join: it checks the setup and says
# what it waits for, up to --timeout), then torchrun starts the ranks with a static rendezvous.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
WORLD_SIZE={world}
NNODES="${{NNODES:-1}}"
NPROC_PER_NODE="${{NPROC_PER_NODE:-$((WORLD_SIZE / NNODES))}}"
if [ "$NNODES" -gt 1 ]; then
  # Every node must sign with the same secret: set it on each (e.g. from a file only you can read).
  : "${{MESHPLAN_JOB_SECRET:?set the same MESHPLAN_JOB_SECRET on every node}}"
fi
{_SECRET}if [ "$NNODES" -eq 1 ]; then
  # torchrun with its rendezvous store on 127.0.0.1 only (--standalone's listen on every interface)
  exec "${{PYTHON:-python3}}" -m runtime.torchrun_local --nproc-per-node="$NPROC_PER_NODE" \\
    "$HERE/{entry}" "$@"
fi
: "${{NODE_RANK:?set NODE_RANK (0 .. NNODES-1; 0 on the node at MASTER_ADDR, which holds rank 0)}}"
: "${{MASTER_ADDR:?set MASTER_ADDR to the address of node 0}}"
MASTER_PORT="${{MASTER_PORT:-29500}}"
"${{PYTHON:-python3}}" -m runtime.join --build "$HERE" --nodes "$NNODES" --node-rank "$NODE_RANK" \\
  --nproc-per-node "$NPROC_PER_NODE" --master "$MASTER_ADDR:$MASTER_PORT" -- "$@"
exec "${{TORCHRUN:-torchrun}}" --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \\
  --rdzv-backend=static --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" "$HERE/{entry}" "$@"
'''


def _mpirun(world: int, entry: str) -> str:
    """mpirun with the mpi4py communicator; on one node in a loopback-only network namespace."""
    return f'''#!/usr/bin/env bash
# Start this build with mpirun and the mpi4py communicator: {world} processes.
#   ./launch_mpirun.sh --steps 10    (more mpirun options in MPIRUN_ARGS, e.g. "--hostfile hosts" or "--host a:4,b:4")
# On several nodes the build must be at the same path on every node (shared storage). The ranks
# run this node's Python (PYTHON, made an absolute path here) with this node's PATH, LD_LIBRARY_PATH,
# PYTHONPATH and VIRTUAL_ENV (and the network variables), forwarded by mpirun.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
PYTHON="$(command -v "${{PYTHON:-python3}}")"
{_SECRET}FORWARD=()
for v in PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV MESHPLAN_JOB_SECRET MASTER_ADDR MESHPLAN_STORE_BIND \\
         GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
  if [ -n "${{!v+x}}" ]; then FORWARD+=(-x "$v"); fi
done
if [ "$(id -u)" -eq 0 ]; then FORWARD+=(--allow-run-as-root); fi   # Open MPI refuses root without it
# One node unless MPIRUN_ARGS names hosts or a batch allocation spans nodes (MESHPLAN_MPI_LOCAL=0/1
# decides): then the ranks talk through shared memory and mpirun runs in a network namespace whose only
# interface is loopback (runtime/loopback_ns.py), so that nothing of the job listens beyond this node.
# Several nodes keep Open MPI's own choice of interfaces.
LOCAL="${{MESHPLAN_MPI_LOCAL:-1}}"
if [ -z "${{MESHPLAN_MPI_LOCAL:-}}" ]; then
  case " ${{MPIRUN_ARGS:-}} " in *" --host"*|*" -H "*|*" --hostfile"*|*" --machinefile"*|*" -hostfile"*) LOCAL=0;; esac
  [ "${{SLURM_JOB_NUM_NODES:-1}}" -le 1 ] && [ -z "${{PBS_NODEFILE:-}}" ] || LOCAL=0
fi
WRAP=()
MCA=()
if [ "$LOCAL" = 1 ]; then
  [ -n "${{OMPI_MCA_btl:-}}" ] || MCA=(--mca btl self,sm)
  if "$PYTHON" -m runtime.loopback_ns --check; then
    WRAP=("$PYTHON" -m runtime.loopback_ns --)
  else
    echo "launch_mpirun.sh: warning: mpirun will listen on every interface of this machine" >&2
  fi
fi
exec ${{WRAP[@]+"${{WRAP[@]}}"}} "${{MPIRUN:-mpirun}}" ${{MCA[@]+"${{MCA[@]}}"}} -n {world} ${{MPIRUN_ARGS:-}} \\
  -x OMP_NUM_THREADS="${{OMP_NUM_THREADS:-1}}" "${{FORWARD[@]}}" "$PYTHON" "$HERE/{entry}" --backend mpi "$@"
'''


def _srun(world: int, entry: str, build_dir: str, nodes: int, per_node: int, gpu: bool) -> str:
    """An sbatch script running the ranks under srun on `nodes` nodes of `per_node` processes."""
    return f'''#!/usr/bin/env bash
#SBATCH --job-name=meshplan
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={per_node}
{"#SBATCH --gpus-per-task=1" if gpu else "#SBATCH --cpus-per-task=1"}
# Submit with `sbatch launch_srun.sh --steps 10`, or run it inside an allocation (salloc).
# {world} processes: {nodes} node(s) x {per_node} (the plan's; MESHPLAN_NODES=1 runs them all on one node).
# The build must be on storage every node mounts: sbatch runs a copy of this file, so the build is
# found as MESHPLAN_BUILD, else the directory it was written to, else the directory you submitted from.
set -euo pipefail
WORLD_SIZE={world}
ENTRY={shlex.quote(entry)}
HERE=""
for d in "${{MESHPLAN_BUILD:-}}" {shlex.quote(build_dir)} "${{SLURM_SUBMIT_DIR:-}}" "$(dirname "${{BASH_SOURCE[0]}}")"; do
  if [ -n "$d" ] && [ -f "$d/$ENTRY" ] && [ -f "$d/build.json" ]; then HERE="$(cd "$d" && pwd)"; break; fi
done
if [ -z "$HERE" ]; then
  echo "meshplan: error: the build is not at MESHPLAN_BUILD," {shlex.quote(build_dir)} "or the submit directory" \\
    "on $(hostname): set MESHPLAN_BUILD to the build directory on shared storage" >&2
  exit 2
fi
NNODES="${{MESHPLAN_NODES:-{nodes}}}"
if [ $((WORLD_SIZE % NNODES)) -ne 0 ]; then
  echo "meshplan: error: $NNODES nodes cannot hold $WORLD_SIZE processes evenly" >&2; exit 2
fi
if [ "${{SLURM_JOB_NUM_NODES:-$NNODES}}" -lt "$NNODES" ]; then
  echo "meshplan: error: the plan runs on $NNODES nodes, the allocation has $SLURM_JOB_NUM_NODES:" \\
    "sbatch --nodes=$NNODES launch_srun.sh" >&2; exit 2
fi
export PYTHON="$(command -v "${{PYTHON:-python3}}")"
export MASTER_ADDR="${{MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}}"
# one port per job, so that two jobs sharing a node do not collide
export MASTER_PORT="${{MASTER_PORT:-$((20000 + ${{SLURM_JOB_ID:-0}} % 20000))}}"
export WORLD_SIZE
{_SECRET}exec srun --nodes="$NNODES" --ntasks="$WORLD_SIZE" --ntasks-per-node="$((WORLD_SIZE / NNODES))" bash -c \\
  \'if [ ! -f "$0/$1" ]; then echo "meshplan rank $SLURM_PROCID: error: the build $0 is not on node $(hostname)" \\
  "(SLURM_NODEID=$SLURM_NODEID): put it on storage every node mounts, or set MESHPLAN_BUILD" >&2; exit 2; fi
  script="$0/$1"; shift
  RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID exec "$PYTHON" "$script" --backend "${{BACKEND:-{"nccl" if gpu else "gloo"}}}" "$@"\' \\
  "$HERE" "$ENTRY" "$@"
'''


__all__ = ["launch_scripts"]
