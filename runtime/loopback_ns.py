"""Run a command in a network namespace of its own whose only interface is loopback (Linux).

    python -m runtime.loopback_ns [--check] -- COMMAND [ARGS...]

Why: Open MPI's launcher (prterun, PRRTE 3) binds its out-of-band listener to the wildcard address
(INADDR_ANY and in6addr_any) whatever its interface parameters say; no MCA parameter chooses the
address. A one-node MPI run therefore starts mpiexec in a network namespace that holds nothing but
loopback: every socket of the job, the wildcard ones included, is reachable from this node only
(and only from inside the job: the namespace's 127.0.0.1 is its own). Shared memory, files and
Unix sockets are not affected.

The namespace comes from unshare(2): CLONE_NEWNET with CAP_SYS_ADMIN (root), else a user namespace
that maps this user to itself first (unprivileged user namespaces, where the kernel allows them).
`--check` only says (exit 0 / 1 and one line) whether this machine allows it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct
import sys

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


class NamespaceError(OSError):
    """This machine does not let this user make a network namespace."""


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise NamespaceError(err, os.strerror(err))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    """Bring the new namespace's `lo` up (a fresh namespace has it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def enter() -> None:
    """Move this (single-threaded) process into a new network namespace with loopback up;
    NamespaceError when the kernel or this user's rights do not allow it."""
    if not sys.platform.startswith("linux"):
        raise NamespaceError(0, "network namespaces are a Linux feature")
    try:
        _unshare(_CLONE_NEWNET)
    except NamespaceError:
        uid, gid = os.getuid(), os.getgid()
        _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)   # this user, mapped to itself, owns the namespace
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _loopback_up()


def wrap(cmd: list[str]) -> tuple[list[str], str | None]:
    """`cmd` started inside a loopback-only network namespace, and None; or `cmd` itself and why not
    (this machine does not allow the namespace: the caller warns)."""
    import subprocess

    probe = subprocess.run([sys.executable, "-m", "runtime.loopback_ns", "--check"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    if probe.returncode != 0:
        return cmd, (probe.stderr.strip().splitlines() or ["no reason given"])[-1]
    return [sys.executable, "-m", "runtime.loopback_ns", "--", *cmd], None


def main(argv: list[str]) -> int:
    check = argv[:1] == ["--check"]
    rest = argv[1:] if check else argv
    cmd = rest[1:] if rest[:1] == ["--"] else rest
    try:
        enter()
    except OSError as e:
        print(f"meshplan: cannot make a loopback-only network namespace ({e.strerror or e})", file=sys.stderr)
        return 1
    if check:
        return 0
    if not cmd:
        print("usage: python -m runtime.loopback_ns [--check] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    os.execvp(cmd[0], cmd)
    return 127   # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
