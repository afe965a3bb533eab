"""Real `llamactl serve` processes on 127.0.0.1 for the tests (CPU), a streamed request's events,
and the servers' fixtures (module-scoped: each module that imports one runs its own server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest


class Server:
    def __init__(self, args: list[str], env: dict | None = None):
        cmd = [sys.executable, "-m", "llamactl", "serve", "--port", "0", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if " on http://" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(300)
        line = next((l for l in self.lines if " on http://" in l), None)
        assert line, "".join(self.lines)
        self.url = line.split(" on ")[1].split()[0]
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def stream_events(client, path: str, body: dict) -> tuple[list[dict], str]:
    """A streamed request -> (its event objects, the text they carry)."""
    events, text = [], ""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    events.append("[DONE]")
                    break
                ev = json.loads(line[6:])
                events.append(ev)
                for c in ev.get("choices", []):
                    text += c.get("text") or c.get("delta", {}).get("content") or ""
    return events, text


@pytest.fixture(scope="module")
def server():
    s = Server(["--max-batch", "4", "--max-queue", "8", "--max-seq", "256", "--dtype", "float32"])  # exact: as the reference
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A tiny random model with a 4096-token context (requests that run for seconds) and a chat template."""
    from conftest import make_hf_model

    folder = make_hf_model(tmp_path_factory.mktemp("long") / "tiny-chat", kv_heads=2, max_pos=4096)
    cfg = folder / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    cfg.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def small_server(long_model):
    """One slot, one queue place, an API key from the environment, an 8-bit KV cache."""
    s = Server([str(long_model), "--max-batch", "1", "--max-queue", "1", "--kv-dtype", "int8"],
               env={"LLAMACTL_API_KEY": "k3y"})
    s.client.headers["Authorization"] = "Bearer k3y"
    yield s
    s.stop()
