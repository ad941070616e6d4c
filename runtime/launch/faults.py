"""Test-only fault injection: make one rank fail in a chosen way at a chosen point.

    --fail-at RANK:STEP:INSTR --fault raise|sigkill|hang|sigstop
    --fail-at RANK:STEP:0 --fault sigkill-in-save|disk-full-in-save

raise:           the instruction raises (the rank reports its reason and exits);
sigkill:         the process kills itself with SIGKILL (no reason is published,
                 nothing is cleaned up: what a crashed host or the OOM killer does);
hang:            the rank stops responding inside the instruction (sleeps forever);
sigstop:         the process stops itself with SIGSTOP (alive, but nothing in it runs:
                 not even its watchdog; what a frozen host or a debugger does);
sigkill-in-save: SIGKILL when half of the rank's file of the checkpoint saved
                 after step STEP is on disk.
disk-full-in-save: the write of that file fails there with ENOSPC, as on a full disk.

Each prints one line with the wall-clock time first, so tests can measure how long
the other ranks take to exit.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

SAVE_FAULTS = ("sigkill-in-save", "disk-full-in-save")  # fire in the checkpoint save, not in an instruction
FAULTS = ("raise", "sigkill", "hang", "sigstop", *SAVE_FAULTS)


class InjectedFault(RuntimeError):
    """The fault --fail-at asked for."""


def announce(rank: int, what: str) -> None:
    print(f"meshplan rank {rank}: injecting fault: {what} at unix time {time.time():.3f}", file=sys.stderr,
          flush=True)


def inject(kind: str, rank: int, where: str) -> None:
    """Carry out fault `kind` now (`where` names the instruction, for the messages)."""
    if kind == "raise":
        raise InjectedFault("injected fault (--fail-at)")
    announce(rank, f"{kind} in {where}")
    if kind in ("sigkill", "sigkill-in-save"):
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if kind == "disk-full-in-save":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise ValueError(f"unknown --fault {kind!r}; known: {', '.join(FAULTS)}")
