"""The HTTP API over the engine: OpenAI's POST /v1/completions and /v1/chat/completions (whole or
streamed as server-sent events), GET /v1/models, /health and /metrics, as a Starlette app.

Each request is read, checked and tokenized on the event loop's side (tokenizing on a worker
thread), submitted to the engine, and its tokens detokenized as they arrive; the engine's thread
only steps the model. Every error is an OpenAI-style JSON object with a 4xx or 5xx status, and
never stops the others: a client that goes away has its request cancelled and its slot freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llamactl import ui
from llamactl.runtime.settings import Sampling
from llamactl.serve.engine import Engine, Event, Params, QueueFull, Rejected
from llamactl.serve.grammar import Grammars
from llamactl.serve.metrics import Metrics
from llamactl.serve.tools import ToolStream, system_message
from llamactl.serve.tools import parse as parse_calls
from llamactl.serve.protocol import (MAX_BODY, SEED_MOD, ApiError, Ask, chunk, logprobs_block, new_id, parse, usage,
                                     whole)
from llamactl.runtime.textstream import TextStream

BODY_TIMEOUT_S = 30.0  # a body that has not arrived in full by then is a 408 (a slow client holds nothing)


class Service:
    """What the routes share: the engine, the tokenizer (one copy to encode on a worker thread,
    one to decode on the event loop), the model's name, the API key and the metrics."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, vocab_size: int, api_key: str | None = None,
                 max_body: int = MAX_BODY):
        self.engine, self.model_name, self.vocab_size, self.api_key = engine, model_name, vocab_size, api_key
        self.max_body = max_body
        self.encoder, self.decoder = tokenizer, copy.deepcopy(tokenizer)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="llamactl-tokenize")
        # a text longer than this cannot fit the context, however it tokenizes: refused before the
        # tokenizer spends seconds on it while every request behind it waits
        self.max_text_bytes = engine.max_seq * _longest_token_bytes(tokenizer)
        self.metrics = Metrics(engine)
        self.created = int(time.time())
        self.grammars = Grammars(self.encoder, vocab_size, engine.eos_ids)

    def encode(self, ask: Ask) -> list[int]:
        """The prompt's token ids, and its grammar compiled (on the worker thread); ApiError when
        they cannot be made."""
        if ask.grammar is not None:
            ask.compiled = self.grammars.compile(ask.grammar)
        tok = self.encoder
        size = _text_bytes(ask)
        if size > self.max_text_bytes:
            raise ApiError(400, f"the prompt has {size} bytes of text; no text over {self.max_text_bytes} bytes fits "
                           f"this server's context of {self.engine.max_seq} tokens", "messages" if ask.chat else "prompt")
        if ask.chat:
            if not getattr(tok, "chat_template", None):
                raise ApiError(400, "this model has no chat template: send the prompt to /v1/completions, or start "
                               "the server with --chat-template NAME|FILE", "messages")
            try:
                ids = self._render(tok, ask)
            except Exception as e:  # a template is the folder's program: it can fail any way
                raise ApiError(400, f"the model's chat template failed on these messages ({type(e).__name__}: "
                               f"{str(e)[:160]})", "messages") from None
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
        if isinstance(ask.prompt, list):
            bad = next((t for t in ask.prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"prompt token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})",
                               "prompt")
            return ask.prompt
        return tok(ask.prompt).input_ids

    @staticmethod
    def _render(tok, ask: Ask):
        """A chat's token ids through the template, with its tools where it asks for calls: in the
        template's own place for them, else as a system message (serve.tools) where the template
        renders the same text with and without them."""
        tools = ask.offered_tools
        if tools is None:
            return tok.apply_chat_template(ask.messages, add_generation_prompt=True, tokenize=True)
        plain = tok.apply_chat_template(ask.messages, add_generation_prompt=True, tokenize=False)
        placed = tok.apply_chat_template(ask.messages, tools=tools, add_generation_prompt=True, tokenize=False)
        if placed != plain:
            return tok.apply_chat_template(ask.messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return tok.apply_chat_template([system_message(tools), *ask.messages], add_generation_prompt=True,
                                       tokenize=True)

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "a valid API key is required: send the header Authorization: Bearer KEY",
                           kind="authentication_error", code="invalid_api_key")


def _longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token of the vocabulary stands for (an upper bound: a
    byte-level or SentencePiece token's spelling is at least as long as its text)."""
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return max(len(str(p).encode()) for p in pieces if p is not None) or 1
    except Exception:  # a tokenizer without a vocabulary to list: the bound of any byte-level one
        return 256


def _text_bytes(ask: Ask) -> int:
    """The bytes of text a request asks to tokenize (0 for token ids)."""
    if ask.chat:
        return sum(len(json.dumps(m, ensure_ascii=False).encode()) for m in ask.messages)
    return len(ask.prompt.encode()) if isinstance(ask.prompt, str) else 0


class Completion:
    """One choice of a request: its engine request's tokens -> text pieces, with its stop strings
    and metrics."""

    def __init__(self, svc: Service, ask: Ask, prompt_tokens: int):
        self.svc, self.ask, self.prompt_tokens = svc, ask, prompt_tokens
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.tokens = 0
        self.request = None
        self.failed: ApiError | None = None  # its submission was refused (a choice after the first)
        self.ids: list[int] = []  # its prompt's token ids (submit)

    def submit(self, ids: list[int], seed: int) -> None:
        ask, engine, loop = self.ask, self.svc.engine, asyncio.get_running_loop()
        max_tokens = ask.max_tokens if ask.max_tokens is not None else engine.max_seq - len(ids)
        why = engine.fits(len(ids), max_tokens)
        if why:
            param = "max_tokens" if len(ids) < engine.max_seq else ("messages" if ask.chat else "prompt")
            raise ApiError(400, why, param, code="context_length_exceeded")
        for field, given in (("stop_token_ids", ask.stop_token_ids), ("logit_bias", [i for i, _ in ask.logit_bias])):
            bad = next((t for t in given if t >= self.svc.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"{field}: {bad} is outside the vocabulary (0 to {self.svc.vocab_size - 1})", field)
        sampling = Sampling(ask.temperature, ask.top_p, ask.top_k, seed, ask.presence_penalty, ask.frequency_penalty,
                            ask.repetition_penalty, ask.logit_bias, min(ask.min_tokens, max_tokens))
        params = Params(max_tokens, sampling, ask.ignore_eos, ask.speculate and ask.logprobs is None,
                        frozenset(ask.stop_token_ids), ask.logprobs, ask.compiled,
                        ask.logprobs if ask.echo else None)
        self.ids = ids
        try:
            self.request = engine.submit(ids, params, lambda ev: loop.call_soon_threadsafe(self.events.put_nowait, ev))
        except QueueFull as e:
            raise ApiError(429, f"the server is full ({e}); retry later", kind="rate_limit_error") from None
        except Rejected as e:
            raise ApiError(503, f"the server cannot take requests now: {e}", kind="server_error") from None
        self.svc.metrics.prompt_tokens.inc(len(ids))

    def _prompt_text(self) -> str:
        p = self.ask.prompt
        return p if isinstance(p, str) else self.svc.decoder.decode(self.ids)

    def _prompt_entries(self, scores: tuple) -> list[tuple[str, float | None, list]]:
        """The echoed prompt's logprobs entries: its first token's without a value, then each
        next one's (log-probability, alternatives) as the prefill computed them."""
        first = [(self.svc.decoder.decode(self.ids[:1]), None, [])]
        return first + [self._entry_of(t, lp, alts) for t, (lp, alts) in zip(self.ids[1:], scores)]

    def _entry(self, ev: Event) -> tuple[str, float, list[tuple[str, float]]] | None:
        """A generated token's log-probability entry (None where none was asked for)."""
        return None if ev.logprob is None else self._entry_of(ev.token, *ev.logprob)

    def _entry_of(self, token: int, value: float, alts) -> tuple[str, float, list[tuple[str, float]]]:
        """An entry for logprobs_block: the token's text, its value, its alternatives' texts and values."""
        text = self.svc.decoder.decode
        return text([token]), value, [(text([i]), v) for i, v in alts]

    async def pieces(self) -> AsyncIterator[tuple[str, str | None, tuple | None]]:
        """(text, None, entry) for each token (text may be empty; entry: its log-probability's,
        where asked for), then (the last text, finish reason "stop" or "length", None);
        raises ApiError when generation failed. Leaving early cancels the request."""
        if self.failed is not None:
            raise self.failed
        m, req = self.svc.metrics, self.request
        stream, last, reason = TextStream(self.svc.decoder, self.ask.stop), None, "cancelled"
        try:
            if self.ask.echo and self.ask.logprobs is None:  # the prompt first (with logprobs: its "prompt" event)
                yield self._prompt_text(), None, None
            while True:
                ev = await self.events.get()
                if ev.kind == "prompt":
                    yield self._prompt_text(), None, self._prompt_entries(ev.prompt)
                    continue
                if ev.kind == "done":
                    if ev.reason in ("error", "cancelled"):
                        reason = ev.reason
                        raise ApiError(500 if ev.reason == "error" else 503,
                                       f"generation {'failed: ' + ev.error if ev.error else 'was cancelled (the server is stopping)'}",
                                       kind="server_error")
                    reason = "stop" if ev.reason == "stop" else "length"
                    tail = stream.finish()
                    reason = "stop" if stream.stopped else reason
                    yield tail, reason, None
                    return
                self.tokens += 1
                m.generated_tokens.inc()
                (m.ttft.observe(ev.time - req.arrived) if last is None else m.itl.observe(ev.time - last))
                last = ev.time
                piece = stream.add(ev.token)
                if stream.stopped:
                    reason = "stop"
                    yield piece, "stop", self._entry(ev)
                    return
                yield piece, None, self._entry(ev)  # one chunk a token, as OpenAI streams (text held back: empty)
        finally:
            req.cancel()  # a stop string or a client gone: the slot is freed at the next step
            m.finished.labels(reason).inc()
            if last is not None:
                m.e2e.observe(last - req.arrived)


class Choices:
    """The n choices of a request, each its own engine request with its own seed (seed + i where
    the request gives one). The first is submitted at once, the others when its first token is out:
    its prompt's KV blocks are cached by then, so theirs are prefix hits, not n prefills."""

    def __init__(self, svc: Service, ask: Ask, ids: list[int]):
        self.ids, self.comps = ids, [Completion(svc, ask, len(ids)) for _ in range(ask.n)]
        base = ask.seed if ask.seed is not None else secrets.randbits(63)
        self.seeds = [(base + i) % SEED_MOD if ask.seed is not None or i == 0 else secrets.randbits(63)
                      for i in range(ask.n)]
        self.comps[0].submit(ids, self.seeds[0])  # its ApiError is the request's
        self.rest = asyncio.Event()

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.comps)

    def _start_rest(self) -> None:
        if self.rest.is_set():
            return
        for c, seed in zip(self.comps[1:], self.seeds[1:]):
            try:
                c.submit(self.ids, seed)
            except ApiError as e:
                c.failed = e
        self.rest.set()

    async def pieces(self) -> AsyncIterator[tuple[int, str, str | None, tuple | None]]:
        """(choice, text, finish, entry) as Completion.pieces gives each choice's, interleaved as
        they come; raises the first choice's ApiError. Leaving early cancels every choice."""
        if len(self.comps) == 1:
            async for piece, finish, entry in self.comps[0].pieces():
                yield 0, piece, finish, entry
            return
        out: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, comp: Completion) -> None:
            try:
                if i:
                    await self.rest.wait()
                async for piece, finish, entry in comp.pieces():
                    if i == 0:
                        self._start_rest()
                    await out.put((i, piece, finish, entry, None))
            except ApiError as e:
                await out.put((i, None, None, None, e))
            finally:
                if i == 0:
                    self._start_rest()
                await out.put((i, None, None, None, StopAsyncIteration()))

        tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(self.comps)]
        try:
            ended = 0
            while ended < len(tasks):
                i, piece, finish, entry, err = await out.get()
                if isinstance(err, StopAsyncIteration):
                    ended += 1
                elif err is not None:
                    raise err
                else:
                    yield i, piece, finish, entry
        finally:
            for t in tasks:
                t.cancel()


def _tool_streams(ask: Ask, n: int) -> list[ToolStream]:
    """A ToolStream a choice where a chat's output may be tool calls (tools given, tool_choice
    not none; required or named: held back whole), else none."""
    if ask.offered_tools is None:
        return []
    return [ToolStream(ask.offered_tools, forced=ask.tools[1] != "auto") for _ in range(n)]


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (else 413), in full within BODY_TIMEOUT_S (else 408); a
    client gone before it ends is one line in the log (499: nobody reads the answer)."""
    size = int(request.headers.get("content-length") or 0)
    if size > limit:
        raise ApiError(413, f"the request body has {size} bytes; the most is {limit} (--max-request-bytes)")

    async def read() -> bytes:
        chunks, total = [], 0
        async for part in request.stream():
            total += len(part)
            if total > limit:
                raise ApiError(413, f"the request body is over {limit} bytes (--max-request-bytes)")
            chunks.append(part)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s") from None
    except ClientDisconnect:
        peer = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        ui.log(f"{peer} went away before its request body ended", markup=False)
        raise ApiError(499, "the client went away before its request body ended") from None


async def _complete(request: Request, chat: bool) -> Response:
    svc: Service = request.app.state.service
    try:
        svc.check_key(request)
        ask = parse(await _read_body(request, svc.max_body), chat, svc.model_name)
        ids = await asyncio.get_running_loop().run_in_executor(svc.pool, svc.encode, ask)
        comp = Choices(svc, ask, ids)
    except ApiError as e:
        svc.metrics.rejected.labels(str(e.status)).inc()
        return _error(e)
    rid = new_id(chat)
    if ask.stream:
        return StreamingResponse(_events(comp, rid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(request, comp, rid)


async def _events(comp: Choices, rid: str) -> AsyncIterator[str]:
    """The stream as server-sent events: chunks (each choice's, as they come), an error object if
    generation failed, the usage chunk when asked for, then [DONE]."""
    svc, ask = comp.comps[0].svc, comp.comps[0].ask
    started: set[int] = set()
    offsets = [0] * len(comp.comps)  # each choice's text so far (completions' text_offset)
    held = _tool_streams(ask, len(comp.comps))  # where a choice's output may be tool calls
    try:
        async for i, piece, finish, entry in comp.pieces():
            entries = [] if entry is None else entry if isinstance(entry, list) else [entry]
            lp = logprobs_block(ask.chat, entries, offsets[i]) if entries else None
            offsets[i] += sum(len(e[0]) for e in entries)
            calls = None
            if held:
                piece = held[i].feed(piece)
                if finish is not None:
                    tail, calls = held[i].end()
                    piece, finish = piece + tail, "tool_calls" if calls else finish
            body = chunk(rid, svc.model_name, ask.chat, piece, finish, i not in started, i, lp, calls)
            yield f"data: {json.dumps(body)}\n\n"
            started.add(i)
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    if ask.include_usage:
        body = {"id": rid, "object": "chat.completion.chunk" if ask.chat else "text_completion",
                "created": int(time.time()), "model": svc.model_name, "choices": [],
                "usage": usage(comp.prompt_tokens, comp.tokens)}
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


async def _whole(request: Request, comp: Choices, rid: str) -> Response:
    async def collect() -> list[tuple[str, str, dict | None]]:
        n = len(comp.comps)
        parts, reasons, entries = [[] for _ in range(n)], ["length"] * n, [[] for _ in range(n)]
        async for i, piece, finish, entry in comp.pieces():
            parts[i].append(piece)
            reasons[i] = finish or reasons[i]
            if entry is not None:
                entries[i] += entry if isinstance(entry, list) else [entry]
        ask = comp.comps[0].ask
        tools = ask.offered_tools
        out = []
        for p, r, e in zip(parts, reasons, entries):
            text = "".join(p)
            out.append((text, r, logprobs_block(ask.chat, e) if ask.logprobs is not None else None,
                        parse_calls(text, tools) if tools else None))
        return out

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(gone())
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not task.done():  # the client went away: cancel its request (no one reads an answer)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    try:
        choices = task.result()
    except ApiError as e:
        return _error(e)
    first = comp.comps[0]
    return JSONResponse(whole(rid, first.svc.model_name, first.ask.chat, choices, comp.prompt_tokens, comp.tokens))


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def models(request: Request) -> Response:
    svc: Service = request.app.state.service
    try:
        svc.check_key(request)
    except ApiError as e:
        return _error(e)
    return JSONResponse({"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": svc.created,
                                                     "owned_by": "llamactl", "max_model_len": svc.engine.max_seq}]})


async def health(request: Request) -> Response:
    engine: Engine = request.app.state.service.engine
    if engine.failure:
        return JSONResponse({"status": "failed", "error": engine.failure}, status_code=503)
    return JSONResponse({"status": "ok", "running": engine.running, "waiting": engine.waiting,
                         "max_batch": engine.max_batch})


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(request.app.state.service.metrics.text(), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind))


def build_app(service: Service) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        service.engine.stop()  # after uvicorn has let the streams in flight end
        service.pool.shutdown(wait=False)

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: _http_error}, lifespan=lifespan)
    app.state.service = service
    return app
