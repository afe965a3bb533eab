"""A `llamactl serve` child process for `bench --serve`: started on a free port, stopped after."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from typing import Callable, Iterator

from llamactl.errors import InputError
from llamactl.options import API_KEY_VARIABLE

READY = re.compile(r"serving .* on (http://\S+) ")


@contextlib.contextmanager
def spawned(model: str, max_batch: int, max_seq: int, device: str, dtype: str, synthetic: str | None,
            synthetic_quant: str | None, api_key: str | None, log: Callable[[str], None],
            mode: str | None = None, start_timeout_s: float = 1800) -> Iterator[str]:
    """Start the server (model is ignored with synthetic), yield its URL once it listens, SIGTERM
    it at the end. max_seq: the tokens a slot holds (a load test's prompt and answer, with room)."""
    cmd = [sys.executable, "-m", "llamactl", "serve", "--port", "0", "--max-batch", str(max_batch),
           "--max-seq", str(max_seq), "--device", device, "--dtype", dtype] + (["--mode", mode] if mode else [])
    cmd += ["--synthetic", synthetic] + (["--synthetic-quant", synthetic_quant] if synthetic_quant else []) \
        if synthetic else [model]
    env = dict(os.environ)
    if api_key:
        env[API_KEY_VARIABLE] = api_key  # kept off the command line
    log(f"starting {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read():
        for line in proc.stderr:
            lines.append(line.rstrip())
            m = READY.search(line)
            if m and not url:
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        found.wait(start_timeout_s)
        if not url:
            last = next((l for l in reversed(lines) if l.strip()), "no output")
            raise InputError(f"the server did not start: {last}", "run the `llamactl serve` command above to see why")
        log(lines[-1])
        yield url[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
