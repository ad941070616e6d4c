"""Hosting a rendezvous TCPStore on one network address only.

torch's TCPStore server listens on every interface of the machine. A store
hosted here listens on a socket bound to the address it is given instead
(torch accepts an already listening socket through `master_listen_fd`): a
local run binds 127.0.0.1, which no other host can reach; a multi-node run
binds the address its launcher names (MASTER_ADDR).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"
BIND_ENV = "MESHPLAN_STORE_BIND"   # where a rank that hosts the store listens (default: MASTER_ADDR)
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


class StoreBindError(ValueError):
    """The store cannot listen on the address and port it was given."""


@dataclass
class HostedStore:
    """A listening TCPStore (it owns the listening socket and closes it when it is dropped)."""

    store: object
    address: str
    port: int


def bound_socket(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address`:`port` only (port 0: a free one)."""
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise StoreBindError(f"cannot resolve the store address {address!r}: {e}") from None
    family, _t, _p, _c, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(4096)
    except OSError as e:
        sock.close()
        raise StoreBindError(f"cannot listen on {address}:{port} for the rendezvous store ({e.strerror or e}); "
                             "choose another port (--master-port / MASTER_PORT) or address") from None
    sock.set_inheritable(False)
    return sock


def listen_address(master_addr: str, environ: dict | None = None) -> str:
    """Where a rank that hosts the store listens: MESHPLAN_STORE_BIND if set, else `master_addr`.

    A host name that resolves to a loopback address on this node (Debian's /etc/hosts maps the
    machine's own name to 127.0.1.1) while other nodes reach it by its real address cannot be
    bound: then every interface is used, as torch does (the messages stay authenticated).
    """
    import os

    env = os.environ if environ is None else environ
    if env.get(BIND_ENV):
        return env[BIND_ENV]
    if master_addr in _LOOPBACK_NAMES:
        return master_addr
    try:
        resolved = {i[4][0] for i in socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return master_addr  # bound_socket names the error
    if any(a.startswith("127.") or a == "::1" for a in resolved):
        return ALL_INTERFACES
    return master_addr


def host_store(address: str, port: int, timeout: float, world_size: int | None = None) -> HostedStore:
    """A TCPStore server on `address`:`port` only. `timeout`: seconds a store operation may wait."""
    import torch.distributed as dist

    sock = bound_socket(address, port)
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(address, port, world_size, True, timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor when it is destroyed
    return HostedStore(store, address, port)
