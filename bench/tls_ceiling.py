"""The ceiling of TLS on this machine: a raw socket echo of 4 MiB, in plain TCP and inside TLS.

No tether code on the path: a forked echo server and this process exchange the same buffer over
loopback, with Python's ``ssl`` (the library the data plane uses) or without it, and the
certificates of ``_common.make_certificates``. What TLS costs tether's data plane cannot be less
than what it costs this echo; ``openssl speed -evp aes-256-gcm`` gives the cipher's own rate.

Run: ``python bench/tls_ceiling.py [--seconds 3] [--mib 4]``; prints MiB/s (bytes sent + received)
for each, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_certificates

__all__ = ["echo_mib_per_s", "main"]


def _fill(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:], len(view) - got)
        if k == 0:
            return False
        got += k
    return True


def echo_mib_per_s(nbytes: int, seconds: float, tls: dict[str, Path] | None) -> float:
    """MiB/s of send + receive of ``nbytes`` echoed by a forked server (inside TLS with ``tls``)."""
    from tether.common.security import ClientSecurity, server_ssl_context

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the echo server
        try:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls:
                conn = server_ssl_context(str(tls["server.crt"]), str(tls["server.key"])).wrap_socket(conn, server_side=True)
            view = memoryview(bytearray(nbytes))
            while _fill(conn, view):
                conn.sendall(view)
        finally:
            os._exit(0)
    listener.close()
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls:
            sock = ClientSecurity(tls_ca=str(tls["ca.crt"])).ssl_context().wrap_socket(sock, server_hostname="127.0.0.1")
        data, back = memoryview(bytearray(os.urandom(nbytes))), memoryview(bytearray(nbytes))
        for _ in range(3):
            sock.sendall(data)
            _fill(sock, back)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            sock.sendall(data)
            _fill(sock, back)
            n += 1
        rate = 2 * nbytes * n / (time.perf_counter() - t0) / 2**20
        sock.close()
        return rate
    finally:
        os.waitpid(pid, 0)


def main(argv: list[str] | None = None) -> int:
    """Print plain and TLS echo rates."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--mib", type=int, default=4)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tether-tls-ceiling-") as tmp:
        certs = make_certificates(Path(tmp))
        plain = echo_mib_per_s(a.mib << 20, a.seconds, None)
        tls = echo_mib_per_s(a.mib << 20, a.seconds, certs)
    print(f"echo of {a.mib} MiB: plain TCP {plain:,.0f} MiB/s, TLS {tls:,.0f} MiB/s, TLS / plain {tls / plain:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
