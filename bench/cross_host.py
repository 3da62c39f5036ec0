"""tether's TCP data plane against the rpc peer forced onto TCP, over loopback and over a veth link.

What "cross-host" means here: the client and the shards (or the peer's trainer and servers) talk
over TCP only, never shared memory. tether's client uses ``transport="tcp"`` (checked after each
measurement: a silent fallback to gRPC or shared memory fails the run); the peer is the
``torch.distributed.rpc`` parameter server of ``bench/rpc_peer.py`` with TensorPipe forced onto
TCP (``_transports=["uv"], _channels=["basic"]``). Links:

- ``loopback``: every process in this network namespace, on 127.0.0.1.
- ``veth``: the benchmark makes two network namespaces joined by a veth pair (``ip netns add``,
  ``ip link add ... type veth peer ...``, 10.213.0.1 and .2); the shards / the peer's servers run
  in one (``ip netns exec``), the client / the peer's trainer in the other. The kernel still
  moves the bytes between two processes of this machine, through a real network device
  (segmentation, qdisc, no loopback shortcuts).
- ``RATEgbit[:RTTus]`` (e.g. ``10gbit:100us``): the veth link shaped with ``tc qdisc ... tbf rate``
  on both ends and, where the kernel has ``sch_netem``, ``netem delay RTT/2`` on each end. Without
  netem the RTT is the veth's own and the run says so. Dense throughput is also given as a
  fraction of the link's rate (push and pull take turns, so one direction is busy at a time).

The namespaces are removed whatever happens (``finally``); without the rights to make them
(``ip netns add`` fails: not root, no CAP_SYS_ADMIN) the veth links are skipped with a message.

Measured (each a fresh set of processes, tether and the peer alternating): dense 4 MiB push then
pull (MiB/s pushed + pulled, one shard), sparse 4096 unique ids x 64 dims pull then push over 2
shards (rows/s), small calls (sequential 8-byte push_pull round trips, calls/s).

Run: ``python bench/cross_host.py [--links loopback,veth,10gbit:100us,25gbit:50us] [--repeats 1]
[--seconds 2] [--only dense,sparse,small] [--json FILE]``. ``bench/run_all.py --cross-host``
runs it as separate invocations and keeps the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

from _common import MIB, free_port, markdown_table  # noqa: E402

__all__ = ["LINKS", "TARGETS", "Place", "main", "measure_link", "netns_link", "parse_link", "start_shards"]

LINKS = ["loopback", "veth", "10gbit:100us", "25gbit:50us"]
# DESIGN.md / issue 17 targets: tether / peer-on-TCP (medians), and dense as a share of a shaped link.
TARGETS = {"dense": 1.5, "sparse": 2.0, "small": 1.3, "link_share": 0.8}
_SIZE = 4 * MIB
_NUM_IDS, _DIM, _ROWS = 4096, 64, 2**18
_LR = 0.01
_STARTUP_S = 90.0
_NET = "10.213.0"


@dataclass
class Place:
    """Where the two sides of a measurement run: command prefixes, addresses, interface names."""

    name: str
    client_prefix: list[str] = field(default_factory=list)
    server_prefix: list[str] = field(default_factory=list)
    client_ip: str = "127.0.0.1"
    server_ip: str = "127.0.0.1"
    client_if: str = "lo"
    server_if: str = "lo"
    rate_bps: float | None = None
    rtt_us: float | None = None
    # Whether the RTT asked for was added (netem); None: none asked for.
    rtt_added: bool | None = None
    note: str = ""


def parse_link(spec: str) -> tuple[str, float | None, float | None]:
    """``loopback``, ``veth`` or ``RATEgbit[:RTTus]`` -> (kind, rate in bit/s, RTT in us).

    Raises:
        ValueError: anything else.
    """
    if spec in ("loopback", "veth"):
        return spec, None, None
    rate, _, rtt = spec.partition(":")
    try:
        if not rate.endswith("gbit"):
            raise ValueError
        bps = float(rate[:-4]) * 1e9
        us = float(rtt[:-2]) if rtt else None
        if rtt and not rtt.endswith("us"):
            raise ValueError
    except ValueError:
        raise ValueError(f"a link is loopback, veth or RATEgbit[:RTTus] (e.g. 10gbit:100us), got {spec!r}") from None
    if bps <= 0 or (us is not None and us < 0):
        raise ValueError(f"link {spec!r}: the rate must be > 0 and the RTT >= 0")
    return "shaped", bps, us


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def _must(argv: list[str]) -> None:
    proc = _run(argv)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")


def netns_rights() -> str | None:
    """None when network namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    name = f"tether-probe-{os.getpid()}"
    proc = _run(["ip", "netns", "add", name])
    if proc.returncode:
        return f"cannot make a network namespace (ip netns add: {proc.stderr.strip()}); run as root or with CAP_SYS_ADMIN"
    _run(["ip", "netns", "del", name])
    return None


@contextmanager
def netns_link(spec: str) -> Iterator[Place]:
    """Two namespaces joined by a veth pair, shaped as ``spec`` says; removed on exit.

    Raises:
        RuntimeError: a step of the set-up failed (the namespaces are removed all the same).
    """
    kind, bps, rtt = parse_link(spec)
    tag = f"{os.getpid() % 100000}"
    cns, sns = f"tether-c{tag}", f"tether-s{tag}"
    cif, sif = f"tcv{tag}", f"tsv{tag}"
    place = Place(spec, ["ip", "netns", "exec", cns], ["ip", "netns", "exec", sns], f"{_NET}.1", f"{_NET}.2", cif, sif, bps, rtt)
    made: list[str] = []
    try:
        for ns in (cns, sns):
            _must(["ip", "netns", "add", ns])
            made.append(ns)
        _must(["ip", "link", "add", cif, "type", "veth", "peer", "name", sif])
        for ns, dev, ip in ((cns, cif, place.client_ip), (sns, sif, place.server_ip)):
            _must(["ip", "link", "set", dev, "netns", ns])
            _must(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev])
            _must(["ip", "-n", ns, "link", "set", dev, "up"])
            _must(["ip", "-n", ns, "link", "set", "lo", "up"])
        if kind == "shaped":
            _shape(place, [(cns, cif), (sns, sif)], bps, rtt)
        yield place
    finally:
        for ns in made:  # the veth pair goes with its namespaces
            _run(["ip", "netns", "del", ns])


def _shape(place: Place, ends: list[tuple[str, str]], bps: float, rtt_us: float | None) -> None:
    """tbf at ``bps`` on both ends, under netem delay RTT/2 where the kernel has netem."""
    rate = f"{bps / 1e6:.0f}mbit"
    # Bursts of 100 us at the rate, at least 256 KiB: with a bucket of one GSO segment (64 KiB)
    # tbf cuts segments into MTU-sized packets and the shaping costs more CPU than the transfer
    # (in one loaded run: tether 35% and the peer 14% of 10 Gbit/s, against 53% and 49% with
    # 256 KiB). Over a 4 MiB transfer the bucket lets at most 6% through above the rate. A
    # queue of 2 ms.
    burst = max(int(bps / 8 * 100e-6), 256 * 1024)
    place.rtt_added = None if not rtt_us else True
    for ns, dev in ends:
        parent = ["root"]
        if rtt_us:
            proc = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                         "delay", f"{rtt_us / 2:.0f}us", "limit", "100000"])
            if proc.returncode == 0:
                parent = ["parent", "1:1"]
            else:
                place.rtt_added = False
                place.note = (f"no RTT added: the kernel has no netem qdisc ({proc.stderr.strip()}); "
                              f"the link is rate-shaped only, with the veth's own RTT")
        _must(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", rate,
               "burst", str(burst), "latency", "2ms"])


# --------------------------------------------------------------------------- processes


def _env(ifname: str) -> dict[str, str]:
    # TensorPipe and gloo pick their address from these interfaces (else from the host name).
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TP_SOCKET_IFNAME": ifname,
            "GLOO_SOCKET_IFNAME": ifname, "PYTHONPATH": os.pathsep.join([str(_HERE), os.environ.get("PYTHONPATH", "")])}


def _child(prefix: list[str], ifname: str, kind: str, spec: dict[str, Any], log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*prefix, sys.executable, str(Path(__file__).resolve()), "--_child", kind, json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=log.open("a"), text=True, env=_env(ifname), start_new_session=True,
    )


def _stop(procs: Sequence[subprocess.Popen[str]], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)


def _result(proc: subprocess.Popen[str], timeout: float, what: str, log: Path) -> Any:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what} did not finish in {timeout:.0f} s; see {log}") from None
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")


def start_shards(place: Place, num_shards: int, tmp: str, log: Path, procs: list[subprocess.Popen[str]]) -> list[str]:
    """``num_shards`` shard processes on the server side (appended to ``procs``, which the caller
    stops with ``_stop``); their addresses once each serves.

    Raises:
        RuntimeError: a shard exited or did not report its port in time.
    """
    files = []
    for i in range(num_shards):
        pf = Path(tmp) / f"shard-{i}.port"
        files.append(pf)
        argv = [*place.server_prefix, sys.executable, "-m", "tether.server", "--host", place.server_ip, "--port", "0",
                "--port-file", str(pf), "--shard-index", str(i), "--num-shards", str(num_shards), "--grace-seconds", "1"]
        procs.append(subprocess.Popen(argv, stdout=log.open("a"), stderr=subprocess.STDOUT, env=_env(place.server_if),
                                      start_new_session=True))
    deadline = time.monotonic() + _STARTUP_S
    for pf, p in zip(files, procs[-num_shards:], strict=True):
        while not (pf.exists() and pf.read_text().strip()):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"a shard did not start (exit {p.poll()}); see {log}")
            time.sleep(0.05)
    return [f"{place.server_ip}:{int(pf.read_text())}" for pf in files]


def run_tether(place: Place, job: str, kwargs: dict[str, Any], num_shards: int, timeout: float, log: Path) -> Any:
    """Shard processes on the server side, one client on the client side running ``tether_ps.<job>``."""
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="tether-xhost-") as tmp:
        try:
            addresses = start_shards(place, num_shards, tmp, log, procs)
            client = _child(place.client_prefix, place.client_if, "tether", {"job": job, "addresses": addresses, "kwargs": kwargs}, log)
            procs.append(client)
            return _result(client, timeout, f"tether {job}", log)
        finally:
            _stop(procs)


def run_peer(place: Place, job: str, kwargs: dict[str, Any], num_servers: int, timeout: float, log: Path) -> Any:
    """The peer's trainer (rank 0, hosting the rendezvous) on the client side, its servers on the other."""
    port = free_port() if not place.client_prefix else random.randint(20000, 60000)
    world = num_servers + 1
    common = {"addr": place.client_ip, "port": port, "world": world}
    procs: list[subprocess.Popen[str]] = []
    try:
        trainer = _child(place.client_prefix, place.client_if, "peer-trainer", {**common, "job": job, "kwargs": kwargs}, log)
        procs.append(trainer)
        server_kwargs = {"lr": _LR, "num_rows": _ROWS, "dim": _DIM} if "sparse" in job else {"lr": _LR}
        for rank in range(1, world):
            procs.append(_child(place.server_prefix, place.server_if, "peer-server", {**common, "rank": rank, "server": server_kwargs}, log))
        return _result(trainer, timeout, f"peer {job}", log)
    finally:
        _stop(procs, grace=30.0)


def _peer_options(addr: str, port: int) -> Any:
    import torch.distributed.rpc as rpc

    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{addr}:{port}", rpc_timeout=60.0, num_worker_threads=8, _transports=["uv"], _channels=["basic"]
    )


def _child_main(kind: str, spec: dict[str, Any]) -> None:
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    if kind == "tether":
        import tether_ps as tp

        print("RESULT " + json.dumps(getattr(tp, spec["job"])(spec["addresses"], **spec["kwargs"])), flush=True)
    elif kind == "rtt-server":
        import socket

        with socket.create_server((spec["ip"], spec["port"])) as srv:
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(64):
                conn.sendall(data)
    elif kind == "rtt-client":
        import socket

        deadline = time.monotonic() + 30
        while True:
            try:
                s = socket.create_connection((spec["ip"], spec["port"]), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lat = []
        for _ in range(2000):
            t = time.perf_counter()
            s.sendall(b"x")
            s.recv(64)
            lat.append(time.perf_counter() - t)
        s.close()
        print("RESULT " + json.dumps(statistics.median(lat[200:]) * 1e6), flush=True)
    else:
        import rpc_peer
        import torch.distributed.rpc as rpc

        opts = _peer_options(spec["addr"], spec["port"])
        if kind == "peer-server":
            rpc_peer._HOSTED["ps"] = rpc_peer.ParameterServer(**spec["server"])
            rpc.init_rpc(f"ps{spec['rank'] - 1}", rank=spec["rank"], world_size=spec["world"], rpc_backend_options=opts)
            rpc.shutdown()
        else:
            rpc.init_rpc("trainer", rank=0, world_size=spec["world"], rpc_backend_options=opts)
            try:
                result = getattr(rpc_peer, spec["job"])(**spec["kwargs"])
            finally:
                rpc.shutdown()
            print("RESULT " + json.dumps(result), flush=True)


def measure_rtt(place: Place, log: Path) -> float:
    """Median round trip of one byte over a TCP connection between the two sides, us."""
    port = free_port() if not place.client_prefix else random.randint(20000, 60000)
    server = _child(place.server_prefix, place.server_if, "rtt-server", {"ip": place.server_ip, "port": port}, log)
    try:
        client = _child(place.client_prefix, place.client_if, "rtt-client", {"ip": place.server_ip, "port": port}, log)
        return float(_result(client, 120, "rtt probe", log))
    finally:
        _stop([server])


# --------------------------------------------------------------------------- measurements


def _pairs(seconds: float) -> dict[str, tuple[Any, Any]]:
    """Per metric: (tether call, peer call) as (job, kwargs, processes, unpack)."""
    tcp = {"transport": "tcp", "expect": "tcp"}
    return {
        "dense": (("_dense_job", {"sizes": [_SIZE], "seconds": seconds, "wire": "float32", "chunk_elems": None, "conn": tcp}, 1,
                   lambda r: r[str(_SIZE)]),
                  ("_dense_job", {"sizes": [_SIZE], "seconds": seconds}, 1, lambda r: r[str(_SIZE)])),
        "sparse": (("_sparse_job", {"num_ids": _NUM_IDS, "dim": _DIM, "seconds": 2 * seconds, "wire": "float32", "conn": tcp}, 2,
                    lambda r: r),
                   ("_sparse_job", {"num_servers": 2, "num_ids": _NUM_IDS, "seconds": 2 * seconds}, 2, lambda r: r)),
        "small": (("_small_job", {"seconds": 2 * seconds, "conn": tcp}, 1, lambda r: r["calls_per_s"]),
                  ("_small_job", {"seconds": 2 * seconds}, 1, lambda r: r["calls_per_s"])),
    }


def measure_link(place: Place, metrics: Sequence[str], seconds: float, repeats: int, log: Path,
                 say: Any = print) -> dict[str, Any]:
    """tether and the peer side by side on ``place``, ``repeats`` times alternating which goes first."""
    out: dict[str, Any] = {"link": place.name, "rate_bps": place.rate_bps, "rtt_us_asked": place.rtt_us,
                           "rtt_added": place.rtt_added, "note": place.note, "rtt_us_measured": measure_rtt(place, log)}
    timeout = _STARTUP_S + 10 * seconds + 60
    for metric in metrics:
        (tj, tk, tn, tu), (pj, pk, pn, pu) = _pairs(seconds)[metric]
        t_runs, p_runs = [], []
        for r in range(repeats):
            # Both called in this iteration: the loop's values are the ones meant.
            sides = [("tether", lambda: tu(run_tether(place, tj, tk, tn, timeout, log)), t_runs),  # noqa: B023
                     ("peer", lambda: pu(run_peer(place, pj, pk, pn, timeout, log)), p_runs)]  # noqa: B023
            for _, fn, sink in (sides if r % 2 else sides[::-1]):
                sink.append(float(fn()))
            say(f"[cross-host] {place.name} {metric}: tether {t_runs[-1]:,.0f} peer {p_runs[-1]:,.0f}")
        out[metric] = {"tether": t_runs, "peer": p_runs}
    return out


def render(results: Sequence[dict[str, Any]]) -> str:
    """One Markdown table of every link and metric (medians of the repeats in ``results``)."""
    units = {"dense": "MiB/s", "sparse": "rows/s", "small": "calls/s"}
    rows = []
    for res in results:
        for metric in ("dense", "sparse", "small"):
            if metric not in res:
                continue
            t, p = statistics.median(res[metric]["tether"]), statistics.median(res[metric]["peer"])
            share = ""
            if metric == "dense" and res.get("rate_bps"):
                share = f"{t * MIB * 8 / res['rate_bps']:.0%} of {res['rate_bps'] / 1e9:g} Gbit/s"
            rows.append([res["link"], f"{metric} ({units[metric]})", f"{t:,.0f}", f"{p:,.0f}", f"{t / p:.2f}x",
                         f">= {TARGETS[metric]:.1f}x", share])
    return markdown_table(["link", "figure", "tether (TCP)", "peer (TensorPipe uv)", "ratio", "target", "dense / link rate"], rows)


def main(argv: list[str] | None = None) -> int:
    """Measure every link asked for; print a table (and write ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default=",".join(LINKS), help=f"comma-separated: loopback, veth, RATEgbit[:RTTus] (default {','.join(LINKS)})")
    p.add_argument("--only", default="dense,sparse,small", help="comma-separated subset of dense, sparse, small")
    p.add_argument("--repeats", type=int, default=1, help="side-by-side repeats in this invocation (default 1)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per dense figure; sparse and small calls get twice (default 2)")
    p.add_argument("--json", type=Path, help="write the raw figures here")
    p.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        _child_main(a._child[0], json.loads(a._child[1]))
        return 0
    links = [x for x in a.links.split(",") if x]
    metrics = [x for x in a.only.split(",") if x]
    for x in links:
        try:
            parse_link(x)
        except ValueError as exc:
            p.error(str(exc))
    bad = [m for m in metrics if m not in ("dense", "sparse", "small")]
    if bad or a.repeats < 1 or a.seconds <= 0:
        p.error(f"--only takes dense, sparse, small (got {bad}); --repeats >= 1 and --seconds > 0")
    why = netns_rights() if any(x != "loopback" for x in links) else None
    results, skipped = [], []
    log = Path(tempfile.mkdtemp(prefix="tether-xhost-log-")) / "processes.log"
    for spec in links:
        if spec != "loopback" and why:
            skipped.append(f"{spec}: skipped, {why}")
            print(f"[cross-host] {skipped[-1]}", file=sys.stderr)
            continue
        if spec == "loopback":
            res = measure_link(Place("loopback"), metrics, a.seconds, a.repeats, log, say=lambda m: print(m, file=sys.stderr))
        else:
            with netns_link(spec) as place:
                res = measure_link(place, metrics, a.seconds, a.repeats, log, say=lambda m: print(m, file=sys.stderr))
        results.append(res)
    print(render(results))
    for res in results:
        print(f"\n{res['link']}: measured RTT {res['rtt_us_measured']:.0f} us (1-byte TCP ping-pong, median)"
              + (f"; {res['note']}" if res["note"] else ""))
    for s in skipped:
        print(s)
    if a.json:
        a.json.write_text(json.dumps({"results": results, "skipped": skipped, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
