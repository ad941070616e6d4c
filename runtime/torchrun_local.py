"""torchrun for one node, its rendezvous store listening on 127.0.0.1 only.

    python -m runtime.torchrun_local --nproc-per-node=N SCRIPT [ARGS...]

torchrun's own one-node modes host their store on every interface: --standalone (two stores, the
c10d rendezvous' and the workers' shared one) and a static rendezvous on --master-addr 127.0.0.1 alike,
since torch's TCPStore server binds the wildcard address whatever host it is given. This runs
torchrun itself (torch.distributed.run.main, every option of it) with one more rendezvous backend,
"meshplan-loopback", and --nnodes=1 --rdzv-backend=meshplan-loopback: the agent hosts the one store on
a socket bound to 127.0.0.1 (runtime/comm/store_host.py), and the workers reach it there as torchrun's
agent store (TORCHELASTIC_USE_AGENT_STORE). The generated launch_torchrun.sh uses it for one node;
several nodes keep torchrun's c10d rendezvous on MASTER_ADDR.
"""

from __future__ import annotations

import sys

from runtime.comm.store_host import LOOPBACK, host_store

BACKEND = "meshplan-loopback"


def _handler(params):
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        """torchrun's static rendezvous of one node, its store hosted on 127.0.0.1 only."""

        hosted = None

        def get_backend(self) -> str:
            return BACKEND

        def next_rendezvous(self):
            if self.hosted is None:
                self.hosted = host_store(LOOPBACK, self.master_port, self.timeout.total_seconds())
                self._store, self.master_port = self.hosted.store, self.hosted.port
            return RendezvousInfo(PrefixStore(self.run_id, self._store), 0, 1,
                                  RendezvousStoreInfo(LOOPBACK, self.master_port))

    port = int(params.endpoint.rpartition(":")[2] or 0) if params.endpoint else 0
    timeout = int(params.config.get("timeout", 600))
    return LoopbackRendezvous(LOOPBACK, port, 0, 1, params.run_id, timeout)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun

    rendezvous_handler_registry.register(BACKEND, _handler)
    torchrun(["--nnodes=1", f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={LOOPBACK}:0", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
