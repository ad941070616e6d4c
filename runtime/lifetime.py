"""Rank processes live no longer than their launcher, whatever ends it.

Three mechanisms, from strongest to most portable:

* Parent-death signal (Linux): a rank started by a launcher asks the kernel
  for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), so even a
  SIGKILLed `meshplan run`, torchrun agent or mpiexec takes its ranks along.
  `meshplan run` sets it for its children before they run (mpiexec included);
  a rank script sets it for itself when a known launcher started it (torchrun,
  mpirun/mpiexec, srun, `meshplan run`). A rank started by hand from a shell
  does not: closing the shell must not end a run started with nohup.
* Forwarding (`Children`): `meshplan run` starts its ranks in a session of
  their own and, when it is told to stop (SIGTERM, SIGINT, SIGHUP) or fails,
  sends them the same signal, waits `stop_grace` seconds, then SIGKILLs what is
  left. Nothing outlives it.
* The store (runtime/launch/watchdog.py): a rank whose rendezvous store stops
  answering for the heartbeat timeout stops (the store's host is gone).

torchrun, srun and mpirun have their own: torchrun's agent SIGTERMs its
workers when it is stopped and hosts their store; slurmstepd kills a step's
tasks when the job ends or is cancelled; mpirun forwards SIGTERM and SIGINT to
every rank and kills the job when one rank exits with an error.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

LAUNCHER_PID_ENV = "MESHPLAN_LAUNCHER_PID"
HEARTBEAT_STORE_ENV = "MESHPLAN_HEARTBEAT_STORE"   # host:port of a store for heartbeats (MPI runs)
# Set by launchers that start rank processes: ours, torchrun, Open MPI / PMIx, Slurm.
_LAUNCHER_VARS = (LAUNCHER_PID_ENV, "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                  "SLURM_STEP_ID")
_PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher(environ: dict | None = None) -> None:
    """In a rank process started by a launcher: end with it (parent-death signal), and end now if
    it is already gone (it died between starting this process and this call)."""
    env = os.environ if environ is None else environ
    if not any(k in env for k in _LAUNCHER_VARS):
        return
    set_parent_death_signal()
    expected = env.get(LAUNCHER_PID_ENV, "")
    if expected.isdigit() and os.getppid() != int(expected):
        print(f"meshplan: the launcher (process {expected}) is gone; stopping", file=sys.stderr, flush=True)
        os._exit(1)


def _child_setup(parent: int) -> None:
    """preexec_fn of a launcher's child: parent-death signal, and no orphan start."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def process_state(pid: int) -> str | None:
    """'stopped', 'zombie', 'running' (any other live state) or None (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return {"T": "stopped", "t": "stopped", "Z": "zombie"}.get(state, "running")


class Terminated(BaseException):
    """A rank was told to stop (SIGTERM): raised by its handler (`raise_on_terminate`) so that the file
    it was writing is removed on the way out (runtime/files.py), then `die_of` ends it with the signal.
    A BaseException: no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum, _frame):
    raise Terminated(signum)


def raise_on_terminate() -> None:
    """In a rank process (main thread only): SIGTERM raises Terminated instead of ending it on the spot."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def die_of(signum: int, note: str = "") -> None:
    """Print `note` (if it can: the launcher reading our output may be gone), then end this process by
    `signum`'s default action at once (no exit handlers, such as MPI_Finalize waiting for a dead
    mpiexec), so that its exit status still says which signal."""
    for stream, text in ((sys.stderr, note + "\n" if note else ""), (sys.stdout, "")):
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(1.0)   # delivered at once; this is only in case the signal is blocked
    os._exit(128 + signum)


class Interrupted(Exception):
    """The launcher was told to stop by a signal (`signum`)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class Children:
    """A launcher's child processes, stopped whatever way the launcher ends.

    Use as a context manager around starting and waiting for them: inside it, SIGTERM, SIGINT
    and SIGHUP raise `Interrupted` in the launcher (main thread only; elsewhere the handlers are
    left as they are), and on leaving it every child still running gets the signal that stopped
    the launcher (SIGTERM otherwise), then SIGKILL after `stop_grace` seconds.
    """

    stop_grace: float = 5.0
    procs: list[subprocess.Popen] = field(default_factory=list)
    _old: dict = field(default_factory=dict)
    _signum: int = signal.SIGTERM

    def popen(self, cmd: list[str], *, direct: bool = True, **kw) -> subprocess.Popen:
        """Start a child. `direct`: it is a rank (it checks that its parent is this launcher);
        otherwise a launcher of ranks, such as mpiexec, whose ranks have another parent."""
        env = dict(kw.pop("env", None) or os.environ)
        env.pop(LAUNCHER_PID_ENV, None)
        if direct:
            env[LAUNCHER_PID_ENV] = str(os.getpid())
        p = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_preexec(os.getpid()), **kw)
        self.procs.append(p)
        return p

    def __enter__(self) -> "Children":
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED:
                self._old[sig] = signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, _frame):
        self._signum = signum
        raise Interrupted(signum)

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        self.stop(self._signum if isinstance(exc, Interrupted) else signal.SIGTERM)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal every child still running, wait up to stop_grace seconds, then SIGKILL the rest."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            _signal(p, sig)
            if process_state(p.pid) == "stopped":
                _signal(p, signal.SIGCONT)
        deadline = time.monotonic() + self.stop_grace
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if p.poll() is None]
            time.sleep(0.02)
        for p in alive:
            _signal(p, signal.SIGKILL)
            p.wait()


def _preexec(parent: int):
    return lambda: _child_setup(parent)


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass
