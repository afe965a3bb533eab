"""llamactl.serve.server.serve: the app on uvicorn on a thread of its own while the caller's loop
(the engine's steps) runs on the main thread (on the CPU, torch's threads are the main thread's);
SIGTERM, caught on the main thread, stops the server, then the loop. Real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from llamactl.serve.server import bind, serve  # noqa: E402


async def _thread_name(request):
    return JSONResponse({"thread": threading.current_thread().name})


def test_the_loop_runs_on_the_main_thread_and_sigterm_stops_the_server_then_the_loop():
    assert threading.current_thread() is threading.main_thread()
    app = Starlette(routes=[Route("/thread", _thread_name)])
    sock = bind("127.0.0.1", 0)
    stop = threading.Event()
    seen: dict = {}
    before = signal.getsignal(signal.SIGTERM)

    def ready(url: str) -> None:  # the server's thread, once it listens
        def client():
            with urllib.request.urlopen(url + "/thread", timeout=10) as r:
                seen["answered_on"] = json.load(r)["thread"]
            seen["loop_running_then"] = not stop.is_set()
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=client, daemon=True).start()

    def loop() -> None:
        seen["loop_on_main"] = threading.current_thread() is threading.main_thread()
        seen["loop_stopped"] = stop.wait(30)

    try:
        got = serve(app, sock, 1.0, ready, loop, stop.set)
    finally:
        sock.close()
    assert got == ("SIGTERM", 0)  # no stream was open when the drain time ended
    assert seen == {"loop_on_main": True, "answered_on": "llamactl-http", "loop_running_then": True,
                    "loop_stopped": True}
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler again


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_client_slow_to_send_its_headers_is_closed(parser, monkeypatch):
    """A connection whose request headers have not ended after header_timeout_s is closed (a
    slow-headers client holds nothing); a prompt client is answered."""
    import socket
    import time

    from llamactl.serve import server

    if parser == "httptools":
        pytest.importorskip("httptools")
    monkeypatch.setattr(server, "http_stack", lambda: (parser, "asyncio"))
    app = Starlette(routes=[Route("/thread", _thread_name)])
    sock = bind("127.0.0.1", 0)
    stop, seen = threading.Event(), {}

    def ready(url: str) -> None:
        def client():
            host, port = url.split("//")[1].split(":")
            with socket.create_connection((host, int(port))) as slow:
                slow.sendall(b"GET /thread HTTP/1.1\r\nHost: x\r\n")  # and then nothing
                t0 = time.perf_counter()
                slow.settimeout(10)
                seen["closed"] = slow.recv(100) == b""  # the server closed it
                seen["after_s"] = time.perf_counter() - t0
            with urllib.request.urlopen(url + "/thread", timeout=10) as r:
                seen["answered"] = r.status == 200
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=client, daemon=True).start()

    try:
        serve(app, sock, 1.0, ready, lambda: stop.wait(30), stop.set, header_timeout_s=0.5)
    finally:
        sock.close()
    assert seen["closed"] and 0.3 < seen["after_s"] < 5 and seen["answered"], seen
