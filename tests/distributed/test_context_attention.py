"""Context-parallel attention on real processes (gloo, 2 and 4 ranks): each rank's output and the
gradients of its q, k and v equal the matching rows of full-sequence attention on one process
(fp32), for ring and Ulysses, causal and unmasked, 16 and 32 tokens, and grouped-query attention
(2 and 1 key/value heads for 4 query heads; Ulysses on 4 ranks with 2 key heads repeats them).

With 4 ranks and 16 tokens a chunk is 2 tokens, so every causal case crosses chunk borders; a wrong
block skip, a wrong diagonal mask or a key/value gradient returned to the wrong rank changes the
rows of some rank.
"""

import pytest
import torch

from runtime.parallel.context.layout import chunk_layout
from tests.context_cases import Case, reference, run_cases

CASES = [Case(mode, causal, t) for mode in ("ring", "ulysses") for causal in (True, False) for t in (16, 32)] + [
    Case("ring", True, 32, kv_heads=2),
    Case("ring", True, 16, kv_heads=1),
    Case("ulysses", True, 32, kv_heads=2),
]
DEGREES = (2, 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {d: run_cases(CASES, d, tmp_path_factory.mktemp(f"context{d}")) for d in DEGREES}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("degree", DEGREES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_context_attention_equals_full_attention(results, degree, case):
    want = reference(case)
    for rank, got in enumerate(results[degree][case.name]):
        layout = chunk_layout(case.seq_len, degree, rank)
        for name, full in want.items():
            torch.testing.assert_close(got[name], layout.take(full, 2), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{case.name} degree {degree} rank {rank} {name}: {m}")
