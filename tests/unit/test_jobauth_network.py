"""The run's messages are signed with a per-job secret, and a hosted store listens on one address only."""

import datetime
import socket

import pytest
import torch.distributed as dist

from runtime.comm import ABORT_KEY, read_abort
from runtime.comm.jobauth import SECRET_ENV, Signer, new_secret, signer_from_env
from runtime.lifetime import process_state
from runtime.comm.store_host import LOOPBACK, StoreBindError, bound_socket, host_store


def test_signed_values_verify_only_with_the_same_secret():
    a, b = Signer(new_secret()), Signer(new_secret())
    value = a.sign("rank 1 failed: out of memory | with a bar")
    assert a.verify(value) == "rank 1 failed: out of memory | with a bar"
    assert a.verify(value.encode()) == "rank 1 failed: out of memory | with a bar"
    assert b.verify(value) is None
    assert a.verify("rank 1 failed: fake") is None
    assert a.verify(value.replace("memory", "disk")) is None
    assert len(new_secret()) == 64 and new_secret() != new_secret()
    assert signer_from_env({SECRET_ENV: "s3"}) == Signer("s3") and not signer_from_env({}).authenticated


def test_a_forged_failure_reason_is_ignored_logged_and_removed(capsys):
    store, me = dist.HashStore(), Signer(new_secret())
    assert read_abort(store, me, 0) is None
    store.set(ABORT_KEY, "rank 0 failed: posted by someone else")
    assert read_abort(store, me, 3) is None
    err = capsys.readouterr().err
    assert "meshplan rank 3: warning: ignored a failure message" in err and "fails authentication" in err
    assert "posted by someone else" in err and SECRET_ENV in err
    assert not store.check([ABORT_KEY]), "removed, so that the real reason can still be published"
    store.compare_set(ABORT_KEY, "", me.sign("rank 2 failed: real"))
    assert read_abort(store, me, 0) == "rank 2 failed: real"


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine other than 127.x, or None."""
    candidates = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            candidates.append(s.getsockname()[0])
        except OSError:
            pass
    try:
        candidates += [i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    return next((a for a in candidates if not a.startswith("127.") and a != "0.0.0.0"), None)


def refused_from(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect((address, port))
        except (ConnectionRefusedError, socket.timeout):
            return True
        return False


def test_a_hosted_store_answers_on_loopback_and_refuses_other_addresses():
    other = non_loopback_address()
    if other is None:
        pytest.skip("this machine has no network address besides loopback to connect from")
    hosted = host_store(LOOPBACK, 0, timeout=10)
    client = dist.TCPStore(LOOPBACK, hosted.port, None, False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert hosted.store.get("k") == b"v"
    assert refused_from(other, hosted.port)


def test_a_port_in_use_is_a_clear_error():
    with bound_socket(LOOPBACK, 0) as taken:
        with pytest.raises(StoreBindError, match="cannot listen on 127.0.0.1:.*choose another port"):
            bound_socket(LOOPBACK, taken.getsockname()[1])
    with pytest.raises(StoreBindError, match="cannot resolve"):
        bound_socket("no-such-host.invalid", 0)


def test_process_state_tells_stopped_from_running():
    import os
    import signal
    import subprocess
    import sys
    import time

    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this system")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(p.pid) == "running"
        p.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(p.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert process_state(p.pid) == "stopped"
    finally:
        p.kill()
        p.wait()
    assert process_state(p.pid) is None


def test_parent_death_signal_is_set_on_linux():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from runtime.lifetime import set_parent_death_signal as s; "
                          "print(s())"], capture_output=True, text=True, timeout=60).stdout.strip()
    assert out == str(sys.platform.startswith("linux"))


def test_launch_scripts_pass_a_job_secret_in_the_environment_only(tmp_path):
    import os
    import subprocess
    import sys

    from tests.parallel_cases import emit_case

    build = emit_case(tmp_path, "mlp", "d2", dict(data=2))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = '#!/bin/sh\necho "SECRET=${MESHPLAN_JOB_SECRET:-}"\necho "ARGS=$*"\n'
    for name in ("torchrun", "mpirun", "srun", "scontrol"):
        (bin_dir / name).write_text(stub)
        (bin_dir / name).chmod(0o755)
    # one node's torchrun is `$PYTHON -m runtime.torchrun_local`: stubbed there, the rest is this Python
    python = bin_dir / "python"
    python.write_text(stub.replace("#!/bin/sh\n", '#!/bin/sh\nif [ "$2" != runtime.torchrun_local ]; then exec '
                                   f'{sys.executable} "$@"; fi\n'))
    python.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, "NNODES", "MESHPLAN_BUILD")}
    base.update(PATH=f"{bin_dir}{os.pathsep}{base.get('PATH', '')}", MASTER_ADDR="127.0.0.1", PYTHON=str(python))

    def launch(script, **env):
        p = subprocess.run(["bash", str(build / script), "--steps", "1"], env={**base, **env}, capture_output=True,
                           text=True, timeout=60)
        return p.returncode, p.stdout, p.stderr

    secrets_seen = set()
    for script in ("launch_torchrun.sh", "launch_mpirun.sh", "launch_srun.sh"):
        rc, out, err = launch(script)
        assert rc == 0, err
        secret = out.split("SECRET=")[1].split()[0]
        assert len(secret) == 64 and secret not in out.split("ARGS=")[1], script
        secrets_seen.add(secret)
        assert launch(script, MESHPLAN_JOB_SECRET="mine")[1].startswith("SECRET=mine\n"), script
    assert len(secrets_seen) == 3, "a fresh secret per job"
    assert "-x MESHPLAN_JOB_SECRET" in launch("launch_mpirun.sh")[1]
    rc, _out, err = launch("launch_torchrun.sh", NNODES="2", NODE_RANK="0")
    assert rc != 0 and "set the same MESHPLAN_JOB_SECRET on every node" in err


def test_a_rank_hosting_the_store_listens_where_the_launcher_says():
    from runtime.comm.store_host import ALL_INTERFACES, BIND_ENV, listen_address

    assert listen_address("127.0.0.1", {}) == "127.0.0.1"
    assert listen_address("localhost", {}) == "localhost"
    assert listen_address("node7", {BIND_ENV: "10.1.2.3"}) == "10.1.2.3"
    assert listen_address("192.0.2.10", {}) == "192.0.2.10"
    # a name that resolves to loopback here but is how other nodes reach this one: every interface
    name = socket.gethostname()
    resolved = {i[4][0] for i in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    expected = ALL_INTERFACES if any(a.startswith("127.") or a == "::1" for a in resolved) else name
    assert listen_address(name, {}) == expected


class _GonePeerGroup:
    """A process group whose peer has already exited: gloo raises while queueing the work."""

    def send(self, tensors, peer, tag):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")

    recv = send

    def allreduce(self, tensors, opts):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")


def test_a_peer_gone_before_the_work_is_queued_is_read_as_that_peers_failure():
    import torch

    from runtime.comm import PeerFailure
    from runtime.comm.torch_dist import TorchCommunicator, _TorchGroup

    with bound_socket(LOOPBACK, 0) as s:
        port = s.getsockname()[1]
    comm = TorchCommunicator("gloo", 0, 1, LOOPBACK, port, timeout=10, signer=Signer(new_secret()))
    try:
        real, comm._world_pg = comm._world_pg, _GonePeerGroup()
        reason = "rank 1 failed at step 2: the loss is nan"
        comm.store.compare_set(ABORT_KEY, "", comm.signer.sign(reason))
        t = torch.zeros(2)
        for post in (lambda: comm.isend(t, 1, 3), lambda: comm.irecv(t, 1, 3),
                     lambda: _TorchGroup(comm, (0, 1), _GonePeerGroup()).all_reduce(t)):
            with pytest.raises(PeerFailure, match="the loss is nan"):
                post()
        comm._world_pg = real
    finally:
        comm.shutdown()
