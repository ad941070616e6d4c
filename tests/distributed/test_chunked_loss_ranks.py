"""The vocabulary-parallel chunked cross-entropy over gloo, 2 real processes (tests/chunked_loss_ranks.py):
loss, gradients and evaluation counts equal F.cross_entropy over the whole logits, with one
all_gather per forward or evaluation and one all_reduce per backward."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from runtime.launch.launcher import free_port
from runtime.lifetime import Children

WORLD = 2
TIMEOUT = 120.0


def test_vocabulary_parallel_chunked_loss_equals_cross_entropy_on_two_ranks(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(WORLD), GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    logs = [tmp_path / f"rank{r}.log" for r in range(WORLD)]
    with Children(stop_grace=5.0) as kids:
        procs = []
        for r in range(WORLD):
            with open(logs[r], "w") as log:
                procs.append(kids.popen([sys.executable, "-m", "tests.chunked_loss_ranks"], env=dict(env, RANK=str(r)),
                                        stdout=log, stderr=subprocess.STDOUT, cwd=root))
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline \
                and not any(p.poll() not in (None, 0) for p in procs):
            time.sleep(0.05)
        codes = [p.poll() for p in procs]
    outputs = [log.read_text() for log in logs]
    assert codes == [0] * WORLD, "\n".join(f"--- rank {r} (exit {c}):\n{o[-3000:]}"
                                           for r, (c, o) in enumerate(zip(codes, outputs)))
    assert [o.strip().splitlines()[-1] for o in outputs] == [f"rank {r}: ok" for r in range(WORLD)]
