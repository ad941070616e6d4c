"""A rank's contact with the other ranks and its launcher (runtime/rank_main.py): the communicator and the
rendezvous check, the watchdog and its heartbeat store, broadcasts over the world, and how a rank says
why it stops and exits."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from runtime.comm.jobauth import signer_from_env
from runtime.join import Arrival, Meeting, say_to_stderr
from runtime.lifetime import HEARTBEAT_STORE_ENV, LAUNCHER_PID_ENV
from runtime.launch.placement import node_of
from runtime.comm.store_host import LOOPBACK, host_store, listen_address
from runtime.vocab import Backend
from runtime.launch.watchdog import Watchdog
from runtime.launch.rank_args import LaunchError
from runtime.launch.rank_session import Prepared, RankSession


def make_comm(backend: str, rank: int, world_size: int, args, device, join: Callable[[object], None] | None = None):
    if backend == Backend.MPI:
        from runtime.comm.mpi import MpiCommunicator

        comm = MpiCommunicator(timeout=args.timeout)
        if comm.world_size != world_size:
            raise LaunchError(f"the plan needs {world_size} processes, but MPI started {comm.world_size}; "
                              f"run mpirun -n {world_size}")
        if comm.rank != rank:
            raise LaunchError(f"MPI says this process is rank {comm.rank}, but this is the script of rank {rank}")
        return comm
    from runtime.comm.torch_dist import TorchCommunicator

    return TorchCommunicator(backend, rank, world_size, args.master_addr, args.master_port, timeout=args.timeout,
                             use_agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                             device=device, signer=signer_from_env(), join=join)


def waiting_sayer(p: Prepared) -> Callable[[str], None] | None:
    """Over several nodes (or an unknown placement), rank 0 and the first rank of each node say what they wait
    for; on one machine the ranks start together and nobody does."""
    if p.where.nodes == 1:
        return None
    return say_to_stderr(f"meshplan rank {p.rank}") if p.rank == 0 or p.where.local_rank == 0 else None


def rendezvous_check(p: Prepared) -> Callable[[object], None]:
    """This rank's part of the rendezvous check (runtime/join.py); a missing rank is named with the node the
    plan puts it on."""
    several = p.where.nodes is None or p.where.nodes > 1
    say = waiting_sayer(p)

    def join(store) -> None:
        Meeting(store, p.program.world_size, signer_from_env(), f"{p.args.master_addr}:{p.args.master_port}",
                p.args.timeout, noun="rank", say=say,
                node_of=(lambda r: node_of(r, p.devices_per_node)) if several else None,
                attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "")).meet(
            Arrival(p.rank, p.build_id, p.where.node, socket.gethostname(), os.getpid()))
    return join


def world_broadcast(comm, world_size: int, device):
    """values -> rank 0's values (int64) on every rank, over all ranks (on `device`: NCCL
    broadcasts GPU tensors only)."""
    def broadcast(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=device)
        comm.group(range(world_size)).broadcast(t, 0)
        return [int(v) for v in t.tolist()]
    return broadcast


def start_watchdog(p: Prepared, comm, running: list) -> Watchdog | None:
    """Heartbeats and the abort watcher (runtime/launch/watchdog.py) on the rendezvous store; under MPI on the
    store `meshplan run` hosts for them (HEARTBEAT_STORE_ENV), else none (the collective timeout)."""
    hosted = None
    if p.backend == Backend.MPI:
        where = os.environ.get(HEARTBEAT_STORE_ENV, "")
        if where:
            host, _, port = where.rpartition(":")
        else:  # started by mpirun directly: rank 0 hosts one (on loopback when every rank is on its node)
            try:
                if comm.rank == 0:
                    addr = LOOPBACK if comm.single_node else os.environ.get("MASTER_ADDR") or socket.gethostname()
                    hosted = host_store(listen_address(addr), 0, p.args.timeout)
                host, port = comm.share((addr, hosted.port) if hosted else None)
            except Exception as e:
                print(f"meshplan rank {p.rank}: warning: no heartbeat store ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
                return None
    else:
        host, port = p.args.master_addr, p.args.master_port
    instrs = p.program.instrs
    owner = _store_owner(p)

    def position() -> tuple[int, int, str, str]:
        if not running:
            return -1, -1, "connecting", ""
        step, idx = running[0].position
        ins = instrs[idx] if 0 <= idx < len(instrs) else None
        return step, idx, str(ins) if ins else "", ins.op if ins else ""
    try:
        wd = Watchdog(p.rank, p.program.world_size, host, int(port), position, grace=min(3.0, p.args.timeout),
                      heartbeat_timeout=p.args.heartbeat_timeout, signer=signer_from_env(),
                      store_owner=owner, kill_stopped="TORCHELASTIC_RUN_ID" in os.environ).start()
    except Exception as e:  # no watchdog: failures are still reported, only less precisely
        print(f"meshplan rank {p.rank}: warning: no watchdog ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return None
    wd.hosted_store = hosted   # held as long as the watchdog runs
    if p.backend != Backend.MPI:
        comm.diagnose = wd.diagnose
    return wd


def under_meshplan_run() -> bool:
    """Whether `meshplan run` started this rank (directly, or through mpiexec with its heartbeat store)."""
    return LAUNCHER_PID_ENV in os.environ or bool(os.environ.get(HEARTBEAT_STORE_ENV))


def _store_owner(p: Prepared) -> str:
    """Where the run's store is and who hosts it, as the watchdog names it when it is gone."""
    if os.environ.get(HEARTBEAT_STORE_ENV) if p.backend == Backend.MPI else LAUNCHER_PID_ENV in os.environ:
        return "hosted by `meshplan run`"
    agent = p.backend != Backend.MPI and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = "torchrun's agent" if agent else "rank 0"
    return f"on rank 0's node (hosted by {host})" if p.where.nodes != 1 else f"hosted by {host}"


def say(line: str) -> None:
    """Print why this rank stops; under torchrun also put it in the rank's error file, so that torchrun's
    closing summary names the cause instead of "To enable traceback see ..."."""
    print(line, file=sys.stderr, flush=True)
    _tell_launcher(line)


def _tell_launcher(reason: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path).write_text(json.dumps({"message": reason, "timestamp": int(time.time())}))
    except OSError:
        pass


def _exit_hard(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop(exit_on_failure: bool) -> int:
    if exit_on_failure:
        _exit_hard(1)
    return 1


def stopping(session: RankSession) -> None:
    if session.watchdog is not None:
        session.watchdog.stopping()


def end_stopped(session: RankSession) -> None:
    if session.watchdog is not None:
        session.watchdog.end_stopped()
