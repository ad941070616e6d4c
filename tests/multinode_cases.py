"""Two nodes on one host, over loopback: what tests/distributed/test_multinode.py, tests/mpi and
benchmarks/multinode.py share.

A simulated node is a launch script started in a process session of its own with the
environment a real node would have (NNODES, NODE_RANK, MASTER_ADDR=127.0.0.1, ...); losing the
node is SIGKILLing that whole session. `SRUN` and `SCONTROL` stand in for Slurm's commands (srun
starts the step's tasks with the SLURM_* variables of the nodes asked for), `FAKE_SSH` for ssh
under mpirun (it runs the remote command here, in an environment as bare as a fresh login's).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_CLEAN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MESHPLAN_JOB_SECRET",
          "NNODES", "NODE_RANK", "NPROC_PER_NODE", "MESHPLAN_BUILD", "MESHPLAN_LAUNCHER_PID")


def emit_nodes(out: Path, nodes: int = 2) -> Path:
    """The MLP at data 2 x pipeline 2 (4 ranks), planned for `nodes` nodes of 4 // nodes CPU devices."""
    import planner
    from codegen.emit import emit
    from planner.app.commands import make_fixed_plan
    from tests.parallel_cases import MODELS, SGD, graph_of

    cluster = dataclasses.replace(planner.Cluster.preset("local", devices=4 // nodes), num_nodes=nodes)
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", data=2, pipeline=2)
    plan = make_fixed_plan(graph_of("mlp"), cluster, cfg, 8)
    ref, kw = MODELS["mlp"]
    return emit(plan, ref, None, out, model_kwargs=kw, graph=graph_of("mlp"), optimizer=SGD, bucket_bytes=2048).path


def free_port(lo: int | None = None, hi: int | None = None) -> int:
    """A free TCP port on loopback (in [lo, hi) when given)."""
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 0 if lo is None else int.from_bytes(os.urandom(2), "big") % (hi - lo) + lo))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def base_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CLEAN}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, GLOO_SOCKET_IFNAME="lo",
               TORCHRUN=str(Path(sys.executable).parent / "torchrun"), **extra)
    return env


class Node:
    """One simulated node: `cmd` in a session of its own, its output in `log`."""

    def __init__(self, cmd: list[str], env: dict, log: Path, name: str, cwd: str | os.PathLike | None = None):
        self.name = name
        self.log = log
        self._f = log.open("w")
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self._f, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.exited_at: float | None = None

    @classmethod
    def torchrun(cls, build: Path, node: int, port: int, args: list[str], log: Path, *, nodes: int = 2,
                 secret: str = "s" * 64, **env: str) -> "Node":
        e = base_env(NNODES=str(nodes), NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     MESHPLAN_JOB_SECRET=secret, **env)
        return cls(["bash", str(build / "launch_torchrun.sh"), *args], e, log, f"node{node}")

    def poll(self) -> bool:
        if self.exited_at is None and self.proc.poll() is not None:
            self.exited_at = time.monotonic()
        return self.exited_at is not None

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.poll()
        return self.proc.returncode

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> list[int]:
        return session_pids(self.proc.pid)

    def kill_all(self) -> None:
        """SIGKILL the node's whole session (its launcher and everything it started): the node is lost."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.poll()

    def close(self) -> None:
        self.kill_all()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._f.close()


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (a node's launcher and what it started)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def wait_for_lines(path: Path, n: int, timeout: float, nodes: list[Node]) -> bool:
    """Until `path` has n lines (True), a node exits or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return True
        if any(nd.poll() for nd in nodes):
            return False
        time.sleep(0.1)
    return False


def first_line(text: str, pattern: str) -> str | None:
    """The first line of `text` matching `pattern` (not a traceback's)."""
    for line in text.splitlines():
        if re.search(pattern, line) and not line.lstrip().startswith(("File ", "Traceback")):
            return line.strip()
    return None


# srun: `srun --nodes N --ntasks T --ntasks-per-node K CMD...` starts T tasks of CMD here, with the
# variables Slurm gives the tasks of N nodes (task i on node i // K), and logs the rendezvous address and
# the shape to srun.log beside it; exits with the first failure.
SRUN = r'''#!@PYTHON@
import os, subprocess, sys
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
nodes, ntasks, per = int(opts["nodes"]), int(opts["ntasks"]), int(opts["ntasks-per-node"])
assert nodes * per == ntasks, opts
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "srun.log"), "a") as log:
    log.write(f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} nodes={nodes} tasks={ntasks}\n")
env = dict(os.environ, SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES=str(nodes), SLURM_NTASKS=str(ntasks),
           SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEP_TASKS_PER_NODE=f"{per}(x{nodes})")
procs = [subprocess.Popen(args, env=dict(env, SLURM_PROCID=str(i), SLURM_LOCALID=str(i % per),
                                         SLURM_NODEID=str(i // per))) for i in range(ntasks)]
codes = [p.wait() for p in procs]
sys.exit(next((c for c in codes if c), 0))
'''

SCONTROL = '''#!/bin/sh
# `scontrol show hostnames LIST`: the nodes of the simulated allocation, all this host
echo 127.0.0.1
echo 127.0.0.1
'''

# ssh for mpirun's remote daemons: the command runs here, in a bare environment (no virtualenv on PATH),
# as on a node where one logs in afresh; every call is logged.
# Each simulated node's daemon gets a TMPDIR of its own (@TMP@/<host>), as separate hosts have: Open MPI
# keeps its session directory and PMIx's rendezvous sockets there, and two daemons (or another test's
# mpirun) sharing /tmp on one host can collide ("The PMIx server's listener thread failed to start").
# So do the shared-memory transport's segments: Open MPI names them after the host name, the job and the
# rank's place on its node, in /dev/shm by default, so both simulated nodes' first ranks (one host name)
# mapped one segment and crashed in mca_btl_sm_poll_handle_frag, about one run in ten. Each node's daemon
# keeps them in its own TMPDIR instead (its ranks inherit the setting).
FAKE_SSH = '''#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
host="$1"; shift
echo "ssh $host: $*" >> "$(dirname "$0")/ssh.log"
tmp="@TMP@/$host"; mkdir -p "$tmp"
exec env -i HOME="$HOME" PATH=/usr/bin:/bin TMPDIR="$tmp" OMPI_MCA_btl_sm_backing_directory="$tmp" bash -c "$*"
'''


def write_tools(bin_dir: Path, tmp_root: Path | None = None) -> Path:
    """srun, scontrol and ssh stand-ins in bin_dir (see above). tmp_root: where the ssh stand-in puts each
    node's TMPDIR (default bin_dir/tmp; keep it short: Unix socket paths hold at most 107 bytes)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    tmp_root = tmp_root or bin_dir / "tmp"
    for name, text in (("srun", SRUN.replace("@PYTHON@", sys.executable)), ("scontrol", SCONTROL),
                       ("ssh", FAKE_SSH.replace("@TMP@", str(tmp_root)))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir
