"""bench --url's streaming client (llamactl/bench/httpstream.py) against raw HTTP/1.1 servers on
127.0.0.1: chunked and sized bodies, lines split across chunks, kept-alive connections reused,
one closed by the server meanwhile, Connection: close, bodies that run to the connection's end,
answers that are not HTTP, and the load test's time limit on an exchange."""

from __future__ import annotations

import asyncio

import pytest

from llamactl.bench import httpstream, loadtest

CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"9\r\ndata: {\"a\r\n"  # a line split across chunks
           b"7\r\n\": 1}\n\n\r\n"
           b"e\r\ndata: [DONE]\n\n\r\n"
           b"0\r\n\r\n")


def sized(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%s\r\n" % (status, len(body), extra) + body


async def serve(answers: list[bytes | None], close_after: set[int] = frozenset()):
    """A server answering request i (over all connections) with answers[i] (None: never), closing
    the connection after the requests in close_after; returns (server, url, connections seen)."""
    seen = {"connections": 0, "requests": 0, "bodies": []}

    async def handle(reader, writer):
        seen["connections"] += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                break
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            seen["bodies"].append(await reader.readexactly(length))
            i = seen["requests"]
            seen["requests"] += 1
            if answers[i] is None:
                await asyncio.sleep(60)
            writer.write(answers[i])
            await writer.drain()
            if i in close_after:
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


def run(coro):
    return asyncio.run(coro)


def test_lines_of_a_chunked_stream_and_a_sized_error_on_one_kept_alive_connection():
    async def go():
        server, url, seen = await serve([CHUNKED, sized(400, b'{"error": {"message": "bad"}}')])
        client = httpstream.Client(url, {"Authorization": "Bearer k"}, 4)
        async with client.post("/v1/completions", b'{"x": 1}') as resp:
            lines = [line async for line in resp.aiter_lines()]
        async with client.post("/v1/completions", b"{}") as resp:
            status, text = resp.status_code, await resp.aread()
        await client.aclose()
        server.close()
        return lines, status, text, seen

    lines, status, text, seen = run(go())
    assert lines == ['data: {"a": 1}', "", "data: [DONE]", ""]
    assert status == 400 and b"bad" in text
    assert seen["connections"] == 1 and seen["bodies"] == [b'{"x": 1}', b"{}"]


def test_a_connection_the_server_closed_is_replaced_and_connection_close_is_honoured():
    async def go():
        ok = sized(200, b"data: [DONE]\n\n")
        server, url, seen = await serve([ok, ok, sized(200, b"x", b"connection: close\r\n"), ok], close_after={0})
        client = httpstream.Client(url, {}, 2)
        texts = []
        for _ in range(4):
            async with client.post("/p", b"{}") as resp:
                texts.append(await resp.aread())
            await asyncio.sleep(0.05)  # the server's close reaches the kept connection
        await client.aclose()
        server.close()
        return texts, seen

    texts, seen = run(go())
    assert texts == [b"data: [DONE]\n\n", b"data: [DONE]\n\n", b"x", b"data: [DONE]\n\n"]
    assert seen["requests"] == 4 and seen["connections"] == 3  # after request 0 (closed) and request 2 (close)


def test_a_body_without_length_runs_to_the_end_and_a_non_http_answer_is_an_error():
    async def go():
        server, url, _ = await serve([b"HTTP/1.0 200 OK\r\n\r\nline 1\nline 2", b"SSH-2.0-nope\r\n\r\n"],
                                     close_after={0, 1})
        client = httpstream.Client(url, {}, 2)
        async with client.post("/p", b"{}") as resp:
            lines = [line async for line in resp.aiter_lines()]
        with pytest.raises(httpstream.HttpError, match="not an HTTP/1.x status line"):
            async with client.post("/p", b"{}"):
                pass
        server.close()
        return lines

    assert run(go()) == ["line 1", "line 2"]


def test_the_load_tests_exchange_ends_at_its_time_limit():
    async def go():
        server, url, _ = await serve([None])
        client = httpstream.Client(url, {}, 1)
        post = loadtest._timed(client.post, 0.3)
        with pytest.raises(TimeoutError):
            async with post("/p", b"{}"):
                pass
        await asyncio.wait_for(client._open.acquire(), 2)  # the slot was given back: another exchange can start
        server.close()

    run(go())


def test_only_plain_http_is_spoken():
    with pytest.raises(ValueError, match="plain http"):
        httpstream.Client("https://example.com", {}, 1)
