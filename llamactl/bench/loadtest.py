"""`bench --url`: a load test of any OpenAI-compatible server (llamactl's, vLLM's, llama.cpp's).

An asyncio HTTP client (llamactl/bench/httpstream.py for http://, httpx for https:// and the GETs)
streams /v1/completions requests: closed loop (`concurrency` clients,
each sending its next request when the last one ended) or, with `rate`, Poisson arrivals of that
many requests a second (at most `concurrency` in flight). Prompts are random words, `prompt_len`
of them or uniform in a range (the server's usage field gives their token count), after a shared
prefix of `shared_prefix` words (one of `prefix_groups` prefixes, as system prompts are), or the
prompts of a JSONL file (`dataset`); answers are `gen_len` tokens (or uniform in a range) with EOS
ignored (`ignore_eos`, as vLLM and llama.cpp take it). One row a concurrency, in bench's JSON
schema: TTFT (request sent -> first token's chunk), inter-token latency (between a stream's
chunks), end-to-end latency, requests/s, output tokens/s and errors; with latency targets the
goodput (requests/s that met both), with a GPU's hourly price the dollars per million output tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any, Callable

from pathlib import Path

from llamactl import __version__
from llamactl.bench import httpstream
from llamactl.bench.stats import median, percentile
from llamactl.errors import InputError, MissingDependencyError
from llamactl.folder.artifact import user_path

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
    prompt_max: int | None = None  # prompts of prompt_len..prompt_max words (uniform); None: prompt_len
    gen_max: int | None = None  # answers of gen_len..gen_max tokens (uniform); None: gen_len
    shared_prefix: int = 0  # words every prompt begins with (one of prefix_groups prefixes)
    prefix_groups: int = 1
    dataset: str | None = None  # JSONL: {"prompt": str} or {"messages": [...]} a line (or a bare string)
    slo_ttft_ms: float | None = None  # goodput: requests whose TTFT and mean ITL meet these
    slo_itl_ms: float | None = None
    gpu_hourly_cost: float | None = None  # USD an hour of the server's GPU(s): $ per million output tokens
    rate: float | None = None  # requests a second (Poisson); None: closed loop
    ramp_up_s: float = 0.0  # closed loop: the clients start this many seconds apart in all (not at once)
    model: str | None = None  # None: the first of the server's /v1/models
    api_key: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    warmup: int = 1  # untimed requests first, one at a time (a server's lazy start-up)
    extra: dict | None = None  # more fields of every request's body (e.g. a response_format), over the defaults


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def requests_for(load: Load, n: int, seed: int) -> list[tuple[Any, int]]:
    """n (prompt, max_tokens) pairs: a prompt is a string, or a chat's messages (a dataset's)."""
    rng = random.Random(seed)
    gens = [rng.randint(load.gen_len, load.gen_max or load.gen_len) for _ in range(n)]
    if load.dataset:
        rows = read_dataset(load.dataset)
        return [(rows[(seed + i) % len(rows)], g) for i, g in enumerate(gens)]
    heads = prompts(load.prefix_groups, load.shared_prefix, 7_777) if load.shared_prefix else [""]
    out = []
    for i, g in enumerate(gens):
        own = prompts(1, rng.randint(load.prompt_len, load.prompt_max or load.prompt_len), rng.randrange(1 << 30))[0]
        head = heads[rng.randrange(len(heads))]
        out.append(((head + " " + own) if head else own, g))
    return out


def read_extra(value: str) -> dict:
    """--request-json: a JSON object, or a file holding one -> the fields; InputError otherwise."""
    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = user_path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--request-json {value}: not a JSON object, and no file to read ({type(e).__name__})",
                             "pass a JSON object or a file that holds one") from None
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise InputError(f"--request-json {value[:60]}: not a JSON object", "pass a JSON object or a file that holds one")
    return obj


def read_dataset(path: str) -> list[Any]:
    """The prompts of a JSONL file: a line is {"prompt": "..."}, {"messages": [...]} or "...";
    one clear error for a file that is none of these."""
    p = user_path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--dataset {path}: cannot read it ({type(e).__name__}: {e})",
                         "pass a UTF-8 JSONL file, one prompt or chat a line") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise InputError(f"--dataset {path}, line {n}: not JSON", "write one JSON value a line") from None
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
            rows.append(obj["messages"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]:
            rows.append(obj["prompt"])
        elif isinstance(obj, str) and obj:
            rows.append(obj)
        else:
            raise InputError(f"--dataset {path}, line {n}: no prompt", 'use {"prompt": "..."} or {"messages": [...]}')
    if not rows:
        raise InputError(f"--dataset {path}: no prompts in it", "add one JSON prompt or chat a line")
    return rows


async def _one(post, load: Load, model: str, prompt: Any, max_tokens: int | None = None) -> dict[str, Any]:
    """One streamed completion (a chat completion where prompt is messages); post(path, body
    bytes): an async context manager giving the response (status_code, aiter_lines(), aread()),
    as httpstream.Client.post and httpx's stream do."""
    chat = isinstance(prompt, list)
    ask = {"messages": prompt} if chat else {"prompt": prompt}
    body = json.dumps({"model": model, **ask, "max_tokens": max_tokens or load.gen_len, "temperature": 0,
                       "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
                       **(load.extra or {})}).encode()
    out: dict[str, Any] = {"ok": False, "chunks": [], "prompt_tokens": None, "output_tokens": None, "error": None}
    t0 = time.perf_counter()
    out["start"] = t0
    try:
        async with post("/v1/chat/completions" if chat else "/v1/completions", body) as resp:
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
                if obj.get("choices") and _has_text(obj["choices"][0]):
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


def _has_text(choice: dict) -> bool:
    """Whether a stream chunk carries output (a chat stream's first chunk may carry the role alone)."""
    delta = choice.get("delta")
    return bool(delta.get("content")) if isinstance(delta, dict) else "text" in choice


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def _level(post, load: Load, model: str, concurrency: int, texts: list[tuple[Any, int]]) -> tuple[list[dict], float]:
    """Every request of one concurrency level -> (results, wall time)."""
    results: list[dict] = []
    t0 = time.perf_counter()
    if load.rate is None:
        todo = iter(texts)

        async def worker(i: int):
            await asyncio.sleep(i * load.ramp_up_s / concurrency)  # client i joins i/concurrency of the ramp in
            for text, gen in todo:
                results.append(await _one(post, load, model, text, gen))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    else:
        rng, gate, tasks = random.Random(load.seed), asyncio.Semaphore(concurrency), []

        async def send(text, gen):
            async with gate:
                results.append(await _one(post, load, model, text, gen))

        for text, gen in texts:
            tasks.append(asyncio.ensure_future(send(text, gen)))
            await asyncio.sleep(rng.expovariate(load.rate))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def tpot_ms(r: dict) -> float:
    """A request's time per output token after its first, ms: a chunk may carry several tokens (a
    speculating server's kept proposals), so the gaps between chunks are not the gaps between tokens."""
    return (r["end"] - r["chunks"][0]) * 1000 / (r["output_tokens"] - 1)


def goodput(results: list[dict], wall: float, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> float:
    """Requests a second that succeeded within both targets: TTFT, and the mean time between
    their tokens (None: no target)."""
    def met(r):
        ttft = (r["chunks"][0] - r["start"]) * 1000
        gaps = len(r["chunks"]) - 1
        itl = (r["chunks"][-1] - r["chunks"][0]) * 1000 / gaps if gaps else 0.0
        return (slo_ttft_ms is None or ttft <= slo_ttft_ms) and (slo_itl_ms is None or itl <= slo_itl_ms)

    return sum(1 for r in results if r["ok"] and met(r)) / wall


def summarize(results: list[dict], wall: float, load: Load | None = None) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    ttft = [r["chunks"][0] - r["start"] for r in ok]
    itl = [(b - a) * 1000 for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["end"] - r["start"] for r in ok]
    tpot = [tpot_ms(r) for r in ok if (r["output_tokens"] or 0) > 1]
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
        "tpot_ms_mean": sum(tpot) / len(tpot) if tpot else None, "tpot_ms_p50": pct(tpot, 50),
        "e2e_s_p50": pct(e2e, 50), "e2e_s_p95": pct(e2e, 95),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "output_tokens_mean": out_tokens / len(ok) if ok else None,
        **_targets(results, wall, out_tokens, load),
    }


def _targets(results: list[dict], wall: float, out_tokens: int, load: Load | None) -> dict[str, Any]:
    """goodput_requests_s under the latency targets, usd_per_million_output_tokens at the GPU's price."""
    out: dict[str, Any] = {}
    if load is not None and (load.slo_ttft_ms is not None or load.slo_itl_ms is not None):
        out["goodput_requests_s"] = goodput(results, wall, load.slo_ttft_ms, load.slo_itl_ms)
        out["slo"] = {"ttft_ms": load.slo_ttft_ms, "itl_ms": load.slo_itl_ms}
    if load is not None and load.gpu_hourly_cost is not None and out_tokens:
        out["usd_per_million_output_tokens"] = load.gpu_hourly_cost / 3600 * wall / out_tokens * 1e6
    return out


def check_client() -> None:
    """MissingDependencyError where the load test's HTTP client is not installed."""
    if find_spec("httpx") is None:
        raise MissingDependencyError("httpx", "serve", "the load test (bench --url, --serve)")


async def _run(load: Load, on_row: Callable[[dict], None]) -> list[dict]:
    import httpx

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
        r = await _one(post, load, model, *requests_for(load, 1, load.seed + 10_000 + i)[0])
        if not r["ok"]:
            raise InputError(f"{load.url}: the warm-up request failed ({r['error']})",
                             "check the server, --model and --api-key")
    rows = []
    for c in load.concurrency:
        before = await _server_metrics(client)
        results, wall = await _level(post, load, model, c, requests_for(load, load.requests, load.seed + c))
        after = await _server_metrics(client)
        loop = "closed loop" + (f", {load.ramp_up_s:g} s ramp-up" if load.ramp_up_s else "")
        row = {"model": model, "stage": "server " + (f"rate {load.rate:g}/s" if load.rate else loop),
               "batch": c, "concurrency": c, "prompt_len": _span(load.prompt_len, load.prompt_max),
               "gen_len": _span(load.gen_len, load.gen_max), "url": load.url, **summarize(results, wall, load)}
        if load.shared_prefix:
            row["shared_prefix"] = {"words": load.shared_prefix, "groups": load.prefix_groups}
        if load.dataset:
            row["dataset"] = load.dataset
        if before and after:  # llamactl's server: where the level's time went on its side
            row.update(_server_side(before, after, row["requests"]))
        rows.append(row)
        on_row(row)
    return rows


def _span(lo: int, hi: int | None) -> int | str:
    return lo if hi is None or hi == lo else f"{lo}:{hi}"


# besides llamactl_engine_*: the server's time to first token (submit to the first token handed
# out), the CPU time of its HTTP thread, and its KV pool's prefix hits
SERVER_METRICS = ("llamactl_time_to_first_token_seconds_sum", "llamactl_time_to_first_token_seconds_count",
                  "llamactl_http_thread_cpu_seconds", "llamactl_prefix_cache_hit_tokens",
                  "llamactl_prefix_cache_queried_tokens")


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
    mean time to first token, its HTTP thread's CPU a request, its prefix hit rate and its
    speculation's acceptance)."""
    d = {k: v if k.endswith("_max_seconds") else v - before.get(k, 0.0) for k, v in after.items()}
    out: dict[str, Any] = {"engine": {k.removeprefix("llamactl_engine_"): v for k, v in d.items()
                                      if k.startswith("llamactl_engine_")}}
    server = {}
    count = d.get("llamactl_time_to_first_token_seconds_count", 0.0)
    if count:
        server["ttft_ms_mean"] = 1000 * d["llamactl_time_to_first_token_seconds_sum"] / count
    if "llamactl_http_thread_cpu_seconds" in d and requests:
        server["http_cpu_ms_per_request"] = 1000 * d["llamactl_http_thread_cpu_seconds"] / requests
    if d.get("llamactl_prefix_cache_queried_tokens"):
        server["prefix_hit_rate"] = d.get("llamactl_prefix_cache_hit_tokens", 0.0) / d["llamactl_prefix_cache_queried_tokens"]
    if d.get("llamactl_engine_spec_proposed"):  # serve --draft: the proposals its verify steps kept
        server["spec_acceptance"] = d.get("llamactl_engine_spec_accepted", 0.0) / d["llamactl_engine_spec_proposed"]
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
