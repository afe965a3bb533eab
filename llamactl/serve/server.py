"""The server process: the app on uvicorn on a thread of its own, on a socket bound here (a busy
port is one clear line), while the main thread runs the engine's step loop (on a CPU torch's
threads are the main thread's: serve.engine.Engine). SIGTERM or Ctrl-C (caught on the main
thread) stops accepting, lets the streams in flight end (at most `drain_s`), stops the engine
and returns."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
from typing import Callable

from llamactl.errors import InputError

GRACE_S = 10  # after the drain time: for the cut streams' last events to go out before uvicorn cancels them
HEADER_TIMEOUT_S = 10.0  # a connection whose first request's headers have not ended by then is closed


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); InputError when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError(f"--host {host}: not an address this machine has ({e.strerror})",
                         "use 127.0.0.1, 0.0.0.0 or one of this machine's addresses") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise InputError(f"port {port} on {host} is in use", "choose another --port, or stop what listens there") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise InputError(f"binding {host}:{port} is not allowed ({e.strerror})", "use a port above 1023") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise InputError(f"--host {host}: not an address of this machine", "use 127.0.0.1 or 0.0.0.0") from None
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def http_stack() -> tuple[str, str]:
    """(uvicorn's HTTP parser, its event loop): httptools and uvloop where they are installed (the
    serve extra), else the pure-Python h11 on asyncio's loop, which cost more CPU a request and a
    streamed token, under the GIL the engine's thread needs too (docs/bench/README.md)."""
    import importlib.util

    def have(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module hidden from imports
            return False

    return ("httptools" if have("httptools") else "h11"), ("uvloop" if have("uvloop") else "asyncio")


def with_header_deadline(protocol: type, seconds: float) -> type:
    """uvicorn's HTTP protocol class, closing a connection whose first request's headers have not
    ended `seconds` after it opened (uvicorn has no such timeout: a client sending its headers a
    byte at a time held a connection for as long as it liked). After the first request, uvicorn's
    keep-alive timeout bounds the idle time."""

    class Protocol(protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_deadline = self.loop.call_later(seconds, self._headers_late)

        def _headers_late(self) -> None:
            if self.cycle is None:  # no request's headers have ended on this connection
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._header_deadline.cancel()
            super().connection_lost(exc)

    return Protocol


def _protocol(parser: str, header_timeout_s: float) -> type:
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return with_header_deadline(base, header_timeout_s)


def serve(app, sock: socket.socket, drain_s: float, on_ready: Callable[[str], None],
          main: Callable[[], None], stop_main: Callable[[], None],
          open_streams: Callable[[], int] = lambda: 0,
          header_timeout_s: float = HEADER_TIMEOUT_S) -> tuple[str | None, int]:
    """Run the app until SIGTERM or SIGINT, and main() (the step loop) on this thread meanwhile;
    once the server has stopped, stop_main() ends main(). A signal stops the accepting; the
    streams in flight get drain_s to end, then stop_main() ends those left (each gets an error
    event and [DONE]: a client knows it was cut). Returns the signal's name (None if the server
    stopped by itself) and how many streams (open_streams()) were cut. A main() that ends first (a
    failed engine) leaves the server answering until a signal. header_timeout_s: a connection's
    first request must have sent its headers by then (with_header_deadline)."""
    import uvicorn

    got: list[int] = []
    cut: list[int] = []

    def end_the_rest() -> None:  # the drain time is over: the streams left end with an error event
        cut.append(open_streams())
        stop_main()

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # caught on the main thread (below), not on the server's
            yield

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = sock.getsockname()[:2]
                on_ready(f"http://{host if ':' not in host else f'[{host}]'}:{port}")

    parser, loop = http_stack()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            http=_protocol(parser, header_timeout_s), loop=loop,
                            timeout_graceful_shutdown=int(drain_s) + GRACE_S, timeout_keep_alive=5)
    server = Server(config)

    def on_signal(sig, frame):  # uvicorn's own handler re-raises the signal once stopped: note it instead
        got.append(sig)
        server.handle_exit(sig, frame)
        if len(got) == 1:
            timer = threading.Timer(drain_s, end_the_rest)
            timer.daemon = True
            timer.start()

    failed: list[BaseException] = []

    def http() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # raised again on the main thread
            failed.append(e)
        finally:
            stop_main()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="llamactl-http", daemon=True)
    try:
        thread.start()
        main()
        while thread.is_alive():  # a signal's handler runs between these waits
            thread.join(0.5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if failed:
        raise failed[0]
    return (signal.Signals(got[0]).name if got else None), sum(cut)
