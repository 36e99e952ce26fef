"""A TCP relay on loopback that limits the bytes per second sent to an upstream server: a node's
share of the network in front of an S3 endpoint (``tools/bench.py --only compress``).

``Throttle(upstream_port, rate)`` listens on a free loopback port (``.port``); every connection
is relayed to ``127.0.0.1:upstream_port`` byte for byte. Client-to-server bytes of all
connections together pass a token bucket of ``rate`` bytes/s (bursts of at most 64 KiB);
replies are not limited (the uploads are what a promotion waits for). ``stop()`` closes
everything.

:func:`spawn` runs the relay in a child process of its own (``python throttle.py PORT RATE``), as
a network would be: outside the client. In the client's process its Python threads would take
the client's GIL and CPU for every byte relayed, which a real network never does.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["Throttle", "spawn"]

_CHUNK = 64 << 10


class _Bucket:
    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        """Block until ``n`` more bytes may go (a virtual clock advanced by n / rate)."""
        with self.lock:
            now = time.monotonic()
            self.t = max(self.t, now - _CHUNK / self.rate) + n / self.rate
            wait = self.t - now
        if wait > 0:
            time.sleep(wait)


class Throttle:
    def __init__(self, upstream_port: int, rate: float) -> None:
        self.upstream = upstream_port
        self.bucket = _Bucket(rate)
        self.sent = 0
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True, name="throttle-accept").start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                c.close()
                continue
            self._socks += [c, u]
            threading.Thread(target=self._pipe, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, False), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, limited: bool) -> None:
        try:
            while True:
                data = a.recv(_CHUNK)
                if not data:
                    break
                if limited:
                    self.bucket.take(len(data))
                    self.sent += len(data)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop = True
        self._srv.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


def spawn(upstream_port: int, rate: float) -> tuple[int, Callable[[], None]]:
    """A :class:`Throttle` in a child process: (its port, a function that stops it). The child
    exits when its stdin closes (the parent stopped it, or died)."""
    p = subprocess.Popen(
        [sys.executable, __file__, str(upstream_port), repr(rate)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdin is not None
    line = p.stdout.readline()
    if not line.strip().isdigit():
        p.kill()
        raise RuntimeError(f"throttle relay did not start (got {line!r}, exit {p.poll()})")

    def stop() -> None:
        assert p.stdin is not None
        p.stdin.close()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()

    return int(line), stop


if __name__ == "__main__":
    th = Throttle(int(sys.argv[1]), float(sys.argv[2]))
    print(th.port, flush=True)
    sys.stdin.read()  # until the parent closes it
    th.stop()
