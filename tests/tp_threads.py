"""Run a function on several ranks as threads of this process, with real gloo groups.

Used by unit tests of the tensor-parallel layers and of the graph rewrite: the
collectives are real (runtime.comm.torch_dist.TorchCommunicator over a TCPStore on
localhost), only the processes are threads.
"""

from __future__ import annotations

import threading

from runtime.comm.torch_dist import TorchCommunicator
from runtime.launch.launcher import free_port


def run_ranks(world: int, fn, timeout: float = 120.0) -> list:
    """[fn(rank, group) for each rank], the group spanning all ranks."""
    port = free_port()
    results: list = [None] * world
    errors: list = []

    def target(r: int) -> None:
        try:
            comm = TorchCommunicator("gloo", r, world, "127.0.0.1", port, timeout=60)
            try:
                results[r] = fn(r, comm.group(tuple(range(world))))
                comm.barrier()
            finally:
                comm.shutdown()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append((r, e))

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0][1]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a rank thread did not finish")
    return results
