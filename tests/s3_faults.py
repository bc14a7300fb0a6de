"""A fault-injecting HTTP proxy in front of the test S3 server (tests/s3_server.py), on 127.0.0.1 only.

Clients point ``endpoint_url`` at the proxy; it forwards each request to the moto server (always
127.0.0.1, whatever the Host header says) and, for a seeded share of the requests that match a filter
(methods, a regex on the path), injects a fault instead:

- ``"503"``: 503 SlowDown with an S3 XML error body (throttling); the request never reaches the server.
- ``"500"``: 500 InternalError, same.
- ``"403"``: 403 AccessDenied (what a bucket policy or bad credentials give); never retried.
- ``"reset"``: the whole request is read, then the connection is reset (RST) with no response.
- ``"drop"``: the connection is reset after the request headers, its body unread (the client fails mid-send).
- ``"cut"``: the request IS forwarded (the server applies it), then only the first half of the response
  reaches the client before a reset: the lost-response case, where a retry repeats a done operation.
- ``"delay"``: the request is forwarded after ``delay_s`` (longer than the client's read timeout: a timeout).
- ``"stall"``: the request head is read, then nothing: no ``100 Continue``, no response, the body unread (a
  frozen server that still accepts connections).
- ``"bare412"``: the request is forwarded, and a 412 answer loses its ``<Condition>`` element (as servers that
  do not name the failed condition answer: MinIO and other S3-compatible stores).

Request bodies are forwarded byte for byte, framed by Content-Length or by ``Transfer-Encoding: chunked``
(raw chunks and trailers as sent, e.g. botocore's aws-chunked checksum trailers). ``Expect: 100-continue`` is
answered by the proxy. ``injected`` counts the faults by kind; ``log`` records every request (method, target,
fault, the status the server answered when it was reached, request body bytes).
"""

from __future__ import annotations

import collections
import http.client
import random
import re
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass

from s3_server import free_port

KINDS = ("503", "500", "403", "400", "reset", "drop", "cut", "delay", "stall", "bare412")
_ERRORS = {"503": ("Service Unavailable", "SlowDown", "Please reduce your request rate."),
           "500": ("Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
           "403": ("Forbidden", "AccessDenied", "Access Denied"),
           "400": ("Bad Request", "TokenRefreshRequired", "The provided token must be refreshed.")}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


@dataclass
class Request:
    method: str
    target: str  # path and query, e.g. /bucket/run/packs/ab/abcd...
    fault: str | None  # the injected kind, or None
    status: int | None = None  # the server's status, when the request reached it
    body_bytes: int = 0  # request body as framed on the wire


@dataclass(frozen=True)
class FaultRule:
    rate: float = 0.0  # share of matching requests that fail
    kinds: tuple[str, ...] = ("503", "500", "reset")
    methods: frozenset[str] | None = None  # e.g. {"PUT"}; None: every method
    path: str | None = None  # regex searched in the request target (bucket/key?query); None: every path
    delay_s: float = 0.0  # for "delay"
    limit: int | None = None  # at most this many faults, then every request passes

    def matches(self, method: str, target: str) -> bool:
        return ((self.methods is None or method in self.methods)
                and (self.path is None or re.search(self.path, target) is not None))


class FaultProxy:
    """Start with ``FaultProxy(upstream_port, seed)``; ``set_faults(...)`` / ``clear()`` change the rule live."""

    def __init__(self, upstream_port: int, seed: int = 0) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.injected: collections.Counter[str] = collections.Counter()
        self.log: list[Request] = []
        self.header_log: list[dict[str, str]] = []  # request headers, when record_headers is set
        self.record_headers = False
        self._rule = FaultRule()
        self._rule_injected = 0  # faults injected under the current rule (for its limit)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve_connection(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    # -- configuration -----------------------------------------------------------------------------------------
    def set_faults(self, rate: float, kinds=("503", "500", "reset"), *, methods=None, path: str | None = None,
                   delay_s: float = 0.0, limit: int | None = None) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        with self._lock:
            self._rule = FaultRule(rate, tuple(kinds), frozenset(m.upper() for m in methods) if methods else None,
                                   path, delay_s, limit)
            self._rule_injected = 0

    def clear(self) -> None:
        with self._lock:
            self._rule = FaultRule()
            self._rule_injected = 0

    @property
    def total_injected(self) -> int:
        with self._lock:
            return sum(self.injected.values())

    def _choose(self, method: str, target: str) -> Request:
        with self._lock:
            rule = self._rule
            kind = None
            if (rule.rate > 0 and (rule.limit is None or self._rule_injected < rule.limit)
                    and rule.matches(method, target) and self._rng.random() < rule.rate):
                kind = self._rng.choice(rule.kinds)
                self.injected[kind] += 1
                self._rule_injected += 1
            req = Request(method, target, kind)
            self.log.append(req)
            return req

    # -- serving -----------------------------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
        reader = sock.makefile("rb")
        try:
            while not self._stopping.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                if not self._serve_request(sock, reader, head):
                    return
        except (OSError, ValueError):
            return  # the client went away, or the proxy is stopping
        finally:
            with self._lock:
                self._sockets.discard(sock)
            reader.close()

    def _serve_request(self, sock: socket.socket, reader, head: bytes) -> bool:
        """Answer one request; False when the connection must close."""
        request_line, headers = _parse_head(head)
        method, target, _version = request_line.split(" ", 2)
        if self.record_headers:
            with self._lock:
                self.header_log.append({"_request": f"{method} {target}", **{k: v for k, v in headers}})
        req = self._choose(method, target)
        kind = req.fault
        if kind == "drop":
            _reset(sock)
            return False
        if kind == "stall":
            self._stopping.wait()
            return False
        if _header(headers, "expect").lower() == "100-continue":
            if kind in _ERRORS:  # a final response instead of 100 Continue; the body stays unsent
                sock.sendall(_error_response(kind, method, target, close=True))
                return False
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = _read_body(reader, headers)
        req.body_bytes = len(body)
        if kind in _ERRORS:
            sock.sendall(_error_response(kind, method, target, close=False))
            return True
        if kind == "reset":
            _reset(sock)
            return False
        if kind == "delay" and self._stopping.wait(self._rule.delay_s):
            return False
        req.status, response = self._forward(method, target, headers, body, bare412=kind == "bare412")
        if kind == "cut":
            sock.sendall(response[: len(response) // 2])
            _reset(sock)
            return False
        sock.sendall(response)
        return _header(headers, "connection").lower() != "close"

    def _forward(self, method: str, target: str, headers, body: bytes, bare412: bool = False) -> tuple[int, bytes]:
        # Only ever the local moto server: the Host header is not used for routing.
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in ("expect", "connection", "proxy-connection"):
                    conn.putheader(name, value)
            conn.endheaders()
            if body:
                conn.send(body)  # raw bytes, chunked framing included when the client chose it
            resp = conn.getresponse()
            data = resp.read()
            if bare412 and resp.status == 412:
                data = re.sub(rb"<Condition>.*?</Condition>", b"", data)
            out = [f"HTTP/1.1 {resp.status} {resp.reason}".encode()]
            for name, value in resp.getheaders():
                if name.lower() not in _HOP_BY_HOP:
                    out.append(f"{name}: {value}".encode("latin-1"))
            length = resp.getheader("content-length") if method == "HEAD" else str(len(data))
            if length is not None:
                out.append(f"Content-Length: {length}".encode())
            return resp.status, b"\r\n".join(out) + b"\r\n\r\n" + data
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        with self._lock:
            open_sockets = list(self._sockets)
        for s in open_sockets:  # wake handler threads blocked on a keep-alive read
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.server_close()
        self._thread.join(timeout=10)


# -- HTTP/1.1 framing (raw bytes in, raw bytes out) -----------------------------------------------------------
def _read_head(reader) -> bytes | None:
    lines = []
    while True:
        line = reader.readline(65537)
        if not line:
            if lines:
                raise ValueError("connection closed inside a request head")
            return None
        if line in (b"\r\n", b"\n"):
            if not lines:
                continue  # tolerate stray blank lines between requests
            return b"".join(lines)
        lines.append(line)


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return lines[0], headers


def _header(headers, name: str) -> str:
    return next((v for k, v in headers if k.lower() == name), "")


def _read_body(reader, headers) -> bytes:
    if "chunked" in _header(headers, "transfer-encoding").lower():
        parts = []
        while True:
            size_line = reader.readline(65537)
            parts.append(size_line)
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                break
            data = reader.read(size + 2)  # the chunk and its CRLF
            if len(data) != size + 2:
                raise ValueError("connection closed inside a chunk")
            parts.append(data)
        while True:  # trailers (e.g. x-amz-checksum-crc32), then the closing blank line
            line = reader.readline(65537)
            if not line:
                raise ValueError("connection closed inside the trailers")
            parts.append(line)
            if line in (b"\r\n", b"\n"):
                break
        return b"".join(parts)
    length = int(_header(headers, "content-length") or 0)
    data = reader.read(length) if length else b""
    if len(data) != length:
        raise ValueError("connection closed inside a request body")
    return data


def _error_response(kind: str, method: str, target: str, *, close: bool) -> bytes:
    reason, code, message = _ERRORS[kind]
    resource = target.split("?", 1)[0]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{resource}</Resource><RequestId>fault-proxy</RequestId></Error>").encode()
    head = [f"HTTP/1.1 {kind} {reason}", "Content-Type: application/xml", f"Content-Length: {len(body)}"]
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if method == "HEAD" else body)  # HEAD: no body


def _reset(sock: socket.socket) -> None:
    """Close with an RST (linger 0), as a crashed server or a dropping load balancer does."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    sock.close()
