"""`bench --url`: a load test of any OpenAI-compatible server (llamactl's, vLLM's, llama.cpp's).

An asyncio HTTP client (llamactl/bench/httpstream.py for http://, httpx for https:// and the GETs)
streams /v1/completions requests: closed loop (`concurrency` clients,
each sending its next request when the last one ended) or, with `rate`, Poisson arrivals of that
many requests a second (at most `concurrency` in flight). Prompts are `prompt_len` random words
(the server's usage field gives its token count), answers `gen_len` tokens with EOS ignored
(`ignore_eos`, as vLLM and llama.cpp take it). One row a concurrency, in bench's JSON schema:
TTFT (request sent -> first token's chunk), inter-token latency (between a stream's chunks),
end-to-end latency, requests/s, output tokens/s and errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

from llamactl.errors import InputError
from llamactl.bench.stats import median, percentile

WORDS = ("the of and to in is was for on that with as by at from his her an which are this be had it not were "
         "time people year way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue").split()


@dataclass
class Load:
    url: str
    concurrency: list[int]
    requests: int = 64
    prompt_len: int = 128
    gen_len: int = 256
    rate: float | None = None  # requests a second (Poisson); None: closed loop
    model: str | None = None  # None: the first of the server's /v1/models
    api_key: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    warmup: int = 1  # untimed requests first, one at a time (a server's lazy start-up)


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def _one(post, load: Load, model: str, prompt: str) -> dict[str, Any]:
    """One streamed completion; post(path, body bytes): an async context manager giving the
    response (status_code, aiter_lines(), aread()), as httpstream.Client.post and httpx's stream do."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": load.gen_len, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    out: dict[str, Any] = {"ok": False, "chunks": [], "prompt_tokens": None, "output_tokens": None, "error": None}
    t0 = time.perf_counter()
    out["start"] = t0
    try:
        async with post("/v1/completions", body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out["error"] = f"HTTP {resp.status_code}: {_message(text)}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    out["error"] = f"stream error: {_message(data)}"
                    return out
                if obj.get("choices"):
                    out["chunks"].append(time.perf_counter())
                if obj.get("usage"):
                    out["prompt_tokens"] = obj["usage"].get("prompt_tokens")
                    out["output_tokens"] = obj["usage"].get("completion_tokens")
    except Exception as e:  # a refused connection, a timeout, a broken stream: an error of this request
        out["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        return out
    out["end"] = time.perf_counter()
    out["ok"] = bool(out["chunks"])
    if out["output_tokens"] is None:
        out["output_tokens"] = len(out["chunks"])
    if not out["ok"]:
        out["error"] = "the stream had no tokens"
    return out


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def _level(post, load: Load, model: str, concurrency: int, texts: list[str]) -> tuple[list[dict], float]:
    """Every request of one concurrency level -> (results, wall time)."""
    results: list[dict] = []
    t0 = time.perf_counter()
    if load.rate is None:
        todo = iter(texts)

        async def worker():
            for text in todo:
                results.append(await _one(post, load, model, text))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        rng, gate, tasks = random.Random(load.seed), asyncio.Semaphore(concurrency), []

        async def send(text):
            async with gate:
                results.append(await _one(post, load, model, text))

        for text in texts:
            tasks.append(asyncio.ensure_future(send(text)))
            await asyncio.sleep(rng.expovariate(load.rate))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def summarize(results: list[dict], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    ttft = [r["chunks"][0] - r["start"] for r in ok]
    itl = [(b - a) * 1000 for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["end"] - r["start"] for r in ok]
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    prompt_tokens = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    errors = [r["error"] for r in results if not r["ok"]]

    def pct(xs, q, scale=1.0):
        return percentile(xs, q) * scale if xs else None

    return {
        "requests": len(results), "errors": len(errors), "error_examples": sorted(set(errors))[:5],
        "duration_s": wall, "requests_s": len(ok) / wall, "output_tok_s": out_tokens / wall,
        "decode_tok_s": out_tokens / wall,  # bench's column (and --compare's): output tokens/s of all streams
        "prefill_tok_s": sum(prompt_tokens) / wall,  # prompt tokens taken per second
        "ttft_s": median(ttft) if ttft else None,
        "ttft_ms_p50": pct(ttft, 50, 1000), "ttft_ms_p95": pct(ttft, 95, 1000), "ttft_ms_p99": pct(ttft, 99, 1000),
        "itl_ms_p50": pct(itl, 50), "itl_ms_p95": pct(itl, 95),
        "latency_ms_p50": pct(itl, 50), "latency_ms_p95": pct(itl, 95),  # bench's per-token columns: the ITL
        "e2e_s_p50": pct(e2e, 50), "e2e_s_p95": pct(e2e, 95),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "output_tokens_mean": out_tokens / len(ok) if ok else None,
    }


async def _run(load: Load, on_row: Callable[[dict], None]) -> list[dict]:
    import httpx

    from llamactl.bench import httpstream

    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    most = max(load.concurrency) + 4
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    async with httpx.AsyncClient(base_url=load.url, headers=headers, timeout=load.timeout_s, limits=limits) as client:
        if load.url.startswith("http://"):  # the streams on plain asyncio (httpstream's docstring: why)
            streams = httpstream.Client(load.url, headers, most)
            post = _timed(streams.post, load.timeout_s)
        else:
            streams = None
            post = lambda path, body: client.stream("POST", path, content=body,  # noqa: E731
                                                    headers={"Content-Type": "application/json"})
        try:
            return await _levels(client, post, load, on_row)
        finally:
            if streams is not None:
                await streams.aclose()


def _timed(post, timeout_s: float):
    """post(path, body) whose whole exchange (the body read included) ends within timeout_s."""
    @contextlib.asynccontextmanager
    async def timed(path: str, body: bytes):  # asyncio.timeout's work, which Python 3.10 lacks
        expired = []
        task = asyncio.current_task()
        alarm = asyncio.get_running_loop().call_later(timeout_s, lambda: (expired.append(1), task.cancel()))
        try:
            async with post(path, body) as resp:
                yield resp
        except asyncio.CancelledError:
            if expired:
                raise TimeoutError(f"no answer within {timeout_s:g} s") from None
            raise
        finally:
            alarm.cancel()
    return timed


async def _levels(client, post, load: Load, on_row: Callable[[dict], None]) -> list[dict]:
    """The warm-up requests, then each concurrency level's row; client (httpx): the GETs."""
    model = load.model or await _first_model(client, load.url)
    for i in range(load.warmup):
        r = await _one(post, load, model, prompts(1, load.prompt_len, load.seed + 10_000 + i)[0])
        if not r["ok"]:
            raise InputError(f"{load.url}: the warm-up request failed ({r['error']})",
                             "check the server, --model and --api-key")
    rows = []
    for c in load.concurrency:
        before = await _server_metrics(client)
        results, wall = await _level(post, load, model, c, prompts(load.requests, load.prompt_len, load.seed + c))
        after = await _server_metrics(client)
        row = {"model": model, "stage": "server " + (f"rate {load.rate:g}/s" if load.rate else "closed loop"),
               "batch": c, "concurrency": c, "prompt_len": load.prompt_len, "gen_len": load.gen_len,
               "url": load.url, **summarize(results, wall)}
        if before and after:  # llamactl's server: where the level's time went on its side
            row.update(_server_side(before, after, row["requests"]))
        rows.append(row)
        on_row(row)
    return rows


# besides llamactl_engine_*: the server's time to first token (submit to the first token handed
# out) and the CPU time of its HTTP thread
SERVER_METRICS = ("llamactl_time_to_first_token_seconds_sum", "llamactl_time_to_first_token_seconds_count",
                  "llamactl_http_thread_cpu_seconds")


async def _server_metrics(client) -> dict[str, float] | None:
    """The values of a llamactl server's /metrics a level reads before and after it:
    llamactl_engine_* and SERVER_METRICS (None for other servers)."""
    try:
        resp = await client.get("/metrics")
    except Exception:
        return None
    if resp.status_code != 200:
        return None
    out = {}
    for line in resp.text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("llamactl_engine_") or name in SERVER_METRICS:
            out[name] = float(value)
    return out or None


def _server_side(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, Any]:
    """A level's rows from the server's side: "engine" (where its step loop spent the level's
    time: llamactl_engine_* over the level, the slowest forward as it stands) and "server" (its
    mean time to first token, its HTTP thread's CPU a request)."""
    d = {k: v if k.endswith("_max_seconds") else v - before.get(k, 0.0) for k, v in after.items()}
    out: dict[str, Any] = {"engine": {k.removeprefix("llamactl_engine_"): v for k, v in d.items()
                                      if k.startswith("llamactl_engine_")}}
    server = {}
    count = d.get("llamactl_time_to_first_token_seconds_count", 0.0)
    if count:
        server["ttft_ms_mean"] = 1000 * d["llamactl_time_to_first_token_seconds_sum"] / count
    if "llamactl_http_thread_cpu_seconds" in d and requests:
        server["http_cpu_ms_per_request"] = 1000 * d["llamactl_http_thread_cpu_seconds"] / requests
    if server:
        out["server"] = server
    return out


async def _first_model(client, url: str) -> str:
    try:
        resp = await client.get("/v1/models")
    except Exception as e:
        raise InputError(f"{url}: no server answers ({type(e).__name__}: {str(e)[:120]})",
                         "start one (llamactl serve MODEL) or check --url") from None
    if resp.status_code != 200:
        raise InputError(f"{url}/v1/models answered HTTP {resp.status_code}: {_message(resp.text)}",
                         "check --api-key, or pass --model NAME")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise InputError(f"{url}/v1/models lists no model", "pass --model NAME") from None


def run(load: Load, on_row: Callable[[dict], None] = lambda r: None) -> dict[str, Any]:
    """The rows and the environment of the client, as bench's JSON result."""
    import platform

    from llamactl import __version__
    from llamactl.bench.trials import SCHEMA_VERSION, source_commit

    if not load.url.startswith(("http://", "https://")):
        raise InputError(f"--url {load.url!r} is not an http:// or https:// address", "for example --url http://127.0.0.1:8000")
    load.url = load.url.rstrip("/").removesuffix("/v1")
    rows = asyncio.run(_run(load, on_row))
    env = {"schema_version": SCHEMA_VERSION, "llamactl_version": __version__, "commit": source_commit(),
           "kind": "load test", "url": load.url, "requests": load.requests, "rate": load.rate,
           "device_name": f"server at {load.url}", "device": None, "torch": "-", "cuda": None, "dtype": "-",
           "copy_bandwidth_gbs": None, "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return {"env": env, "results": rows}
