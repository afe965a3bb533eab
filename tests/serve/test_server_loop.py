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
