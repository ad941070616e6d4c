"""Heartbeats and an abort watcher, so that a dead or stuck rank is named and nobody waits for it.

Each rank of a torch.distributed run starts one `Watchdog` thread (its own
client of the rendezvous TCPStore). Every `interval` seconds it publishes the
rank's heartbeat: a counter and the instruction the rank is on. It serves two
purposes:

* Naming the culprit. When a communication fails or times out and no rank
  published a reason (a rank killed with SIGKILL cannot), `diagnose()` reads
  every other rank's heartbeat twice, `window` seconds apart: a counter that
  did not move is a dead process; a moving counter on an instruction that
  computes (not a wait or a communication) that has not changed is a rank that
  stopped responding. The diagnosis is published as the run's failure reason.
* Ending stuck ranks. Once a failure reason is published, a rank whose main
  thread has not started to stop within `grace` seconds (it is stuck in a
  computation, or blocked on a peer with a long timeout) prints the reason and
  exits with status 1 from this thread.

MPI runs have no store; there mpiexec ends the job when a process dies.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from typing import Callable

from runtime.comm import ABORT_KEY

# A rank on one of these is waiting for others; every other instruction (compute, and issuing an
# asynchronous communication, which returns at once) should finish by itself.
WAITING_OPS = ("WAIT",)


def _hb_key(rank: int) -> str:
    return f"meshplan/heartbeat/{rank}"


class Watchdog:
    """One rank's heartbeat publisher and abort watcher.

    Args:
        rank, world_size: this process and the number of processes.
        host, port: the rendezvous TCPStore; prefix: the key prefix the Communicator uses.
        position: returns (step, instruction index, instruction text, op) of the main thread now.
        interval: seconds between heartbeats; grace: seconds a rank may take to stop after a
            failure was published before this thread ends it.
    """

    def __init__(self, rank: int, world_size: int, host: str, port: int, position: Callable[[], tuple],
                 *, prefix: str = "meshplan", interval: float = 0.5, grace: float = 3.0):
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.position = position
        self.interval = float(interval)
        self.grace = float(grace)
        raw = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=10),
                            wait_for_workers=False)
        self._store = dist.PrefixStore(prefix, raw)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stopping = False
        self._beat = 0
        self._thread = threading.Thread(target=self._run, name=f"meshplan-watchdog-{rank}", daemon=True)

    def start(self) -> "Watchdog":
        self._publish()
        self._thread.start()
        return self

    def stopping(self) -> None:
        """The main thread handles a failure (or finished): leave the exit to it."""
        self._stopping = True

    def close(self) -> None:
        self._stopping = True
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval + 1)

    # ---- heartbeat ------------------------------------------------------------
    def _publish(self) -> None:
        step, idx, text, op = self.position()
        self._beat += 1
        value = json.dumps({"beat": self._beat, "step": step, "instr": idx, "text": text, "op": op})
        with self._lock:
            self._store.set(_hb_key(self.rank), value)

    def _run(self) -> None:
        aborted_at = None
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                with self._lock:
                    failed = self._store.check([ABORT_KEY])
                if failed and not self._stopping:
                    aborted_at = aborted_at or time.monotonic()
                    if time.monotonic() - aborted_at > self.grace:
                        self._end_stuck_rank()
            except Exception:  # the store is gone (its host exited): nothing left to publish or read
                return

    def _end_stuck_rank(self) -> None:
        with self._lock:
            reason = self._store.get(ABORT_KEY).decode()
        step, idx, text, _op = self.position()
        print(f"meshplan rank {self.rank}: stopping because the run failed: {reason} "
              f"(this rank was stuck at step {step}, instruction {idx} '{text}' for over {self.grace:.0f} s after "
              "the failure; ended by its watchdog)", file=sys.stderr, flush=True)
        os._exit(1)

    # ---- diagnosis ---------------------------------------------------------------
    def _read(self) -> dict[int, dict | None]:
        out = {}
        with self._lock:
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                try:
                    out[r] = json.loads(self._store.get(_hb_key(r))) if self._store.check([_hb_key(r)]) else None
                except Exception:
                    out[r] = None
        return out

    def diagnose(self, window: float | None = None) -> str | None:
        """Which rank died or stopped responding, from two readings of the heartbeats `window` s apart."""
        window = 4 * self.interval if window is None else window
        try:
            before = self._read()
            time.sleep(window)
            after = self._read()
        except Exception:
            return None
        dead = [r for r in after if after[r] is None or (before[r] or {}).get("beat") == after[r]["beat"]]
        if dead:
            return "; ".join(f"rank {r} died (no heartbeat for {window:.1f} s: its process is gone)"
                             + _where(after[r] or before[r], last=True) for r in dead)
        stuck = [r for r in after if after[r]["op"] not in WAITING_OPS and before[r] is not None
                 and (before[r]["step"], before[r]["instr"]) == (after[r]["step"], after[r]["instr"])
                 and after[r]["instr"] >= 0]
        if stuck:
            return "; ".join(f"rank {r} stopped responding (alive, but making no progress)" + _where(after[r])
                             for r in stuck)
        return None


def _where(hb: dict | None, last: bool = False) -> str:
    """Where a heartbeat says its rank was (`last`: the final heartbeat of a dead rank, up to one
    interval old)."""
    if not hb:
        return ""
    if hb.get("instr", -1) < 0:
        return f" (last heartbeat: {hb.get('text') or 'starting'})" if last else ""
    at = f"step {hb['step']}, instruction {hb['instr']} '{hb['text']}'"
    return f" (last heartbeat: {at})" if last else f" at {at}"
