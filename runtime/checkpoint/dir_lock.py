"""One run at a time in a directory: an exclusive fcntl.flock on DIR/meshplan.lock.

The lock file holds who has it (a JSON `Holder`: run id, host, pid, start time) so that the run
that is refused can be told whom it waits for. The lock belongs to the open file: it is released
by `release()`, when the DirLock is garbage-collected, or by the kernel when the process dies
(a SIGKILLed run leaves no stale lock; the file stays, with the last holder's details, and is
reused). The file is opened with O_NOFOLLOW: a symlink planted at its name is refused, never
written through. Its descriptor is not inherited by child processes (Python's default).

Used by `meshplan run` for the build directory (runtime/launch/launcher.py run_many) and by rank 0 for a
checkpoint directory (runtime/checkpoint/run_ids.py). flock works across the clients of one NFS
server (Linux maps it to an NFS lock) and within one machine on any local file system.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.files import WriteError, make_dirs

LOCK_NAME = "meshplan.lock"


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: `started` is unix time in seconds; `run_id` is empty for a build's lock."""

    host: str
    pid: int
    started: float
    run_id: str = ""

    @classmethod
    def here(cls, run_id: str = "") -> "Holder":
        return cls(socket.gethostname(), os.getpid(), time.time(), run_id)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"run {self.run_id} " if self.run_id else "") + f"(host {self.host}, pid {self.pid}, started {when})"

    @classmethod
    def parse(cls, text: bytes) -> "Holder | None":
        try:
            d = json.loads(text)
            return cls(str(d["host"]), int(d["pid"]), float(d["started"]), str(d.get("run_id", "")))
        except (ValueError, KeyError, TypeError):
            return None  # written by nobody yet, or by something else


class DirectoryBusy(ValueError):
    """Another live process holds the directory's lock; `holder` says who (None if it wrote nothing yet)."""

    def __init__(self, message: str, holder: Holder | None):
        super().__init__(message)
        self.holder = holder


class DirLock:
    """An exclusive lock on a directory, held from `acquire` until `release` (or the process ends)."""

    def __init__(self, fd: int, path: Path, holder: Holder):
        self._fd: int | None = fd
        self.path = path
        self.holder = holder

    @classmethod
    def acquire(cls, directory: str | os.PathLike, holder: Holder, what: str) -> "DirLock":
        """Lock `directory` (created if missing) for `holder`, or raise DirectoryBusy naming the holder.

        `what` names the directory in the message ("build", "checkpoint directory").
        """
        path = make_dirs(directory) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise WriteError(path, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = Holder.parse(os.pread(fd, 4096, 0))
            os.close(fd)
            who = other.describe() if other is not None else "another process (it has not written its details yet)"
            raise DirectoryBusy(f"{what} {Path(directory)} is in use by {who}; two runs must not write it at once: "
                                "wait for that run to end (or stop it), or use another directory", other) from None
        lock = cls(fd, path, holder)
        try:
            lock.update(holder)
        except BaseException:
            lock.release()
            raise
        return lock

    def update(self, holder: Holder) -> None:
        """Record `holder` in the lock file (e.g. once the run id is known)."""
        assert self._fd is not None, "update of a released lock"
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps(asdict(holder)).encode(), 0)
            os.fsync(self._fd)
        except OSError as e:
            raise WriteError(self.path, e) from e
        self.holder = holder

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the lock up (the file stays: removing it would race with a process about to lock it)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor of the open file drops the flock

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def lock_directories(directories, what: str) -> list[DirLock]:
    """Lock each directory (once, however often it is listed) for this process; all or none."""
    held: list[DirLock] = []
    try:
        for d in dict.fromkeys(Path(x).resolve() for x in directories):
            held.append(DirLock.acquire(d, Holder.here(), what))
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return held
