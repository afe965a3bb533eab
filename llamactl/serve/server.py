"""The server process: the app on uvicorn, on a socket bound here (a busy port is one clear line),
stopped by SIGTERM or Ctrl-C: it stops accepting, lets the streams in flight end (at most
`drain_s`), stops the engine and returns."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
from typing import Callable

from llamactl.errors import InputError


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


def serve(app, sock: socket.socket, drain_s: float, on_ready: Callable[[str], None]) -> str | None:
    """Run until SIGTERM or SIGINT; returns the signal's name (None if the server stopped by itself)."""
    import uvicorn

    got: list[int] = []

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal once stopped (killing us with it): note it instead
            def on_signal(sig, frame):
                got.append(sig)
                self.handle_exit(sig, frame)

            old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = sock.getsockname()[:2]
                on_ready(f"http://{host if ':' not in host else f'[{host}]'}:{port}")

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=max(1, int(drain_s)), timeout_keep_alive=5)
    Server(config).run(sockets=[sock])
    return signal.Signals(got[0]).name if got else None
