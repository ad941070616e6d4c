"""The TCP sockets each local launch path listens on, read from /proc while a 2-rank run trains.

    python benchmarks/listening_sockets.py [--build DIR] [--paths gloo,mpi,torchrun,mpirun] [--seconds 6]

Launch paths, each on this one node: `meshplan run BUILD` (gloo), `meshplan run BUILD --backend mpi`,
and the build's generated launch_torchrun.sh and launch_mpirun.sh. Each starts in a session of its own;
while it runs, every process of that session (and every descendant of the launcher) is sampled: the
inodes of its socket descriptors, matched with the LISTEN entries of /proc/PID/net/tcp and tcp6 (the
process's own network namespace: a socket there on any address counts as loopback when that namespace
has no interface but lo, as runtime/loopback_ns.py makes for one-node MPI runs).
Sampling runs from the start until `--seconds` after the run's first step is written to metrics.jsonl,
so that the rendezvous, the transport's listeners and the watchdog's store are all seen. Prints one
line per (process, address) and "ALL LOOPBACK" or the addresses beyond it; exits non-zero when a path
listens beyond loopback or never started training. The code under test is this checkout's, or the one
first in $PYTHONPATH. `listening()` and `session_processes()` are shared with tests/mpi/test_mpi_loopback.py.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LISTEN = "0A"   # TCP_LISTEN in /proc/net/tcp's st column


def _address(hex_addr: str, v6: bool) -> str:
    """/proc/net/tcp's little-endian hex address (per 32-bit word) as text."""
    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw if v6 else raw[:4]))


def listening_inodes(pid: int | str = "self") -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in `pid`'s network namespace."""
    out = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != _LISTEN:
                continue
            addr, port = f[1].split(":")
            out[int(f[9])] = (_address(addr, v6), int(port, 16))
    return out


def loopback_only_namespace(pid: int | str = "self") -> bool:
    """Whether `pid`'s network namespace has no interface but loopback (runtime/loopback_ns.py):
    then even a wildcard address there is reachable from this node only."""
    try:
        lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    return [ln.split(":")[0].strip() for ln in lines] == ["lo"]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[3])


def session_processes(leader: int) -> dict[int, str]:
    """pid -> command name of every process in `leader`'s session or below it."""
    parents, found = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parents[int(entry)] = st[0]
                if st[1] == leader:
                    found[int(entry)] = ""
    grew = True
    while grew:   # descendants that left the session (a daemon's setsid)
        grew = False
        for pid, ppid in parents.items():
            if ppid in found or ppid == leader:
                if pid not in found:
                    found[pid], grew = "", True
    found.setdefault(leader, "")
    for pid in list(found):
        try:
            found[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            del found[pid]
    return found


def listening(leader: int) -> set[tuple[str, str, int, bool]]:
    """(command name, address, port, in a loopback-only network namespace) of every TCP socket
    listening in `leader`'s processes (each read in its own process's network namespace)."""
    seen = set()
    tables: dict[str, tuple[dict, bool]] = {}
    for pid, name in session_processes(leader).items():
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        if netns not in tables:
            tables[netns] = (listening_inodes(pid), loopback_only_namespace(pid))
        table, private = tables[netns]
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in table:
                    seen.add((name, *table[inode], private))
    return seen


def reaches_beyond_loopback(address: str, private: bool) -> bool:
    """Whether a socket listening on `address` can be reached from another host."""
    return not private and not ipaddress.ip_address(address).is_loopback


def _first_step_seen(metrics: Path, since: float) -> bool:
    try:
        return metrics.stat().st_mtime >= since and metrics.stat().st_size > 0
    except OSError:
        return False


def sample(cmd: list[str], env: dict, cwd: Path, metrics: Path, seconds: float, limit: float = 180.0
           ) -> tuple[set, bool]:
    """(everything `cmd` listened on, whether it reached its first step) while it ran; it is then killed."""
    metrics.unlink(missing_ok=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    seen: set = set()
    trained_at = None
    try:
        while time.time() - t0 < limit and proc.poll() is None:
            seen |= listening(proc.pid)
            if trained_at is None and _first_step_seen(metrics, t0):
                trained_at = time.time()
            if trained_at is not None and time.time() - trained_at > seconds:
                break
            time.sleep(0.2)
    finally:
        for pid in session_processes(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    return seen, trained_at is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", help="a 2-rank build to run (default: the MLP at data 2, made in a temporary directory)")
    ap.add_argument("--paths", default="gloo,mpi,torchrun,mpirun")
    ap.add_argument("--seconds", type=float, default=6.0, help="seconds sampled after the first step")
    args = ap.parse_args()
    code = Path(os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or ROOT).resolve()
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1",
           "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "PYTHON": sys.executable}
    if os.geteuid() == 0:
        env["MPIRUN_ARGS"] = "--allow-run-as-root --oversubscribe"
    tmp = Path(tempfile.mkdtemp(prefix="listen_"))
    try:
        build = Path(args.build) if args.build else tmp / "build"
        if not args.build:
            subprocess.run([sys.executable, "-m", "planner.app.cli", "codegen", "examples/models/mlp.py:build",
                            "--batch", "4", "--data", "2", "-o", str(build)], cwd=code, env=env, check=True,
                           stdout=subprocess.DEVNULL)
        build = build.resolve()
        cli = [sys.executable, "-m", "planner.app.cli", "run", str(build), "--steps", "1000000", "--quiet",
               "--no-trace"]
        paths = {"gloo": cli, "mpi": [*cli, "--backend", "mpi"],
                 "torchrun": ["bash", str(build / "launch_torchrun.sh"), "--steps", "1000000", "--no-trace"],
                 "mpirun": ["bash", str(build / "launch_mpirun.sh"), "--steps", "1000000", "--no-trace"]}
        print(f"code under test: {code}; host {socket.gethostname()}; build {build}")
        bad = 0
        for name in [p for p in args.paths.split(",") if p]:
            seen, trained = sample(paths[name], env, code, build / "metrics.jsonl", args.seconds)
            wide = sorted({(a, p) for _n, a, p, private in seen if reaches_beyond_loopback(a, private)})
            verdict = ("ALL LOOPBACK" if not wide else "BEYOND LOOPBACK: " + ", ".join(f"{a}:{p}" for a, p in wide))
            print(f"{name}: {len(seen)} listening sockets{'' if trained else ' (NEVER TRAINED)'}; {verdict}")
            for proc_name, a, p, private in sorted(seen):
                print(f"    {proc_name:<16} {a}:{p}" + ("   (own network namespace: loopback only)" if private else ""))
            bad += bool(wide) or not trained
        return 1 if bad else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
