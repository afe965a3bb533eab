"""Streamed HTTP/1.1 POSTs over plain asyncio streams, for `bench --url`'s requests.

A load test's client should cost little beside the server it measures: at 32 closed-loop streams
httpx spent about 2 ms of CPU a request on this project's 2-core machine, so a wave's last request
left the client tens of ms after its clock started (docs/bench/README.md). This client does one
thing: POST a JSON body on a kept-alive connection to an http:// server and hand back the response
body line by line (chunked or sized), as server-sent events arrive; straight to the host (no
proxy variables, no compression, no TLS). https:// URLs use httpx.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import urlsplit


class HttpError(Exception):
    """The server's answer was not HTTP/1.x as this client reads it."""


class Response:
    """One response: its status, then its body's lines (or all its text) read off the connection."""

    def __init__(self, conn: "_Conn", status: int, headers: dict[str, str]):
        self._conn, self.status_code, self.headers = conn, status, headers
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None
        self.done = False

    async def _pieces(self) -> AsyncIterator[bytes]:
        r = self._conn.reader
        if self._chunked:
            while True:
                size = int((await r.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    break
                data = await r.readexactly(size)
                await r.readexactly(2)  # the chunk's CRLF
                yield data
        elif self._left is not None:
            while self._left:
                data = await r.read(min(self._left, 1 << 16))
                if not data:
                    raise HttpError("the connection closed inside a response body")
                self._left -= len(data)
                yield data
        else:  # no length, not chunked: the body runs to the connection's end
            self._conn.reusable = False
            while data := await r.read(1 << 16):
                yield data
        self.done = True

    async def aiter_lines(self) -> AsyncIterator[str]:
        rest = b""
        async for data in self._pieces():
            rest += data
            *lines, rest = rest.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode(errors="replace")
        if rest:
            yield rest.rstrip(b"\r").decode(errors="replace")

    async def aread(self) -> bytes:
        return b"".join([p async for p in self._pieces()])


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer, self.reusable = reader, writer, True

    def close(self) -> None:
        self.writer.close()


class Client:
    """Kept-alive connections to one http://host:port, at most `connections` open."""

    def __init__(self, url: str, headers: dict[str, str], connections: int):
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"{url}: httpstream speaks plain http:// only")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.base = parts.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = f"Host: {parts.netloc}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{extra}"
        self._idle: list[_Conn] = []
        self._open = asyncio.Semaphore(connections)

    def post(self, path: str, body: bytes) -> "_Exchange":
        """`async with client.post(path, body) as resp:` -> Response, its connection kept for the
        next request when the body was read to its end."""
        return _Exchange(self, path, body)

    async def _connect(self) -> _Conn:
        if self._idle:
            return self._idle.pop()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return _Conn(reader, writer)

    async def aclose(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()


class _Exchange:
    def __init__(self, client: Client, path: str, body: bytes):
        self.client, self.path, self.body, self.conn, self.resp = client, path, body, None, None

    async def __aenter__(self) -> Response:
        await self.client._open.acquire()
        try:
            return await self._send()
        except BaseException:
            await self.__aexit__(None, None, None)  # no response: the connection closed, the slot given back
            raise

    async def _send(self) -> Response:
        c = self.client
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more on a new one
            fresh = not c._idle
            self.conn = await c._connect()
            self.conn.writer.write(f"POST {c.base}{self.path} HTTP/1.1\r\n{c._head}Content-Length: {len(self.body)}"
                                   f"\r\n\r\n".encode() + self.body)
            try:
                await self.conn.writer.drain()
                status_line = await self.conn.reader.readline()
                if not status_line:
                    raise ConnectionResetError("the server closed the connection")
            except (ConnectionError, asyncio.IncompleteReadError):
                self.conn.close()
                if fresh or attempt:
                    raise
                continue
            break
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        headers = {}
        while (line := await self.conn.reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("connection", "").lower() == "close":
            self.conn.reusable = False
        self.resp = Response(self.conn, int(parts[1]), headers)
        return self.resp

    async def __aexit__(self, *exc) -> None:
        conn, c = self.conn, self.client
        if conn is not None:
            if exc[0] is None and self.resp is not None and self.resp.done and conn.reusable:
                c._idle.append(conn)
            else:  # left mid-body or failed: the connection's state is unknown
                conn.close()
        c._open.release()
