"""Multi-node setup checks without a cluster: where a rank runs (runtime/launch/placement.py), the
rendezvous meeting (runtime/join.py) on a real TCPStore in threads, and the shared-directory
probe (runtime/launch/shared_dirs.py) with in-process collectives."""

from __future__ import annotations

import json
import threading

import pytest

from runtime import join as join_mod
from runtime.comm.jobauth import Signer
from runtime.join import Arrival, JoinError, Meeting, _node_check, listed
from runtime.launch.placement import Placement, PlacementError, check_nodes, cuda_index, placement, tasks_per_node
from runtime.launch.shared_dirs import probe
from runtime.comm.store_host import LOOPBACK, host_store


def test_placement_from_each_launcher():
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2", "RANK": "3", "WORLD_SIZE": "4"}
    assert placement(torchrun) == Placement(1, 2, 1, 2, "torchrun")
    slurm = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_NODES": "3", "SLURM_NODEID": "2", "SLURM_LOCALID": "1",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2),3", "SLURM_NNODES": "8"}
    assert placement(slurm) == Placement(2, 3, 1, 3, "slurm")
    # the batch script itself (no step): not a placement of ranks
    assert placement({"SLURM_PROCID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0"}).nodes is None
    ompi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert placement(ompi) == Placement(1, 2, 1, 2, "open mpi")
    # `meshplan run` is one machine, whatever else the environment holds (it may run inside an allocation)
    mine = {"MESHPLAN_LAUNCHER_PID": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "SLURM_STEP_NUM_NODES": "2"}
    assert placement(mine) == Placement(0, 1, 3, 4, "meshplan run")
    assert placement({"LOCAL_RANK": "2"}) == Placement(local_rank=2)
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4] and tasks_per_node("x") == []


def test_a_launch_over_nodes_must_have_the_plans_node_count():
    check_nodes(Placement(0, 2, 0, 2, "torchrun"), 2, 2)
    check_nodes(Placement(0, 1, 0, 4, "meshplan run"), 2, 2)     # one machine runs any plan
    check_nodes(Placement(), 2, 2)                               # the launcher does not say
    check_nodes(Placement(0, 4, 0, 1, "slurm"), None, None)      # an older build does not record it
    with pytest.raises(PlacementError, match=r"spans 4 nodes \(slurm\), but the plan was made for 2 node\(s\) of "
                                             r"2 processes.*--nodes 4"):
        check_nodes(Placement(0, 4, 0, 1, "slurm"), 2, 2)


def test_the_cuda_device_follows_what_the_task_can_see():
    # per-task binding: one visible GPU is cuda:0 whatever the local rank
    assert cuda_index({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1) == 0
    assert cuda_index({"SLURM_LOCALID": "2"}, 1) == 0
    # the node's GPUs visible: the local rank's
    assert cuda_index({"LOCAL_RANK": "3"}, 8) == 3
    assert cuda_index({"SLURM_LOCALID": "2"}, 4) == 2
    assert cuda_index({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 2) == 1
    assert cuda_index({}, 4) == 0
    with pytest.raises(PlacementError, match=r"local rank 2 of its node but sees 2 CUDA devices "
                                             r"\(CUDA_VISIBLE_DEVICES='0,1'\).*gpus-per-task=1"):
        cuda_index({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, 2)
    with pytest.raises(PlacementError, match="sees no CUDA device"):
        cuda_index({"LOCAL_RANK": "0"}, 0)


def _meet_all(n: int, signers: list[Signer], builds: list[str], *, timeout: float = 20.0, come=None,
              node_of=None, check=None, said: list | None = None) -> dict[int, object]:
    """Run participants 0 .. n-1 (those in `come`) in threads on one hosted store: index -> result or error."""
    hosted = host_store(LOOPBACK, 0, 30)
    out: dict[int, object] = {}

    def one(i: int) -> None:
        import datetime

        import torch.distributed as dist
        store = dist.TCPStore(LOOPBACK, hosted.port, None, False, timeout=datetime.timedelta(seconds=30),
                              wait_for_workers=False)
        m = Meeting(store, n, signers[i], f"{LOOPBACK}:{hosted.port}", timeout, node_of=node_of, check=check,
                    say=said.append if said is not None and i == 0 else None)
        try:
            out[i] = m.meet(Arrival(i, builds[i], i // 2, "h", 1, {"nproc": 2}))
        except JoinError as e:
            out[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in (come if come is not None else range(n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_meeting_names_a_rank_with_another_secret_or_build_on_every_participant():
    ok = _meet_all(3, [Signer("s")] * 3, ["b"] * 3)
    assert [a.index for a in ok[0]] == [0, 1, 2] and ok[1] is None and ok[2] is None
    out = _meet_all(4, [Signer("s"), Signer("s"), Signer("other"), Signer("s")], ["b"] * 4,
                    node_of=lambda r: r // 2)
    assert "rank 2 (node 1) runs with another MESHPLAN_JOB_SECRET than rank 0" in str(out[0])
    assert str(out[1]) == str(out[3]) == str(out[0])       # the verdict, as every rank with rank 0's secret reads it
    assert "this rank's MESHPLAN_JOB_SECRET differs from rank 0's" in str(out[2])
    out = _meet_all(2, [Signer("s")] * 2, ["b", "old"])
    assert all("rank 1 runs another build than rank 0" in str(out[i]) for i in (0, 1))


def test_a_missing_participant_is_named_after_the_timeout_and_waited_for_aloud(monkeypatch):
    monkeypatch.setattr(join_mod, "FIRST_SAY_S", 0.2)
    said: list[str] = []
    out = _meet_all(4, [Signer("s")] * 4, ["b"] * 4, timeout=1.5, come=[0, 1], node_of=lambda r: r // 2, said=said)
    assert all(isinstance(out[i], JoinError) for i in (0, 1))
    assert "ranks 2, 3 (node 1) did not join at 127.0.0.1:" in str(out[0]) and "--timeout 1.5 s" in str(out[0])
    assert said and said[0].startswith("waiting for 4 ranks at 127.0.0.1:") and "2 joined, missing ranks 2, 3" in said[0]


def test_the_nodes_of_a_launch_must_agree_with_each_other_and_the_plan():
    build = {"world_size": 4, "nodes": 2, "devices_per_node": 2}
    arrivals = [Arrival(i, "b", i, extra={"nnodes": 2, "nproc": 2}) for i in range(2)]
    assert _node_check(2, build)(arrivals) is None
    assert "the nodes disagree on NPROC_PER_NODE: node 0 has 2, node 1 has 1" in _node_check(2, build)(
        [arrivals[0], Arrival(1, "b", 1, extra={"nnodes": 2, "nproc": 1})])
    one = [Arrival(i, "b", i, extra={"nnodes": 2, "nproc": 1}) for i in range(2)]
    assert "start 2 processes, but the plan needs 4" in _node_check(2, build)(one)
    assert "the plan was made for 1 node(s) of 4" in _node_check(2, {"world_size": 4, "nodes": 1,
                                                                       "devices_per_node": 4})(arrivals)
    assert listed([2, 3], "rank", lambda r: r // 2) == "ranks 2, 3 (node 1)" and listed([1], "node") == "node 1"


def test_the_probe_names_the_ranks_that_do_not_share_a_directory(tmp_path):
    world = 3
    box: dict = {}
    barrier = threading.Barrier(world)

    def run(rank: int, dirs: list) -> None:
        def broadcast(values):
            if rank == 0:
                box["b"] = values
            barrier.wait()
            return box["b"]

        def all_gather(flags):
            box[rank] = flags
            barrier.wait()
            got = [box[r] for r in range(world)]
            barrier.wait()
            return got
        box[f"out{rank}"] = probe(dirs, rank, world, broadcast, all_gather)
    shared, local = tmp_path / "shared", tmp_path / "node1_local"
    local.mkdir()
    threads = [threading.Thread(target=run, args=(r, [shared, shared if r < 2 else local])) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [box[f"out{r}"] for r in range(world)] == [[[], [2]]] * 3
    assert list(shared.iterdir()) == [] and list(local.iterdir()) == []     # the probe files are gone


def test_a_diagnosis_blames_only_ranks_with_evidence_and_names_a_lost_store(monkeypatch):
    import os
    import signal
    import subprocess
    import time

    from runtime.launch import watchdog as wd_mod
    from runtime.launch.watchdog import Watchdog

    hosted = host_store(LOOPBACK, 0, 30)
    wds = [Watchdog(r, 3, LOOPBACK, hosted.port, lambda: (0, 0, "F s0 m0", "F"), interval=0.05,
                    signer=Signer("s"), store_owner="on rank 0's node (hosted by rank 0)") for r in range(3)]
    for w in wds[:2]:
        w._publish()
    # rank 2 never published a heartbeat and rank 1's does not move: only rank 1 is named
    stopped = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        store = wds[1]._store
        value = json.loads(wds[0].signer.verify(store.get("meshplan/heartbeat/1")))
        store.set("meshplan/heartbeat/1", wds[0].signer.sign(json.dumps({**value, "pid": stopped.pid})))
        found = wds[0].diagnose(window=0.1)
        assert found.startswith("rank 1 stopped responding") and "rank 2" not in found
        # rank 1's process is stopped on this host: it is killed as rank 0 exits, so that its launcher need
        # not wait for it
        assert stopped.poll() is None
        wds[0].end_stopped()
        assert stopped.wait(10) == -signal.SIGKILL
    finally:
        stopped.kill()
        stopped.wait()
    # the store's host is gone: the diagnosis names it, and no rank
    del hosted
    time.sleep(0.2)
    found = wds[0].diagnose(window=0.05)
    assert found.startswith(f"the rendezvous store at {LOOPBACK}:") and "on rank 0's node (hosted by rank 0)" in found
    assert "rank 1" not in found and "rank 2" not in found
    assert wd_mod.WAITING_OPS  # the module stays importable without side effects


def test_waiting_for_a_store_that_never_opens_says_so_and_gives_up(monkeypatch):
    from runtime.join import wait_for_port
    from tests.multinode_cases import free_port

    monkeypatch.setattr(join_mod, "FIRST_SAY_S", 0.1)
    port, said = free_port(), []
    with pytest.raises(JoinError, match=rf"nothing answers at 127.0.0.1:{port} after --timeout 1.5 s .*: waiting "
                                        "for rank 0's store; check MASTER_ADDR and MASTER_PORT"):
        wait_for_port("127.0.0.1", port, 1.5, said.append, "waiting for rank 0's store")
    assert said and said[0].startswith("waiting for rank 0's store (")
    hosted = host_store(LOOPBACK, 0, 5)
    wait_for_port(LOOPBACK, hosted.port, 5, None, "")   # returns at once when it answers
