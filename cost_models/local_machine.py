"""Measure this machine once, for the ``local`` cluster preset.

The ``local`` preset prices a plan that runs as N CPU processes on this machine
(talking through gloo over loopback TCP). Its figures are measured, never guessed:

- fp32 FLOP/s of one process: a 1024 x 1024 fp32 ``torch.mm`` on one thread.
- bf16 and fp16 FLOP/s of one process: the same ``torch.mm`` in that dtype, on a 256 x 256
  product first and 512 x 512 when that is quick (a CPU without 16-bit kernels runs them
  dozens of times slower than fp32; the figure says so, and the planner then keeps fp32).
- memory bandwidth (B/s) of one process: a 64 MiB tensor copy on one thread,
  counting the bytes read plus the bytes written.
- loopback TCP link: latency (s) from a 1-byte ping-pong, bandwidth (B/s) from a
  few MiB streamed one way, between two threads over a 127.0.0.1 socket.
- memory (bytes): total RAM, capped by a cgroup limit where one is set.

Each figure is the best of a few repeats (latency: the lowest of a few rounds' medians), and
every part stops repeating once its time budget is spent, so the whole measurement takes about
a second and well under 3 s. Results are cached as JSON in
``$MESHPLAN_CACHE_DIR/local_machine.json`` (default ``~/.cache/meshplan/``), keyed by
hostname, CPU count and torch version. Nothing runs at import time.

A machine busy with other work measures slow (on this project's 2-core VM a loopback latency of
41 us instead of about 3 us), and a cached busy reading would price every later plan. So a
measurement records how busy the machine was (``load_per_cpu``: the 1-minute load average per
usable CPU; ``latency_spread``: how far its latency rounds disagree), it counts as busy
(:func:`is_busy`) above BUSY_LOAD or BUSY_SPREAD, and the cache is measured again when its entry is stale (older than MAX_AGE_S),
implausible (a figure outside PLAUSIBLE), or busy and older than BUSY_RETRY_S; a busy entry
measured again keeps the better of the two readings of each figure (the machine did reach it),
so repeated readings converge on the quiet machine's. ``meshplan cluster local --remeasure``
measures now whatever the cache holds.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

CACHE_FILE_NAME = "local_machine.json"
CACHE_DIR_ENV = "MESHPLAN_CACHE_DIR"
# Bump when the meaning or the set of cached figures changes: older files re-measure.
CACHE_FORMAT_VERSION = 3   # 3: load_per_cpu and busy recorded (a busy reading is measured again)

# The figures a cache entry must hold, each a positive number, for it to be used.
_POSITIVE_FIGURES = (
    "fp32_flops",  # FLOP/s, one process on one thread
    "bf16_flops",  # FLOP/s, one process on one thread, bf16 torch.mm
    "fp16_flops",  # FLOP/s, one process on one thread, fp16 torch.mm
    "memory_bandwidth",  # B/s, one process on one thread, read + write bytes
    "memory_bytes",  # bytes, the whole machine
    "link_bandwidth",  # B/s, loopback TCP, one direction
    "link_latency",  # s, loopback TCP, one way
    "cpu_count",
    "usable_cpus",
)
# The figures that say which machine a cache entry belongs to.
_KEY_FIELDS = ("hostname", "cpu_count", "torch_version")
# What one process on a machine meshplan runs on can measure: a figure outside is a broken reading.
PLAUSIBLE = {
    "fp32_flops": (1e8, 1e13),        # FLOP/s: 0.1 GFLOP/s .. 10 TFLOP/s on one core
    "bf16_flops": (1e6, 1e14),        # a CPU without 16-bit kernels may run them far below 0.1 GFLOP/s
    "fp16_flops": (1e6, 1e14),
    "memory_bandwidth": (1e8, 1e12),  # B/s
    "link_bandwidth": (1e7, 1e12),    # B/s, loopback TCP
    "link_latency": (1e-7, 1e-3),     # s, one way: over a millisecond on loopback is a stalled machine
}
MAX_AGE_S = 30 * 86400   # an entry older than this is measured again (s)
BUSY_LOAD = 1.0          # load average per usable CPU above which a measurement is taken as busy
BUSY_SPREAD = 2.0        # ... or latency rounds whose medians differ by more than this factor
BUSY_RETRY_S = 600.0     # a busy entry is measured again once it is this old (s)
# Figures where the higher reading is the machine's (rates); the link latency is the lower one.
_HIGHER_IS_BETTER = ("fp32_flops", "bf16_flops", "fp16_flops", "memory_bandwidth", "link_bandwidth")


def default_cache_dir() -> Path:
    """The cache folder: ``$MESHPLAN_CACHE_DIR`` if set, else ``~/.cache/meshplan``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "meshplan"


def machine_key() -> dict[str, Any]:
    """Hostname, ``os.cpu_count()`` and torch version: what a cache entry is valid for.

    The torch version is read from the package metadata so that a cache hit does not
    have to import torch.
    """
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # an uninstalled (source) build of torch has no metadata
        import torch

        torch_version = torch.__version__
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count() or 1,
        "torch_version": torch_version,
    }


def measure_local_machine() -> dict[str, Any]:
    """Measure this machine now and return a flat dict of its figures.

    Keys (units): ``hostname``, ``cpu_count`` (``os.cpu_count()``), ``usable_cpus``
    (CPUs this process may run on), ``torch_version``, ``cpu_model``,
    ``fp32_flops`` (FLOP/s, one process on one thread), ``bf16_flops`` and ``fp16_flops``
    (FLOP/s of a 16-bit ``torch.mm``, one process on one thread), ``memory_bandwidth`` (B/s,
    one thread, read + write bytes), ``memory_bytes`` (bytes, whole machine),
    ``link_bandwidth`` (B/s, loopback TCP, one direction), ``link_latency`` (s,
    loopback TCP, one way), ``measured_at`` (UTC, ISO 8601), ``measure_seconds`` (s,
    how long the measuring took, not counting the import of torch), ``format_version``,
    ``load_per_cpu`` (the 1-minute load average per usable CPU before measuring; -1 where the
    system has none) and ``latency_spread`` (the highest latency round's median over the lowest's,
    1 on a quiet machine): :func:`is_busy` reads them.
    """
    # Import torch first: its one-off import cost (about a second) is not measurement.
    import torch  # noqa: F401

    start = time.perf_counter()
    figures: dict[str, Any] = {"format_version": CACHE_FORMAT_VERSION, **machine_key()}
    figures["usable_cpus"] = _usable_cpus()
    figures["load_per_cpu"] = _load_per_cpu(figures["usable_cpus"])
    figures["cpu_model"] = _cpu_model()
    figures["memory_bytes"] = _total_memory_bytes()
    figures["fp32_flops"], figures["memory_bandwidth"] = _measure_compute_and_memory()
    figures["bf16_flops"], figures["fp16_flops"] = _measure_low_precision()
    figures["link_latency"], figures["link_bandwidth"], figures["latency_spread"] = _measure_loopback_tcp()
    figures["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    figures["measure_seconds"] = time.perf_counter() - start
    return figures


def load_or_measure(cache_dir: str | os.PathLike[str] | None = None, *, remeasure: bool = False) -> dict[str, Any]:
    """This machine's figures from the cache, measuring (and caching) them if needed.

    ``cache_dir`` defaults to :func:`default_cache_dir`. The cache is used only if it
    parses, holds every figure as a positive number, its hostname, CPU count and torch
    version match this machine, and it needs no new reading (:func:`why_remeasure`: stale,
    implausible, or busy); otherwise, or with ``remeasure``, the machine is measured again
    and the file rewritten (atomically, so ranks starting together never read half a file).
    A busy entry measured again keeps the better reading of each figure (:func:`best_of`).
    Returns the dict described in :func:`measure_local_machine`.
    """
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / CACHE_FILE_NAME
    cached = _read_cache(path)
    if cached is not None and not all(cached.get(k) == v for k, v in machine_key().items()):
        cached = None   # another machine's (or another torch's) figures
    if cached is not None and not remeasure and why_remeasure(cached) is None:
        return cached
    figures = measure_local_machine()
    if cached is not None and not remeasure and is_busy(cached):
        figures = best_of(cached, figures)
    _write_cache(path, figures)
    return figures


def why_remeasure(figures: dict[str, Any], now: float | None = None) -> str | None:
    """Why a cached entry of this machine must be measured again ("stale", "implausible ...",
    "busy"), or None to use it. `now`: the time (s since the epoch) to judge its age by."""
    now = time.time() if now is None else now
    age = now - _epoch(figures.get("measured_at"))
    if age > MAX_AGE_S:
        return "stale"
    for name, (low, high) in PLAUSIBLE.items():
        if not low <= figures[name] <= high:
            return f"implausible {name} {figures[name]:.3g} (expected {low:g} .. {high:g})"
    if is_busy(figures) and age > BUSY_RETRY_S:
        return "busy"
    return None


def is_busy(figures: dict[str, Any]) -> bool:
    """Whether a measurement was taken on a busy machine (entries from before these were recorded: no)."""
    return figures.get("load_per_cpu", 0) > BUSY_LOAD or figures.get("latency_spread", 1) > BUSY_SPREAD


def best_of(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` with each rate the higher and the link latency the lower of two readings of this machine:
    a busy machine only slows a figure down, so the better reading is the closer one. (How busy the
    machine was stays `new`'s: called for a busy `old`, the result is busy only if both were.)"""
    out = dict(new)
    for name in _HIGHER_IS_BETTER:
        out[name] = max(old[name], new[name])
    out["link_latency"] = min(old["link_latency"], new["link_latency"])
    return out


def _epoch(stamp: Any) -> float:
    """Seconds since the epoch of a ``measured_at`` stamp (0 when missing or unreadable: stale)."""
    import calendar

    try:
        return float(calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return 0.0


# --- cache file ---------------------------------------------------------------------


def _read_cache(path: Path) -> dict[str, Any] | None:
    """The cached dict, or None if the file is missing, unreadable or incomplete."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format_version") != CACHE_FORMAT_VERSION:
        return None
    for name in _POSITIVE_FIGURES:
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            return None
    if not all(isinstance(data.get(name), str) for name in ("hostname", "torch_version")):
        return None
    return data


def _write_cache(path: Path, figures: dict[str, Any]) -> None:
    """Write ``figures`` to ``path`` atomically; warn (don't fail) if that is impossible."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".local_machine.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(figures, f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        # The figures are still good for this process; only the reuse is lost.
        warnings.warn(
            f"could not cache the local machine figures in {path} ({e}); they will be "
            f"measured again next time. Set {CACHE_DIR_ENV} to a writable folder.",
            stacklevel=3,
        )


# --- machine facts --------------------------------------------------------------------


def _load_per_cpu(cpus: int) -> float:
    """The 1-minute load average per usable CPU (how busy the machine is now); -1 where unknown."""
    try:
        return os.getloadavg()[0] / max(cpus, 1)
    except (AttributeError, OSError):   # no load average on this system
        return -1.0


def _usable_cpus() -> int:
    """CPUs this process may run on (affinity mask, e.g. under taskset or a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _total_memory_bytes() -> int:
    """Physical RAM in bytes, capped by a cgroup v2 memory limit if one is set."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    if total <= 0:
        with open("/proc/meminfo") as f:  # "MemTotal:  24683656 kB"
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    try:
        # In a container the RAM we may use can be far less than the host's.
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


# --- measurements ---------------------------------------------------------------------


def _best_time(fn, *, repeats: int, budget_s: float) -> float:
    """Best wall time (s) of ``fn()`` over up to ``repeats`` calls, after one warm-up;
    stops early once ``budget_s`` seconds are spent (always at least one timed call)."""
    fn()  # warm-up: page faults, kernel selection, lazy init
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return best


def _measure_compute_and_memory() -> tuple[float, float]:
    """(fp32 FLOP/s, memory B/s) of one process on one thread."""
    import torch

    threads = torch.get_num_threads()
    # One thread: each rank of the local cluster is one process on (ideally) one core.
    torch.set_num_threads(1)
    try:
        n = 1024
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        c = torch.empty(n, n)
        mm_s = _best_time(lambda: torch.mm(a, b, out=c), repeats=5, budget_s=0.4)
        flops = 2 * n**3 / mm_s  # n^2 outputs, each n multiply-adds

        numel = 64 * 2**20 // 4  # 64 MiB of fp32: far bigger than any CPU cache
        src = torch.ones(numel)
        dst = torch.zeros(numel)  # zeros, not empty: touch the pages before timing
        copy_s = _best_time(lambda: dst.copy_(src), repeats=5, budget_s=0.3)
        bandwidth = 2 * src.nbytes / copy_s  # every byte is read once and written once
    finally:
        torch.set_num_threads(threads)
    return flops, bandwidth


def _measure_low_precision() -> tuple[float, float]:
    """(bf16 FLOP/s, fp16 FLOP/s) of one process on one thread.

    A 256 x 256 product first: some CPUs have no fp16 kernels, and a 1024 x 1024 fp16 product
    there takes seconds. When one 256 product takes under 2 ms, a 512 product is timed instead,
    closer to the fp32 figure's size."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = []
        for dtype in (torch.bfloat16, torch.float16):
            n = 256
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            seconds = _best_time(lambda: torch.mm(a, b), repeats=3, budget_s=0.15)
            if seconds < 2e-3:
                n = 512
                a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
                seconds = _best_time(lambda: torch.mm(a, b), repeats=3, budget_s=0.2)
            rates.append(2 * n**3 / seconds)
    finally:
        torch.set_num_threads(threads)
    return rates[0], rates[1]


def _measure_loopback_tcp() -> tuple[float, float, float]:
    """(one-way latency s, one-direction bandwidth B/s, spread) of TCP over 127.0.0.1.

    gloo talks TCP even between processes on one host, so this is the link between
    two local ranks. Two threads stand in for two processes: socket calls release
    the GIL, so the threads do run concurrently. The latency is the lowest of a few
    rounds' medians (a round the machine spent busy elsewhere reads high); `spread` is
    the highest round's median over the lowest (near 1 on a quiet machine).
    """
    rounds = 4  # of `pings` round trips each
    pings = 50  # 1-byte round trips per round; a loopback round trip is tens of microseconds
    chunk = 1 << 20  # 1 MiB per send
    stream_bytes = 32 * chunk  # per bandwidth repeat: ~10 ms at loopback speeds
    stream_repeats = 3

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5.0)
    errors: list[BaseException] = []

    def peer() -> None:
        # Echo every ping, then acknowledge each streamed block once it fully arrived.
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5.0)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(pings * rounds):
                    conn.sendall(_recv_exactly(conn, 1))
                buf = bytearray(chunk)
                for _ in range(stream_repeats):
                    left = stream_bytes
                    while left:
                        got = conn.recv_into(buf, min(left, chunk))
                        if not got:
                            raise ConnectionError("loopback peer closed early")
                        left -= got
                    conn.sendall(b"k")
        except BaseException as e:  # surfaced in the measuring thread below
            errors.append(e)

    thread = threading.Thread(target=peer, name="meshplan-loopback-peer", daemon=True)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=5.0) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            medians = []
            for _ in range(rounds):
                round_trips = []
                for _ in range(pings):
                    t0 = time.perf_counter()
                    sock.sendall(b"p")
                    _recv_exactly(sock, 1)
                    round_trips.append(time.perf_counter() - t0)
                # Median within a round, not best: a small message's latency is what it usually costs.
                medians.append(statistics.median(round_trips))
            latency = min(medians) / 2

            payload = bytes(chunk)
            best = float("inf")
            for _ in range(stream_repeats):
                t0 = time.perf_counter()
                for _ in range(stream_bytes // chunk):
                    sock.sendall(payload)
                _recv_exactly(sock, 1)  # the peer has every byte
                best = min(best, time.perf_counter() - t0)
        thread.join(timeout=5.0)
    finally:
        listener.close()
    if errors:
        raise RuntimeError(f"loopback TCP measurement failed: {errors[0]!r}") from errors[0]
    # The ack's own trip is latency, not bandwidth: take it out (never below a tenth).
    bandwidth = stream_bytes / max(best - latency, best / 10)
    return latency, bandwidth, max(medians) / min(medians)


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    """Receive exactly ``nbytes`` bytes from ``sock``."""
    data = b""
    while len(data) < nbytes:
        part = sock.recv(nbytes - len(data))
        if not part:
            raise ConnectionError("loopback peer closed early")
        data += part
    return data
