"""Two nodes on one host over loopback (tests/multinode_cases.py): two torchrun agents through
launch_torchrun.sh, and launch_srun.sh through an srun stand-in. The runs equal the
single-process run with rank 0 on node 0; each wrong setup is refused on every node naming its
cause; a lost node, the store's host or not, stops the survivors naming it.

Launches that do not depend on each other run at the same time (each on its own port and
output directory) to keep the file's run time down on a 2-core machine."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from planner.app.compare import measured_steps
from runtime.verify import verify_build
from tests.multinode_cases import Node, base_env, emit_nodes, free_port, wait_for_lines, write_tools
from tests.parallel_cases import CONFIGS, emit_case


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    return {"two": emit_nodes(root / "two_nodes"), "one": emit_case(root, "mlp", "d2p2", CONFIGS["d2p2"])}


def _losses(out: Path) -> dict[int, list[float]]:
    return {r: json.loads((out / "run" / f"rank_{r:04d}.json").read_text())["losses"] for r in range(4)}


def _run_all(nodes: list[Node], timeout: float = 120) -> None:
    try:
        for n in nodes:
            n.wait(timeout)
    finally:
        for n in nodes:
            n.close()


def test_two_torchrun_nodes_and_srun_train_like_one_process_with_rank_0_on_node_0(builds, tmp_path):
    build = builds["two"]
    args = ["--steps", "3", "--save-params", "--save-steps", "--timeout", "60"]
    port = free_port()
    torchrun = [Node.torchrun(build, k, port, args, tmp_path / f"node{k}.log") for k in (0, 1)]
    # at the same time: srun on 2 nodes of 2 tasks (the plan's), the port from the job id, the build (a copy
    # of its own, for its results) found from the submit directory
    copy = Path(shutil.copytree(build, tmp_path / "srun_build"))
    bin_dir = write_tools(tmp_path / "bin")
    job_port = free_port(20000, 40000)
    env = base_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=str(job_port - 20000),
                   SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[0-1]", SLURM_SUBMIT_DIR=str(copy))
    text = (build / "launch_srun.sh").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=2" in text
    # sbatch runs a copy of the script from its spool directory, and the path written in it is gone
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "slurm_script").write_text(text.replace(str(build.resolve()), str(tmp_path / "gone")))
    srun = Node(["bash", str(spool / "slurm_script"), *args], env, tmp_path / "srun.log", "srun")
    _run_all([*torchrun, srun])

    assert [n.proc.returncode for n in torchrun] == [0, 0], torchrun[0].text()[-3000:] + torchrun[1].text()[-3000:]
    cmp = verify_build(build, 3, _losses(build))
    assert cmp.ok, cmp.summary()
    # rank 0, and with it the progress display and metrics, is on the node started as node 0
    assert "step 2 (3/3, 100%)" in torchrun[0].text() and "step 2 (3/3" not in torchrun[1].text()
    # rank 0 merged the ranks' timelines: `meshplan compare` reads the run
    timeline, kept = measured_steps(build)
    assert set(timeline.ranks) == {0, 1, 2, 3} and sorted(kept) == [1, 2] and (build / "trace.json").is_file()

    assert srun.proc.returncode == 0, srun.text()[-4000:]
    assert (bin_dir / "srun.log").read_text() == f"127.0.0.1:{job_port} nodes=2 tasks=4\n"
    cmp = verify_build(copy, 3, _losses(copy))
    assert cmp.ok, cmp.summary()
    assert (copy / "trace.json").is_file(), "rank 0 merged the ranks' timelines"


def test_each_wrong_setup_is_refused_on_every_node_naming_its_cause(builds, tmp_path):
    two, one = builds["two"], builds["one"]
    args = ["--steps", "2", "--timeout", "60"]
    ports = [free_port() for _ in range(4)]
    launches = {
        "secrets": [Node.torchrun(two, k, ports[0], args, tmp_path / f"secrets{k}.log", secret=s * 64)
                    for k, s in ((0, "a"), (1, "b"))],
        "plan": [Node.torchrun(one, k, ports[1], args, tmp_path / f"plan{k}.log") for k in (0, 1)],
        "late": [Node.torchrun(two, 0, ports[2], ["--steps", "2", "--timeout", "5"], tmp_path / "late0.log")],
        "ckpt": [Node.torchrun(two, k, ports[3], [*args, "--out", str(tmp_path / "out"),
                                                  "--checkpoint-dir", str(tmp_path / f"ckpt_node{k}")],
                               tmp_path / f"ckpt{k}.log") for k in (0, 1)],
    }
    _run_all([n for ns in launches.values() for n in ns])
    for name, ns in launches.items():
        assert all(n.proc.returncode != 0 for n in ns), name
    n0, n1 = (n.text() for n in launches["secrets"])
    assert "node 1 runs with another MESHPLAN_JOB_SECRET than node 0" in n0, n0
    assert "this node's MESHPLAN_JOB_SECRET differs from node 0's" in n1, n1
    for n in launches["plan"]:
        assert "this launch has 2 nodes, but the plan was made for 1 node(s) of 4 processes" in n.text(), n.text()
    late = launches["late"][0].text()
    assert f"waiting for 2 nodes at 127.0.0.1:{ports[2]}: 1 joined, missing node 1" in late, late
    assert f"node 1 did not join at 127.0.0.1:{ports[2]} within --timeout 5 s" in late, late
    for k, n in enumerate(launches["ckpt"]):
        assert (f"the checkpoint directory {tmp_path / f'ckpt_node{k}'} is not shared by all ranks: ranks 2, 3 "
                "(node 1) do not see the file rank 0 wrote there") in n.text(), n.text()[-3000:]
        assert not any((tmp_path / f"ckpt_node{k}").glob("step_*")), "refused before the first save"
        assert "traceback : meshplan rank" in n.text(), "torchrun's summary names the cause"


def test_a_lost_node_stops_the_survivors_naming_it_whether_it_hosts_the_store_or_not(builds, tmp_path):
    build = builds["two"]
    runs = {}
    for lost in ("worker", "store"):   # two runs at once, each on its port and output directory
        port, out = free_port(), tmp_path / f"out_{lost}"
        nodes = [Node.torchrun(build, k, port, ["--steps", "100000", "--out", str(out)],
                               tmp_path / f"{lost}_node{k}.log") for k in (0, 1)]
        runs[lost] = (port, out, nodes)
    try:
        for lost, (port, out, nodes) in runs.items():
            assert wait_for_lines(out / "metrics.jsonl", 3, 180, nodes), nodes[0].text()[-2000:] + nodes[1].text()[-2000:]
            victim, survivor = (nodes[1], nodes[0]) if lost == "worker" else (nodes[0], nodes[1])
            victim.kill_all()
        for lost, (port, out, nodes) in runs.items():
            survivor = nodes[0] if lost == "worker" else nodes[1]
            survivor.wait(60)
            assert survivor.proc.returncode != 0 and survivor.pids() == [], "the survivors stop, nothing is left"
    finally:
        for _port, _out, nodes in runs.values():
            for n in nodes:
                n.close()
    text = runs["worker"][2][0].text()
    assert "stopping because another rank failed: rank 2 stopped responding" in text, text[-3000:]
    assert "rank 0 stopped responding" not in text and "rank 1 stopped responding" not in text
    assert "traceback : meshplan rank" in text, "torchrun's summary names the cause"
    port, text = runs["store"][0], runs["store"][2][1].text()
    assert (f"stopping because another rank failed: the rendezvous store at 127.0.0.1:{port}, on rank 0's node "
            "(hosted by torchrun's agent), is gone") in text, text[-3000:]
    assert "stopped responding" not in text, "no rank is blamed without evidence of its own"
    assert "traceback : meshplan rank" in text, "torchrun's summary names the cause"
