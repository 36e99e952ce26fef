"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1 for testing S3 clients against a flaky network.

``FaultProxy(upstream_url, error_rate, drop_rate, stall_rate, stall_s, seed)`` listens on a free
loopback port (:attr:`FaultProxy.url`) and forwards each request to ``upstream_url`` (which must
be a loopback ``http://`` endpoint). Per request, independently drawn from a seeded RNG:

* with ``error_rate``: answer it itself with a 500 ``InternalError`` or 503 ``SlowDown`` (valid
  HTTP, S3-style XML body, keep-alive preserved), without forwarding -- botocore retries these;
* with ``drop_rate``: close the connection mid-request, one of three ways: before reading the
  body (the client sees a reset while sending), after forwarding (the request took effect but
  the reply is lost) or halfway through the response body (a truncated download);
* with ``stall_rate``: wait ``stall_s`` before forwarding (a slow server; read timeouts).

``proxy.outage = True`` fails every request: with 503 ``ServiceUnavailable`` responses
(``outage_mode = "503"``, the default) or by resetting every new connection as soon as it is
accepted (``outage_mode = "reset"``). ``proxy.reject_if_none_match = True`` answers requests that
carry ``If-None-Match`` with 501 ``NotImplemented``, like servers without conditional writes.

Requests are framed properly: keep-alive connections, ``Content-Length`` bodies, ``Transfer-
Encoding: chunked`` (and ``aws-chunked`` content inside either) are relayed byte for byte;
``Expect: 100-continue`` is answered by the proxy and stripped before forwarding (botocore does
not sign it). Counters are in :attr:`FaultProxy.stats`. Everything is bounded: at most
``max_connections`` client connections (more are refused), idle connections time out, headers
are limited to 64 KiB, and :meth:`FaultProxy.stop` closes every socket and joins every thread.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from typing import BinaryIO
from urllib.parse import urlsplit

__all__ = ["FaultProxy"]

_MAX_HEAD = 64 * 1024
_IO_CHUNK = 1 << 20
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class _Closed(Exception):
    """The peer closed the connection (or it broke) in the middle of a message."""


def _read_head(r: BinaryIO) -> bytes | None:
    """Read a message head (through the blank line). None on a clean EOF before any byte."""
    lines: list[bytes] = []
    total = 0
    while True:
        line = r.readline(_MAX_HEAD)
        if not line:
            if not lines:
                return None
            raise _Closed("EOF inside a message head")
        if not lines and line in (b"\r\n", b"\n"):  # tolerate stray CRLF between messages
            continue
        lines.append(line)
        total += len(line)
        if total > _MAX_HEAD:
            raise _Closed("message head too large")
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    text = head.decode("latin-1").split("\r\n")
    start = text[0]
    headers: list[tuple[str, str]] = []
    for line in text[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return start, headers


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _build_head(start: str, headers: list[tuple[str, str]]) -> bytes:
    return (start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode("latin-1")


def _read_exact(r: BinaryIO, n: int) -> bytes:
    chunks: list[bytes] = []
    while n > 0:
        b = r.read(min(n, _IO_CHUNK))
        if not b:
            raise _Closed("EOF inside a message body")
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _read_chunked(r: BinaryIO) -> bytes:
    """A chunked body, raw (size lines, data, trailers), exactly as sent."""
    parts: list[bytes] = []
    while True:
        line = r.readline(_MAX_HEAD)
        if not line.endswith(b"\n"):
            raise _Closed("EOF inside a chunk size line")
        parts.append(line)
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the blank line
                t = r.readline(_MAX_HEAD)
                if not t:
                    raise _Closed("EOF inside chunked trailers")
                parts.append(t)
                if t in (b"\r\n", b"\n"):
                    return b"".join(parts)
        parts.append(_read_exact(r, size + 2))


def _read_body(r: BinaryIO, headers: list[tuple[str, str]], *, until_eof: bool) -> bytes:
    te = (_header(headers, "Transfer-Encoding") or "").lower()
    if "chunked" in te:
        return _read_chunked(r)
    cl = _header(headers, "Content-Length")
    if cl is not None:
        return _read_exact(r, int(cl))
    if until_eof:
        chunks = []
        while True:
            b = r.read(_IO_CHUNK)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    return b""


def _wants_close(version_line: str, headers: list[tuple[str, str]]) -> bool:
    conn = (_header(headers, "Connection") or "").lower()
    if "close" in conn:
        return True
    return "HTTP/1.0" in version_line and "keep-alive" not in conn


def _error_response(status: int, code: str, message: str, request_id: str, *, head_only: bool) -> bytes:
    reason = {500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable"}.get(status, "Error")
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>{request_id}</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {0 if head_only else len(body)}\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        "\r\n"
    ).encode()
    return head if head_only else head + body


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST (SO_LINGER 0) so the peer sees a reset, not a clean EOF."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class FaultProxy:
    """See the module docstring. Use as ``with FaultProxy(url, ...) as proxy:`` or start/stop.

    Attributes:
        url: ``http://127.0.0.1:<port>`` once started.
        outage: when True every request fails (see ``outage_mode``).
        outage_mode: ``"503"`` or ``"reset"``.
        reject_if_none_match: answer requests carrying ``If-None-Match`` with 501 NotImplemented.
        error_rate, drop_rate, stall_rate, stall_s: may be changed while running.
        stats: counters: requests, forwarded, errors, drops (and drop_before / drop_after /
            drop_truncate), stalls, outage, rejected_conditional, upstream_errors, refused.
    """

    def __init__(
        self,
        upstream_url: str,
        error_rate: float = 0.1,
        drop_rate: float = 0.05,
        stall_rate: float = 0.0,
        stall_s: float = 2.0,
        seed: int = 0,
        *,
        max_connections: int = 64,
        idle_timeout_s: float = 30.0,
    ) -> None:
        u = urlsplit(upstream_url)
        if u.scheme != "http" or not u.hostname or u.hostname not in _LOOPBACK:
            raise ValueError(f"FaultProxy only forwards to a loopback http:// endpoint, got {upstream_url!r}")
        if not (
            0 <= error_rate <= 1
            and 0 <= drop_rate <= 1
            and 0 <= stall_rate <= 1
            and error_rate + drop_rate + stall_rate <= 1
        ):
            raise ValueError("error_rate, drop_rate and stall_rate must be in [0, 1] and sum to at most 1")
        self.upstream = (u.hostname, u.port or 80)
        self.error_rate = error_rate
        self.drop_rate = drop_rate
        self.stall_rate = stall_rate
        self.stall_s = stall_s
        self.outage = False
        self.outage_mode = "503"
        self.reject_if_none_match = False
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.url = ""
        self.stats: dict[str, int] = {
            k: 0
            for k in (
                "connections",
                "refused",
                "requests",
                "forwarded",
                "errors",
                "drops",
                "drop_before",
                "drop_after",
                "drop_truncate",
                "stalls",
                "outage",
                "rejected_conditional",
                "upstream_errors",
            )
        }
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._rid = 0

    # -- public ---------------------------------------------------------------------------
    @property
    def injected(self) -> int:
        """Faults injected so far (errors + drops + stalls + outage failures)."""
        s = self.stats
        return s["errors"] + s["drops"] + s["stalls"] + s["outage"]

    def start(self) -> FaultProxy:
        """Bind 127.0.0.1:0, start accepting; returns self."""
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", 0))
        ls.listen(128)
        ls.settimeout(0.2)
        self._listener = ls
        self.url = f"http://127.0.0.1:{ls.getsockname()[1]}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, break every open connection and join all threads (bounded)."""
        self._stop.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for sock, _t in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _s, t in conns:
            t.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------------
    def _count(self, *names: str) -> None:
        with self._lock:
            for n in names:
                self.stats[n] += 1

    def _next_rid(self) -> str:
        with self._lock:
            self._rid += 1
            return f"FAULTPROXY{self._rid:08d}"

    def _decide(self) -> str:
        """One of: forward, error, drop_before, drop_after, drop_truncate, stall."""
        with self._lock:
            x = self._rng.random()
            if x < self.error_rate:
                return "error"
            x -= self.error_rate
            if x < self.drop_rate:
                return self._rng.choice(("drop_before", "drop_after", "drop_truncate"))
            x -= self.drop_rate
            if x < self.stall_rate:
                return "stall"
            return "forward"

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                csock, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.outage and self.outage_mode == "reset":
                self._count("outage")
                _reset(csock)
                continue
            with self._lock:
                full = len(self._conns) >= self.max_connections
            if full:
                self._count("refused")
                _reset(csock)
                continue
            t = threading.Thread(target=self._serve, args=(csock,), name="faultproxy-conn", daemon=True)
            with self._lock:
                self._conns[csock] = t
                self.stats["connections"] += 1
            t.start()

    def _serve(self, csock: socket.socket) -> None:
        csock.settimeout(self.idle_timeout_s)
        csock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = csock.makefile("rb", buffering=_IO_CHUNK)
        up: tuple[socket.socket, BinaryIO] | None = None
        try:
            while not self._stop.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                start, headers = _parse_head(head)
                method = start.split(" ", 1)[0].upper()
                self._count("requests")
                client_close = _wants_close(start, headers)
                decision = self._decide()
                if self.outage:
                    if self.outage_mode == "reset":
                        self._count("outage")
                        _reset(csock)
                        return
                    decision = "outage"
                elif self.reject_if_none_match and _header(headers, "If-None-Match") is not None:
                    decision = "reject_conditional"
                if decision == "drop_before":
                    self._count("drops", "drop_before")
                    _reset(csock)
                    return
                if (_header(headers, "Expect") or "").lower() == "100-continue":
                    csock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(reader, headers, until_eof=False)
                if decision in ("error", "outage", "reject_conditional"):
                    rid = self._next_rid()
                    if decision == "outage":
                        self._count("outage")
                        resp = _error_response(
                            503, "ServiceUnavailable", "Injected outage", rid, head_only=method == "HEAD"
                        )
                    elif decision == "reject_conditional":
                        self._count("rejected_conditional")
                        resp = _error_response(
                            501,
                            "NotImplemented",
                            "A header you provided implies functionality that is not implemented: If-None-Match",
                            rid,
                            head_only=method == "HEAD",
                        )
                    else:
                        self._count("errors")
                        with self._lock:
                            status, code = self._rng.choice(((500, "InternalError"), (503, "SlowDown")))
                        resp = _error_response(status, code, "Injected by FaultProxy", rid, head_only=method == "HEAD")
                    csock.sendall(resp)
                    if client_close:
                        return
                    continue
                if decision == "stall":
                    self._count("stalls")
                    if self._stop.wait(self.stall_s):
                        return
                fwd_headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                request = _build_head(start, fwd_headers) + body
                try:
                    up, resp_head, resp_body, up_close = self._exchange(up, method, request)
                except (OSError, _Closed):
                    self._count("upstream_errors")
                    if up is not None:
                        up[0].close()
                        up = None
                    rid = self._next_rid()
                    csock.sendall(
                        _error_response(
                            503, "ServiceUnavailable", "Upstream unreachable", rid, head_only=method == "HEAD"
                        )
                    )
                    if client_close:
                        return
                    continue
                self._count("forwarded")
                if up_close and up is not None:
                    up[0].close()
                    up = None
                if decision == "drop_after" or (decision == "drop_truncate" and len(resp_body) < 2):
                    self._count("drops", "drop_after")
                    _reset(csock)
                    return
                if decision == "drop_truncate":
                    self._count("drops", "drop_truncate")
                    csock.sendall(resp_head + resp_body[: len(resp_body) // 2])
                    _reset(csock)
                    return
                csock.sendall(resp_head + resp_body)
                if client_close or up_close:
                    return
        except (OSError, _Closed, ValueError):
            return
        finally:
            if up is not None:
                up[0].close()
            try:
                reader.close()
                csock.close()
            except OSError:
                pass
            with self._lock:
                self._conns.pop(csock, None)

    def _exchange(
        self, up: tuple[socket.socket, BinaryIO] | None, method: str, request: bytes
    ) -> tuple[tuple[socket.socket, BinaryIO] | None, bytes, bytes, bool]:
        """Send ``request`` upstream (reusing ``up`` if open, reconnecting once if it went stale)
        and read the whole response. Returns (connection, head, body, upstream_closes)."""
        for attempt in (0, 1):
            fresh = up is None
            if up is None:
                s = socket.create_connection(self.upstream, timeout=max(self.idle_timeout_s, 60.0))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                up = (s, s.makefile("rb", buffering=_IO_CHUNK))
            try:
                up[0].sendall(request)
                while True:
                    head = _read_head(up[1])
                    if head is None:
                        raise _Closed("upstream closed before responding")
                    start, headers = _parse_head(head)
                    status = int(start.split(" ", 2)[1])
                    if 100 <= status < 200:
                        continue  # interim response; we stripped Expect, but be safe
                    break
            except (OSError, _Closed):
                up[0].close()
                up = None
                if fresh or attempt == 1:
                    raise
                continue  # a reused keep-alive connection went stale: retry once on a new one
            no_body = method == "HEAD" or status in (204, 304)
            close = _wants_close(start, headers)
            if no_body:
                body = b""
            else:
                delimited = (
                    _header(headers, "Content-Length") is not None
                    or "chunked" in (_header(headers, "Transfer-Encoding") or "").lower()
                )
                body = _read_body(up[1], headers, until_eof=True)
                close = close or not delimited
            return up, head, body, close
        raise AssertionError("unreachable")  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover - manual use: python tests/faultproxy.py http://127.0.0.1:9000
    import sys

    with FaultProxy(sys.argv[1]) as p:
        print(p.url, flush=True)
        try:
            while True:
                time.sleep(5)
                print(p.stats, flush=True)
        except KeyboardInterrupt:
            pass
