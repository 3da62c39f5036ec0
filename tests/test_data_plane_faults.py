"""What a client can do to a shard's data plane, with real processes: shared memory (sealed memfds
passed over a unix socket, never a path), memory held before and after the token, timeouts.

Each test here failed on the data plane that named ``/dev/shm`` files (SIGBUS, a symlink
followed, files left behind, whole frames read before the token, nothing ever timed out).
"""

from __future__ import annotations

import array
import errno
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import msgpack
import pytest
import torch
from conftest import make_client

from tether.common.security import ClientSecurity
from tether.deploy.launch import LocalCluster
from tether.protos import framing as dp
from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.codec import encode_ids
from tether.protos.specs import OptimizerConfig, TableConfig

TABLE = TableConfig("emb", dim=4, optimizer=OptimizerConfig("sgd", lr=1.0), init_scale=0.0)
TOKEN = "data-plane-token_0123456789"
MiB = 1024 * 1024
OK = 0
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def _info(address: str) -> pb.InfoResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.ParameterServerStub(ch).Info(pb.InfoRequest(), timeout=10)


def _tcp(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def _unix(name: str) -> socket.socket:
    assert name.startswith("\0"), f"the shard's socket {name!r} is not abstract"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(name)
    return s


def _answer(sock: socket.socket) -> tuple[int, int, bytes]:
    """(method, status, meta) of the next frame."""
    method, _, status, meta_len, payload_len, _ = dp.read_header(sock, bytearray(dp.HEADER.size))
    meta = bytearray(meta_len)
    dp.recv_into(sock, memoryview(meta))
    if payload_len:
        dp.recv_into(sock, memoryview(bytearray(payload_len)))
    return method, status, bytes(meta)


def _hello(sock: socket.socket, fds: list[int] = (), **meta: object) -> dict:
    dp.send_frame(sock, dp.HELLO, msgpack.packb(meta), **({"fds": fds} if fds else {}))
    method, status, body = _answer(sock)
    assert (method, status) == (dp.HELLO, OK), body
    return msgpack.unpackb(body)


def _closed(sock: socket.socket) -> bool:
    """Whether the shard has closed ``sock`` (False if it is still open after the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


class _RssPeak:
    """The largest VmRSS of ``pid`` seen while the context is open, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = _rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_mib(self.pid))

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _shm_push(sock: socket.socket, region: memoryview, rows: int) -> tuple[int, int, bytes]:
    """Push ones to ``rows`` rows of TABLE from ``region``; the answer."""
    request = pb.PushRequest(worker_id="raw", seq=1, incarnation=1)
    block = request.sparse.add(table="emb", ids=encode_ids(torch.arange(rows)))
    out = dp.PayloadWriter()
    out.add(torch.ones(rows, 4), block.values)
    out.copy_into(region)
    dp.send_frame(sock, dp.PUSH, request.SerializeToString(), flags=dp.FLAG_SHM, payload_len=out.nbytes, aux=0)
    return _answer(sock)


def _declared_shard(cluster: LocalCluster, *args: str) -> tuple[str, pb.InfoResponse, subprocess.Popen]:
    (address,) = cluster.start_shards(1, extra_args=list(args))
    client = make_client([address], transport="tcp")
    try:
        client.declare([TABLE])
    finally:
        client.close()
    # The shard loads its compiled kernels in the background (tens of MiB), and its table's rule's
    # when the table is declared: let both finish, so that memory measured from here on is the
    # data plane's.
    log, deadline = cluster.log_dir / "shard-0.log", time.monotonic() + 60
    while not all(line in log.read_text(errors="replace") for line in ("compiled kernels ready", "compiled kernels of the ")):
        assert time.monotonic() < deadline, f"the shard did not load its kernels in 60 s:\n{log.read_text()}"
        time.sleep(0.05)
    return address, _info(address), cluster.shard_process(0)


# -- item 2: shared memory ---------------------------------------------------------------------


def test_a_sealed_region_cannot_be_truncated_and_an_unsealed_one_is_refused(cluster: LocalCluster) -> None:
    address, info, proc = _declared_shard(cluster)
    assert info.data_socket.startswith("\0tether-")
    # An honest region: reserved and sealed, so the client itself cannot shrink it any more.
    region, fd = dp.SharedRegion.create(1 * MiB)
    try:
        with _unix(info.data_socket) as s:
            assert _hello(s, [fd], shm_size=1 * MiB)["shm"] is True
            with pytest.raises(OSError) as exc:
                os.ftruncate(fd, 0)
            assert exc.value.errno == errno.EPERM
            assert _shm_push(s, region.view, 1000)[1] == OK
    finally:
        os.close(fd)
        region.close()
    # An adversary's region: a memfd without seals, truncated to 0 after the handshake, then a
    # push that says its payload is in the region (the old shard died of SIGBUS here).
    fd = os.memfd_create("evil", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 * MiB)
    os.posix_fallocate(fd, 0, 1 * MiB)
    try:
        with _unix(info.data_socket) as s:
            answer = _hello(s, [fd], shm_size=1 * MiB)
            assert answer["shm"] is False and "not sealed" in answer["shm_error"]
            os.ftruncate(fd, 0)
            _method, status, body = _shm_push(s, memoryview(bytearray(1 * MiB)), 1000)
            assert status == INVALID_ARGUMENT and b"no region" in body
    finally:
        os.close(fd)
    # Not a memfd at all (a regular file), sealed but growable-only, and smaller than announced.
    with open(os.devnull, "rb") as f, _unix(info.data_socket) as s:
        assert _hello(s, [f.fileno()], shm_size=4096)["shm"] is False
    fd = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    os.posix_fallocate(fd, 0, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, dp.SEALS)
    try:
        with _unix(info.data_socket) as s:
            assert "less than" in _hello(s, [fd], shm_size=1 * MiB)["shm_error"]
    finally:
        os.close(fd)
    time.sleep(0.2)
    assert proc.poll() is None, f"shard died with {proc.returncode}"
    assert _info(address).applied_pushes == 1


def test_descriptors_sent_outside_a_hello_are_closed(cluster: LocalCluster) -> None:
    _, info, proc = _declared_shard(cluster)
    with _unix(info.data_socket) as s:
        _hello(s)
        time.sleep(0.2)
        before = _open_fds(proc.pid)
        fd = os.memfd_create("stray", os.MFD_CLOEXEC)
        try:
            pull = pb.PullRequest(worker_id="raw").SerializeToString()
            for _ in range(20):
                # A frame with descriptors that is not a HELLO (the shard answers and keeps the connection).
                dp.send_frame(s, dp.PULL, pull, fds=[fd, fd])
                assert _answer(s)[0] == dp.PULL
            for _ in range(20):
                s2 = _unix(info.data_socket)
                # A HELLO with three descriptors: none is kept.
                assert _hello(s2, [fd, fd, fd], shm_size=4096)["shm"] is False
                s2.close()
            # More descriptors than a header read takes: the frame is refused and the connection closed.
            s3 = _unix(info.data_socket)
            _hello(s3)
            hdr = dp.HEADER.pack(dp.MAGIC, dp.PULL, 0, 0, 0, 0, 0)
            s3.sendmsg([hdr], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * 16))])
            assert _answer(s3)[1] == INVALID_ARGUMENT
            s3.close()
        finally:
            os.close(fd)
        time.sleep(0.5)
        assert _open_fds(proc.pid) <= before
    assert proc.poll() is None


def test_a_symlink_in_dev_shm_is_never_opened(cluster: LocalCluster, tmp_path: Path) -> None:
    address, info, proc = _declared_shard(cluster)
    client = make_client([address], transport="tcp")
    try:
        client.declare([TABLE])
        client.push({"emb": (torch.arange(8), torch.ones(8, 4))}).result(10)  # rows are -1 now
    finally:
        client.close()
    target = tmp_path / "ordinary-file"
    nonce = os.urandom(16)
    target.write_bytes(nonce + bytes(1 * MiB - 16))
    before = target.read_bytes()
    name = f"tether-x{os.getpid()}"
    link = Path("/dev/shm") / name
    link.symlink_to(target)
    try:
        with _tcp(info.data_port) as s:
            # The old protocol's HELLO, naming the link (and the nonce in the file it points at).
            answer = _hello(s, shm=name, shm_size=1 * MiB, nonce=nonce)
            assert answer["shm"] is False
            request = pb.PullRequest(worker_id="raw")
            request.sparse.add(table="emb", ids=encode_ids(torch.arange(8)))
            dp.send_frame(s, dp.PULL, request.SerializeToString(), flags=dp.FLAG_SHM, payload_len=0, aux=dp.ALIGN)
            assert _answer(s)[1] == INVALID_ARGUMENT
    finally:
        link.unlink()
    assert target.read_bytes() == before
    assert proc.poll() is None


_HELLO_THEN_WAIT = textwrap.dedent(
    """
    import sys
    from tether.worker.client.data_channel import DataConnection
    port, name = int(sys.argv[1]), sys.argv[2]
    try:
        DataConnection("127.0.0.1", port, None, 60.0, True, "\\0" + name)
    except TypeError:  # the data plane before memfd regions
        DataConnection("127.0.0.1", port, None, 60.0, True)
    """
)


def _tether_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("tether-")}


def test_a_client_killed_during_its_hello_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    # A shard that accepts and never answers, on both a TCP port and an abstract unix socket.
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"tether-test-{os.getpid()}-{os.urandom(4).hex()}"
    unix.bind("\0" + name)
    unix.listen(1)
    before = _tether_shm()
    script = tmp_path / "hello.py"
    script.write_text(_HELLO_THEN_WAIT)
    proc = subprocess.Popen([sys.executable, str(script), str(tcp.getsockname()[1]), name])
    accepted = []
    try:
        import select

        ready, _, _ = select.select([tcp, unix], [], [], 30)
        assert ready, "the client never connected"
        conn, _ = ready[0].accept()
        accepted.append(conn)
        assert select.select([conn], [], [], 30)[0], "no HELLO arrived"  # it waits for the answer now
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        assert _tether_shm() <= before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in accepted:
            c.close()
        tcp.close()
        unix.close()


_SMALL_SHM_RUN = textwrap.dedent(
    """
    import subprocess, sys, time, torch
    from pathlib import Path
    from tether.protos.specs import OptimizerConfig
    from tether.worker.client.ps_client import PSClient
    from tether.worker.client.config import ClientConfig

    port_file = Path(sys.argv[1])
    shard = subprocess.Popen([sys.executable, "-m", "tether.server", "--port", "0", "--port-file", str(port_file),
                              "--max-message-mb", "64"])
    try:
        while not port_file.exists() or not port_file.read_text().strip():
            assert shard.poll() is None, f"shard exited {shard.returncode}"
            time.sleep(0.1)
        client = PSClient(ClientConfig(addresses=(f"127.0.0.1:{port_file.read_text().strip()}",), worker_id="w",
                                       timeout_s=30.0, retries=1))
        n = 4 << 20  # 16 MiB each way per step, more than the 12 MiB /dev/shm
        client.declare(dense={"w": torch.zeros(n)}, dense_optimizer=OptimizerConfig("sgd", lr=1.0))
        grad = torch.ones(n)
        for step in range(1, 4):
            client.push(dense={"w": grad}).result(60)
            value = client.pull(dense=["w"]).result(60).dense["w"]
            assert float(value[0]) == -step and float(value[-1]) == -step
        print("TRANSPORT", client.transports()[0])
        client.close()
        assert shard.poll() is None, f"shard exited {shard.returncode}"
        print("BOTH ALIVE")
    finally:
        shard.terminate()
        shard.wait(30)
    """
)


def test_a_small_dev_shm_crashes_nothing(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run([unshare, "-m", "sh", "-c", "mount -t tmpfs -o size=12m tmpfs /dev/shm"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private mount namespace with a small /dev/shm here: {probe.stderr.decode().strip()}")
    script = tmp_path / "run.py"
    script.write_text(_SMALL_SHM_RUN)
    run = subprocess.run(
        [unshare, "-m", "sh", "-c", 'mount -t tmpfs -o size=12m tmpfs /dev/shm && exec "$0" "$@"',
         sys.executable, str(script), str(tmp_path / "port")],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "BOTH ALIVE" in run.stdout
    assert "TRANSPORT shm" in run.stdout  # memfds do not live in /dev/shm


def test_an_unreachable_unix_socket_falls_back_to_tcp_and_says_so_once(cluster: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    (address,) = cluster.start_shards(1)
    client = make_client([address], transport="auto")
    try:
        client.declare([TABLE])
        plane = client.channels[0].data
        plane.set_port(plane.port, "\0no-such-tether-socket-" + os.urandom(4).hex())
        ids = torch.arange(20000)
        with caplog.at_level(logging.INFO, logger="tether.worker.client.data_channel"):
            handles = [client.pull({"emb": ids}) for _ in range(3)]  # three connections at once
            for h in handles:
                h.result(10)
            client.push({"emb": (ids, torch.ones(20000, 4))}).result(10)
            assert client.transports() == ["tcp"]
        lines = [r.getMessage() for r in caplog.records if "unix socket" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "using TCP" in lines[0]
        assert torch.equal(client.pull({"emb": ids[:3]}).result(10).rows["emb"], -torch.ones(3, 4))
    finally:
        client.close()
    client = make_client([address], transport="tcp")
    try:
        client.declare([TABLE])
        client.pull({"emb": torch.arange(20000)}).result(10)
        assert client.transports() == ["tcp"]  # tcp never tries the unix socket
    finally:
        client.close()


# -- item 3: memory a client can pin, timeouts ------------------------------------------------


def _send_quietly(sock: socket.socket, header: bytes, body: memoryview) -> None:
    try:
        sock.sendall(header)
        sock.sendall(body)
    except OSError:
        pass  # the shard hung up, as it should


def test_unauthenticated_connections_cannot_make_the_shard_read_big_frames(cluster: LocalCluster, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    (address,) = cluster.start_shards(1, extra_args=["--auth-token-file", str(token_file)])
    client = make_client([address], transport="tcp", security=ClientSecurity(token=TOKEN))
    try:
        client.declare([TABLE])
    finally:
        client.close()
    proc = cluster.shard_process(0)
    port = _info_token(address).data_port
    base = _rss_mib(proc.pid)
    blob = memoryview(bytes(200 * MiB))
    socks, threads = [], []
    with _RssPeak(proc.pid) as rss:
        for i in range(4):
            s = _tcp(port)
            socks.append(s)
            # Two HELLOs announcing 200 MiB messages and two pushes announcing 200 MiB payloads,
            # all before any token, each followed by its 200 MiB.
            header = (dp.HEADER.pack(dp.MAGIC, dp.HELLO, 0, 0, 200 * MiB, 0, 0) if i % 2 == 0
                      else dp.HEADER.pack(dp.MAGIC, dp.PUSH, 0, 0, 16, 200 * MiB - 16, 0))
            t = threading.Thread(target=_send_quietly, args=(s, header, blob))
            t.start()
            threads.append(t)
        answers = [_answer(s) for s in socks]
        for t in threads:
            t.join(60)
        time.sleep(0.2)
    peak = rss.peak
    for s in socks:
        s.close()
    print(f"RSS {base:.0f} MiB before, {peak:.0f} MiB at most under 4 unauthenticated 200 MiB frames")
    assert [a[1] for a in answers] == [INVALID_ARGUMENT, UNAUTHENTICATED, INVALID_ARGUMENT, UNAUTHENTICATED], answers
    assert peak - base < 50, f"RSS went from {base:.0f} to {peak:.0f} MiB"
    assert proc.poll() is None


def _info_token(address: str) -> pb.InfoResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.ParameterServerStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))


def test_big_frames_are_released_when_idle_and_bounded_for_all_connections(cluster: LocalCluster) -> None:
    _, info, proc = _declared_shard(cluster, "--max-message-mb", "64", "--data-buffer-mb", "128", "--data-idle-timeout", "30")
    base = _rss_mib(proc.pid)
    payload = memoryview(bytes(40 * MiB))
    meta = pb.PushRequest(worker_id="raw", seq=1, incarnation=1).SerializeToString()
    socks = []
    for _ in range(3):  # 3 x 40 MiB held at once fit the 128 MiB
        s = _tcp(info.data_port)
        _hello(s)
        dp.send_frame(s, dp.PUSH, meta, [payload])
        assert _answer(s)[1] == OK
        socks.append(s)
    held = _rss_mib(proc.pid)
    time.sleep(2.0)  # idle: every buffer goes back
    released = _rss_mib(proc.pid)
    print(f"RSS {base:.0f} MiB at start, {held:.0f} with 3 x 40 MiB frames read, {released:.0f} after idling")
    assert held - base > 80  # the frames were buffered (the measurement means something)
    assert released - base < 30, f"RSS {base:.0f} MiB at start, {held:.0f} with 3 x 40 MiB frames read, {released:.0f} after idling"
    # Two connections in the middle of 60 MiB frames hold 120 of the 128 MiB: a third is refused.
    for s in socks[:2]:
        s.sendall(dp.HEADER.pack(dp.MAGIC, dp.PUSH, 0, 0, len(meta), 60 * MiB, 0) + meta + bytes(1024))
    time.sleep(0.5)
    s = socks[2]
    s.sendall(dp.HEADER.pack(dp.MAGIC, dp.PUSH, 0, 0, len(meta), 60 * MiB, 0))
    _method, status, body = _answer(s)
    assert status == RESOURCE_EXHAUSTED, body
    text = body.decode()
    assert str(128 * MiB) in text and str(dp.align(len(meta)) + 60 * MiB) in text, text
    for s in socks:
        s.close()
    assert proc.poll() is None


def test_half_open_and_idle_connections_are_closed_so_new_workers_get_the_data_plane(cluster: LocalCluster) -> None:
    address, info, proc = _declared_shard(
        cluster, "--max-concurrent-rpcs", "8", "--data-handshake-timeout", "1", "--data-idle-timeout", "2"
    )
    half_open = [_tcp(info.data_port) for _ in range(4)]  # connected, never say HELLO
    half_open[0].sendall(dp.HEADER.pack(dp.MAGIC, dp.HELLO, 0, 0, 100, 0, 0))  # a HELLO that never ends
    idle = []
    for _ in range(4):
        s = _tcp(info.data_port)
        _hello(s)  # then silent
        idle.append(s)
    with _tcp(info.data_port) as s:  # every slot is taken
        assert _answer(s)[1] == RESOURCE_EXHAUSTED
    time.sleep(1.5)
    assert all(_closed(s) for s in half_open)  # the handshake timeout
    time.sleep(1.5)
    assert all(_closed(s) for s in idle)  # the idle timeout
    client = make_client([address], transport="auto")
    try:
        client.declare([TABLE])
        client.pull({"emb": torch.arange(20000)}).result(10)
        assert client.transports() == ["shm"]
        time.sleep(2.5)  # the shard closes the client's pooled connection too
        client.pull({"emb": torch.arange(20000)}).result(10)
        assert client.transports() == ["shm"]  # a new connection, not a fall back to gRPC
    finally:
        client.close()
    for s in half_open + idle:
        s.close()
    assert proc.poll() is None
