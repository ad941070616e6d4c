"""Meeting at the rendezvous: everyone says who it is, one judges, everyone hears the verdict.

A wrong multi-node setup must be refused before the first step, on every node, naming its
cause, instead of training with heartbeats nobody can read or waiting silently. `meet` is that
check, over a TCPStore, for a set of participants numbered 0 .. count-1:

* the ranks of a gloo/NCCL run, on the rendezvous store before any process group exists
  (runtime/comm/__init__.py calls it): a rank that does not come within --timeout is named (with the
  node the plan puts it on), and so are ranks whose MESHPLAN_JOB_SECRET differs from rank 0's
  or that run another build (a node-local copy of another version);
* the nodes of a multi-node torchrun launch (`python -m runtime.join`, which launch_torchrun.sh
  runs before torchrun): node 0 hosts the meeting on MASTER_ADDR:MASTER_PORT, and every node
  says "waiting for N nodes at ADDR:PORT" while one is missing, up to meshplan's --timeout;
  the nodes must agree on NNODES and NPROC_PER_NODE, match the plan's node count, have distinct
  NODE_RANKs, the same secret and the same build. Then node 0 closes the store and every node
  starts torchrun, whose static rendezvous puts rank 0 on node 0.

Each participant writes its arrival (signed with the job secret, runtime/comm/jobauth.py) and counts
itself in; participant 0 reads them all (one read each) and publishes a signed verdict; the
others read that one key. A verdict that fails authentication means this participant's
secret differs from participant 0's; participant 0 names every such participant.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from runtime.comm.jobauth import SECRET_ENV, Signer, signer_from_env

PREFIX = "meshplan/join"
FIRST_SAY_S = 3.0      # a participant that has waited this long says what it waits for ...
SAY_EVERY_S = 10.0     # ... and again every this many seconds
ACK_WAIT_S = 10.0      # how long the host of a refused meeting stays for the others to read why


class JoinError(ValueError):
    """The participants cannot run together (the message names who and why)."""


@dataclass(frozen=True)
class Arrival:
    """What a participant says of itself: its index, the build it runs (build_identity), the node
    the launcher says it is on, its host and process, and what the caller's check compares."""

    index: int
    build: str
    node: int | None = None
    host: str = ""
    pid: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> "Arrival":
        d = json.loads(text)
        return cls(int(d["index"]), str(d["build"]), d.get("node"), str(d.get("host", "")), int(d.get("pid", 0)),
                   dict(d.get("extra") or {}))


def build_identity(build_dir: str | os.PathLike) -> str:
    """The identity of a build: the hash of its build.json ("" without one)."""
    try:
        return hashlib.sha256((Path(build_dir) / "build.json").read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


def listed(indices: list[int], noun: str, node_of: Callable[[int], int | None] | None = None) -> str:
    """'ranks 2, 3 (node 1)' / 'node 1': participants, with the node the plan puts them on."""
    text = f"{noun}{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices[:12]))}" \
        + (f" and {len(indices) - 12} more" if len(indices) > 12 else "")
    nodes = sorted({n for i in indices if node_of is not None and (n := node_of(i)) is not None})
    if nodes:
        text += f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"
    return text


@dataclass
class Meeting:
    """One meeting on `store` of `count` participants (`noun`s) at `where` (ADDR:PORT).

    timeout: seconds to wait for everyone; say: prints a progress line (None: silent);
    node_of: the node the plan puts a participant on (for the messages); check: participant 0's
    extra check of every arrival (returns a problem to refuse with, or None); attempt: tells apart
    the meetings of one store's successive attempts (torchrun's TORCHELASTIC_RESTART_COUNT)."""

    store: object
    count: int
    signer: Signer
    where: str
    timeout: float
    noun: str = "rank"
    say: Callable[[str], None] | None = None
    node_of: Callable[[int], int | None] | None = None
    check: Callable[[list[Arrival]], str | None] | None = None
    attempt: str = ""

    def _key(self, what) -> str:
        return f"{PREFIX}/{self.noun}{self.attempt}/{what}"

    def meet(self, me: Arrival) -> list[Arrival] | None:
        """Join, wait for everyone, and return the arrivals (participant 0) or None (the others);
        JoinError if the meeting refuses this run (every participant raises it)."""
        if int(self.store.add(self._key(f"claim/{me.index}"), 1)) > 1:
            raise JoinError(f"another {self.noun} already joined at {self.where} as {self.noun} {me.index}: give "
                            f"every {self.noun} its own index (NODE_RANK 0 .. NNODES-1)")
        self.store.set(self._key(me.index), self.signer.sign(json.dumps(asdict(me))))
        if int(self.store.add(self._key("count"), 1)) == self.count:
            self.store.set(self._key("all"), "1")
        deadline = time.monotonic() + self.timeout
        self._wait_all(deadline)
        if me.index == 0:
            arrivals, problem = self._judge()
            self.store.set(self._key("verdict"), self.signer.sign(json.dumps({"ok": problem is None,
                                                                                "reason": problem or ""})))
            if problem:
                self._linger()
                raise JoinError(problem)
            return arrivals
        value = self._wait_key(self._key("verdict"), max(deadline, time.monotonic() + 30.0),
                               lambda: f"waiting for {self.noun} 0's check at {self.where}")
        self.store.add(self._key("acks"), 1)
        text = self.signer.verify(value)
        if text is None:
            raise JoinError(f"this {self.noun}'s {SECRET_ENV} differs from {self.noun} 0's (its verdict at "
                            f"{self.where} fails authentication): set the same {SECRET_ENV} on every node")
        verdict = json.loads(text)
        if not verdict["ok"]:
            raise JoinError(verdict["reason"])
        return None

    def _wait_all(self, deadline: float) -> None:
        def waiting() -> str:
            joined = int(self.store.add(self._key("count"), 0))
            return (f"waiting for {self.count} {self.noun}s at {self.where}: {joined} joined, missing "
                    f"{listed(self._missing(), self.noun, self.node_of)} ({deadline - time.monotonic():.0f} s left "
                    "of --timeout)")
        try:
            self._wait_key(self._key("all"), deadline, waiting)
        except TimeoutError:
            missing = self._missing()
            raise JoinError(f"{listed(missing, self.noun, self.node_of)} did not join at {self.where} within "
                            f"--timeout {self.timeout:g} s: {'it was' if len(missing) == 1 else 'they were'} not "
                            "started, cannot reach this address, or stopped with an error of "
                            f"{'its' if len(missing) == 1 else 'their'} own (see that node's output)") from None

    def _missing(self) -> list[int]:
        return [i for i in range(self.count) if not self.store.check([self._key(i)])]

    def _wait_key(self, key: str, deadline: float, waiting: Callable[[], str]) -> bytes:
        """The value of `key` once it is set; says `waiting()` now and then; TimeoutError at `deadline`.
        With something to say it polls with check() (a store.wait that times out makes torch log
        warnings), every 20 ms at first, backing off to 0.2 s."""
        if self.say is None:   # nothing to say while waiting: one blocking wait, woken as soon as it is set
            try:
                self.store.wait([key], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except Exception as e:   # torch raises DistStoreError on a wait's timeout
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    raise TimeoutError(key) from None
                raise
            return self.store.get(key)
        next_say = time.monotonic() + FIRST_SAY_S
        pause = 0.02
        while not self.store.check([key]):
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(key)
            if self.say is not None and now >= next_say:
                self.say(waiting())
                next_say = now + SAY_EVERY_S
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(0.2, pause * 1.5)
        return self.store.get(key)

    def _judge(self) -> tuple[list[Arrival], str | None]:
        values = self.store.multi_get([self._key(i) for i in range(self.count)])
        arrivals, forged = [], []
        for i, v in enumerate(values):
            text = self.signer.verify(v)
            if text is None:
                forged.append(i)
            else:
                arrivals.append(Arrival.from_json(text))
        problems = []
        if forged:
            problems.append(f"{listed(forged, self.noun, self.node_of)} run{'s' if len(forged) == 1 else ''} with "
                            f"another {SECRET_ENV} than {self.noun} 0 (their arrival at {self.where} fails "
                            f"authentication): set the same {SECRET_ENV} on every node")
        mine = next((a.build for a in arrivals if a.index == 0), "")
        other = [a.index for a in arrivals if a.build != mine]
        if other:
            problems.append(f"{listed(other, self.noun, self.node_of)} run{'s' if len(other) == 1 else ''} another "
                            f"build than {self.noun} 0 (its build.json differs): every node must run the same build "
                            "(put it on a shared file system, or copy it to every node again)")
        if not problems and self.check is not None:
            problems.append(self.check(arrivals) or "")
        problems = [p for p in problems if p]
        return arrivals, ("; ".join(problems) or None)

    def _linger(self) -> None:
        """Participant 0 of a refused meeting stays until the others read the verdict (or ACK_WAIT_S)."""
        deadline = time.monotonic() + ACK_WAIT_S
        try:
            while time.monotonic() < deadline and int(self.store.add(self._key("acks"), 0)) < self.count - 1:
                time.sleep(0.05)
        except Exception:
            pass


def say_to_stderr(tag: str) -> Callable[[str], None]:
    return lambda text: print(f"{tag}: {text}", file=sys.stderr, flush=True)


# ---- the nodes of a multi-node torchrun launch --------------------------------------------------

def _node_check(nodes: int, build: dict) -> Callable[[list[Arrival]], str | None]:
    def check(arrivals: list[Arrival]) -> str | None:
        said = {a.index: a.extra for a in arrivals}
        for what, var in (("nnodes", "NNODES"), ("nproc", "NPROC_PER_NODE")):
            values = {i: e.get(what) for i, e in said.items()}
            if len(set(values.values())) > 1:
                return (f"the nodes disagree on {var}: " + ", ".join(f"node {i} has {v}" for i, v in
                                                                       sorted(values.items()))
                        + f"; set the same {var} on every node")
        nproc = said[0].get("nproc")
        world = build.get("world_size")
        if world and nproc and nodes * nproc != world:
            return (f"{nodes} nodes x NPROC_PER_NODE={nproc} start {nodes * nproc} processes, but the plan needs "
                    f"{world}; start {world} in all")
        plan_nodes = build.get("nodes")
        if plan_nodes and plan_nodes != nodes:
            return (f"this launch has {nodes} nodes, but the plan was made for {plan_nodes} node(s) of "
                    f"{build.get('devices_per_node')} processes: launch {plan_nodes} node(s), or make the plan "
                    f"for {nodes} nodes and generate the build again")
        return None
    return check


def wait_for_port(host: str, port: int, timeout: float, say: Callable[[str], None] | None, waiting: str) -> None:
    """Until `host`:`port` accepts a TCP connection (a plain socket: torch logs a C++ stack trace for every
    refused attempt of a TCPStore client); says `waiting` now and then; JoinError after `timeout` s."""
    deadline = time.monotonic() + timeout
    next_say = time.monotonic() + FIRST_SAY_S
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError as e:
            now = time.monotonic()
            if now >= deadline:
                raise JoinError(f"nothing answers at {host}:{port} after --timeout {timeout:g} s ({e.strerror or e}): "
                                f"{waiting}; check MASTER_ADDR and MASTER_PORT, and that this node reaches that "
                                "address") from None
            if say is not None and now >= next_say:
                say(f"{waiting} ({deadline - now:.0f} s left of --timeout)")
                next_say = now + SAY_EVERY_S
            time.sleep(0.5)


def _connect(host: str, port: int, timeout: float, say: Callable[[str], None], nodes: int):
    """A client of the meeting's store (node 0 may start later)."""
    import torch.distributed as dist

    wait_for_port(host, port, timeout, say, f"waiting for {nodes} nodes at {host}:{port}: node 0 is not there yet")
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def join_nodes(build_dir: str, nodes: int, node_rank: int, nproc: int, host: str, port: int, timeout: float,
               environ: dict | None = None) -> None:
    """Node `node_rank`'s part of the meeting of a multi-node launch (JoinError if it is refused)."""
    from runtime.comm.store_host import host_store, listen_address

    env = os.environ if environ is None else environ
    if not 0 <= node_rank < nodes:
        raise JoinError(f"NODE_RANK={node_rank} is not a node of NNODES={nodes}: give the nodes 0 .. {nodes - 1}")
    say = say_to_stderr(f"meshplan node {node_rank} of {nodes}")
    signer = signer_from_env(env)
    try:
        build = json.loads((Path(build_dir) / "build.json").read_text())
    except (OSError, ValueError) as e:
        raise JoinError(f"{build_dir}/build.json cannot be read on this node ({e}): the build must be on every "
                        "node (a shared file system)") from None
    hosted = None
    if node_rank == 0:
        hosted = host_store(listen_address(host, env), port, timeout, None)
        store = hosted.store
    else:
        store = _connect(host, port, timeout, say, nodes)
    # --timeout counts from here for every node (node 0's store is up, the others reached it)
    meeting = Meeting(store, nodes, signer, f"{host}:{port}", timeout, noun="node", say=say,
                      check=_node_check(nodes, build))
    me = Arrival(node_rank, build_identity(build_dir), node_rank, socket.gethostname(), os.getpid(),
                 {"nnodes": nodes, "nproc": nproc})
    meeting.meet(me)
    # Hand the port over to torchrun: node 0 closes its store once everyone has read the verdict;
    # the others wait until it is closed, so that no torchrun agent talks to this store.
    if hosted is not None:
        meeting._linger()
        del store, meeting
        hosted = None
        return
    del store, meeting   # (a closed connection: torch logs a stack trace for a request on it)
    end = time.monotonic() + ACK_WAIT_S
    while time.monotonic() < end:
        try:
            socket.create_connection((host, port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.join",
                                 description="The nodes of a multi-node launch meet and check their setup "
                                             "(launch_torchrun.sh runs this before torchrun).")
    ap.add_argument("--build", required=True, help="the build directory")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--nproc-per-node", type=int, required=True)
    ap.add_argument("--master", required=True, metavar="ADDR:PORT")
    ap.add_argument("rank_args", nargs=argparse.REMAINDER, help="the rank scripts' options (for --timeout)")
    args = ap.parse_args(argv)
    rank_args = [a for a in args.rank_args if a != "--"]
    ra = argparse.ArgumentParser(add_help=False)
    ra.add_argument("--timeout", type=float, default=300.0)
    timeout = ra.parse_known_args(rank_args)[0].timeout
    host, _, port = args.master.rpartition(":")
    try:
        join_nodes(args.build, args.nodes, args.node_rank, args.nproc_per_node, host, int(port), timeout)
    except ValueError as e:   # JoinError, StoreBindError: the cause, without a traceback
        print(f"meshplan node {args.node_rank} of {args.nodes}: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
