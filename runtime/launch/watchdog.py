"""Heartbeats and an abort watcher, so that a dead, stopped or stuck rank is named and nobody waits for it.

Each rank starts one `Watchdog` thread (its own client of the rendezvous
TCPStore; under MPI, of the store `meshplan run` hosts for heartbeats, or else
of one rank 0 hosts). Every `interval` seconds it publishes the rank's
heartbeat: a counter, the wall time and the instruction the rank is on, signed
with the job secret (runtime/comm/jobauth.py). It serves four purposes:

* Finding a hung rank. Each rank watches the next one in a ring (rank r
  watches r + 1 mod world: one store read per interval each, whatever the
  world size). A rank whose heartbeat has not changed for `heartbeat_timeout`
  seconds (its process was stopped, hangs holding the interpreter, or died) is
  named in the run's failure reason, independently of the collective timeout.
  Watching starts with the neighbour's first heartbeat: a rank that never
  comes is the rendezvous timeout's to report.
* Naming the culprit. When a communication fails or times out and no rank
  published a reason (a rank killed with SIGKILL cannot), `diagnose()` reads
  every other rank's heartbeat twice, `window` seconds apart: a counter that
  did not move is a rank that died or stopped; a moving counter on an
  instruction that computes (not a wait or a communication) that has not
  changed is a rank that is alive but makes no progress. A rank is named only on its own
  heartbeat's evidence: when the store itself does not answer, the diagnosis names the store and
  its host ("the rendezvous store at ADDR:PORT, on rank 0's node, is gone") and no rank. A named
  rank whose process is stopped on this host is killed as this rank exits (under torchrun, whose
  agent would wait 30 s for it).
* Ending stuck ranks. Once a failure reason is published, a rank whose main
  thread has not started to stop within `grace` seconds (it is stuck in a
  computation, or blocked on a peer with a long timeout) prints the reason and
  exits with status 1 from this thread.
* Outliving nobody. When the store has not answered for `heartbeat_timeout`
  seconds, its host (the launcher, torchrun's agent, or rank 0) is gone: the
  rank stops rather than train on with nobody to stop it. After the first failed
  request it only checks whether the store's port answers (each failed store
  request makes torch log a C++ stack trace).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

from runtime.comm import ABORT_KEY, read_abort
from runtime.comm.jobauth import SECRET_ENV, Signer, shown
from runtime.lifetime import process_state

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
        heartbeat_timeout: seconds without a heartbeat after which the watched neighbour is named
            as not responding (and without an answer from the store after which this rank stops).
        signer: signs this rank's heartbeats and checks the others' and the failure reason.
        store_owner: where the store is and who hosts it, for the message when it is gone
            ("on rank 0's node (hosted by torchrun's agent)").
        kill_stopped: note a rank named as not responding whose process is stopped on this host, for
            end_stopped() to kill as this rank exits (torchrun's agent waits 30 s for a stopped worker;
            `meshplan run` and mpirun end it themselves).
    """

    def __init__(self, rank: int, world_size: int, host: str, port: int, position: Callable[[], tuple],
                 *, prefix: str = "meshplan", interval: float = 0.5, grace: float = 3.0,
                 heartbeat_timeout: float = 30.0, signer: Signer | None = None, store_owner: str = "",
                 kill_stopped: bool = True):
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.position = position
        self.interval = float(interval)
        self.grace = float(grace)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.signer = signer or Signer()
        self.store_address = f"{host}:{port}"
        self.store_owner = store_owner
        self.kill_stopped = kill_stopped
        self._stopped_pids: set[int] = set()
        raw = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=10),
                            wait_for_workers=False)
        self._store = dist.PrefixStore(prefix, raw)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stopping = False
        self._beat = 0
        self._watched = (rank + 1) % world_size if world_size > 1 else None
        self._seen: tuple[int, float] | None = None   # (the watched rank's beat, monotonic time it changed)
        self._store_lost_at: float | None = None
        self._warned: set[str] = set()
        self.hosted_store = None   # a store this rank hosts for the heartbeats (MPI), kept alive here
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
        value = json.dumps({"beat": self._beat, "time": time.time(), "step": step, "instr": idx, "text": text,
                            "op": op, "host": _HOST, "pid": os.getpid()})
        with self._lock:
            self._store.set(_hb_key(self.rank), self.signer.sign(value))

    def _run(self) -> None:
        aborted_at = None
        while not self._stop.wait(self.interval):
            if self._store_lost_at is not None and not self._answers():
                # once the store failed, ask only whether its port still answers: every failed store request
                # makes torch log a C++ stack trace
                if self._stopping:
                    return
                now = time.monotonic()
                if now - self._store_lost_at > self.heartbeat_timeout:
                    self._end(self.store_lost(ConnectionError("connection refused"), now - self._store_lost_at))
                continue
            try:
                self._publish()
                with self._lock:
                    reason = read_abort(self._store, self.signer, self.rank)
                self._store_lost_at = None
                if reason and not self._stopping:
                    aborted_at = aborted_at or time.monotonic()
                    if time.monotonic() - aborted_at > self.grace:
                        self._end_stuck_rank(reason)
                elif not reason and not self._stopping:
                    self._watch_neighbour()
            except Exception as e:  # the store does not answer: its host may be gone
                if self._stopping:
                    return
                now = time.monotonic()
                self._store_lost_at = self._store_lost_at or now
                if now - self._store_lost_at > self.heartbeat_timeout:
                    self._end(self.store_lost(e, now - self._store_lost_at))

    def _watch_neighbour(self) -> None:
        """Name the watched rank once its heartbeat has not changed for heartbeat_timeout seconds."""
        if self._watched is None:
            return
        hb = self._read_one(self._watched)
        now = time.monotonic()
        if hb is None:
            if self._seen is None:
                return  # not started yet: the rendezvous timeout covers a rank that never comes
            beat = self._seen[0]
        else:
            beat = hb["beat"]
        if self._seen is None or self._seen[0] != beat:
            self._seen = (beat, now)
            return
        if now - self._seen[1] > self.heartbeat_timeout:
            reason = (f"rank {self._watched} stopped responding: no heartbeat for {now - self._seen[1]:.0f} s "
                      f"(--heartbeat-timeout {self.heartbeat_timeout:g}; its process was stopped, hangs, or died)"
                      + _where(hb, last=True))
            with self._lock:
                self._store.compare_set(ABORT_KEY, "", self.signer.sign(reason))
            self._seen = (beat, now)  # once
            if hb is not None:
                self._note_if_stopped(hb)

    def _end(self, why: str) -> None:
        step, idx, text, _op = self.position()
        print(f"meshplan rank {self.rank}: stopping: {why} (this rank was at step {step}, instruction {idx} "
              f"'{text}'; ended by its watchdog)", file=sys.stderr, flush=True)
        os._exit(1)

    def _end_stuck_rank(self, reason: str) -> None:
        step, idx, text, _op = self.position()
        print(f"meshplan rank {self.rank}: stopping because the run failed: {reason} "
              f"(this rank was stuck at step {step}, instruction {idx} '{text}' for over {self.grace:.0f} s after "
              "the failure; ended by its watchdog)", file=sys.stderr, flush=True)
        os._exit(1)

    # ---- diagnosis ---------------------------------------------------------------
    def _read_one(self, r: int) -> dict | None:
        """Rank r's last heartbeat, or None (none yet, or one that fails authentication: logged once)."""
        with self._lock:
            if not self._store.check([_hb_key(r)]):
                return None
            value = self._store.get(_hb_key(r))
        text = self.signer.verify(value)
        if text is None:
            if f"hb{r}" not in self._warned:
                self._warned.add(f"hb{r}")
                print(f"meshplan rank {self.rank}: warning: ignored rank {r}'s heartbeat: it fails authentication "
                      f"({shown(value)}); rank {r} runs with another {SECRET_ENV}, or someone else writes to the "
                      "store", file=sys.stderr, flush=True)
            return None
        return json.loads(text)

    def _read(self) -> dict[int, dict | None]:
        """Every other rank's last heartbeat (None: it has none); raises when the store does not answer."""
        return {r: self._read_one(r) for r in range(self.world_size) if r != self.rank}

    def _note_if_stopped(self, hb: dict) -> None:
        pid = hb.get("pid")
        if self.kill_stopped and hb.get("host") == _HOST and isinstance(pid, int) and process_state(pid) == "stopped":
            self._stopped_pids.add(pid)

    def end_stopped(self) -> None:
        """SIGKILL the stopped (SIGSTOP) processes of the ranks this one named on its host: they cannot exit
        by themselves. Called as this rank exits, after it said why (their launcher may then stop the rest)."""
        for pid in self._stopped_pids:
            if process_state(pid) == "stopped":
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _answers(self) -> bool:
        """Whether the store's port accepts a connection (a plain socket: torch logs nothing)."""
        host, _, port = self.store_address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=min(2.0, self.interval * 4)).close()
            return True
        except OSError:
            return False

    def store_lost(self, e: BaseException, seconds: float | None = None) -> str:
        """The reason to give when the store does not answer: its host is gone, not any rank we could name."""
        owner = f", {self.store_owner}," if self.store_owner else ""
        how = f"has not answered for {seconds:.0f} s" if seconds is not None else "does not answer"
        return (f"the rendezvous store at {self.store_address}{owner} is gone (it {how}: {type(e).__name__}): "
                "its host died or lost the network; the ranks there cannot be asked why")

    def diagnose(self, window: float | None = None) -> str | None:
        """Which rank died or stopped responding, from two readings of the heartbeats `window` s apart; a rank
        is named only on its own heartbeat's evidence (a store that does not answer names its host instead).
        A stopped rank on this host is killed, so that its launcher need not wait for it."""
        window = 4 * self.interval if window is None else window
        try:
            before = self._read()
            time.sleep(window)
            after = self._read()
        except Exception as e:
            return self.store_lost(e)
        dead = [r for r in after if after[r] is not None and before[r] is not None
                and before[r]["beat"] == after[r]["beat"]]
        for r in dead:
            self._note_if_stopped(after[r])
        if dead:
            return "; ".join(f"rank {r} stopped responding (no heartbeat for {window:.1f} s: its process died, "
                             "was stopped, or hangs)" + _where(after[r] or before[r], last=True) for r in dead)
        stuck = [r for r in after if after[r] is not None and after[r]["op"] not in WAITING_OPS and before[r] is not None
                 and (before[r]["step"], before[r]["instr"]) == (after[r]["step"], after[r]["instr"])
                 and after[r]["instr"] >= 0]
        if stuck:
            return "; ".join(f"rank {r} stopped responding (alive, but making no progress)" + _where(after[r])
                             for r in stuck)
        return None


_HOST = socket.gethostname()


def _where(hb: dict | None, last: bool = False) -> str:
    """Where a heartbeat says its rank was (`last`: the final heartbeat of a dead rank, up to one
    interval old)."""
    if not hb:
        return ""
    ago = f", {max(0.0, time.time() - hb['time']):.0f} s ago" if "time" in hb else ""
    if hb.get("instr", -1) < 0:
        return f" (last heartbeat{ago}: {hb.get('text') or 'starting'})" if last else ""
    at = f"step {hb['step']}, instruction {hb['instr']} '{hb['text']}'"
    return f" (last heartbeat{ago}: {at})" if last else f" at {at}"
