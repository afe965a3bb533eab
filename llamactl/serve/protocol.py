"""OpenAI's completion and chat-completion requests -> checked values; responses and stream chunks.

Field names and defaults follow OpenAI's API (temperature 1, top_p 1, max_tokens 16 for
completions and the rest of the context for chat), with top_k and ignore_eos as vLLM and
llama.cpp's servers take them, and llamactl's `speculate` (false: no speculative steps for this
request where the server has --draft). A bad field is an ApiError naming it, answered as a 4xx.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from llamactl.serve import grammar, tools
from llamactl.serve.errors import ApiError

MAX_STOP = 4  # stop strings a request may give, as OpenAI allows
MAX_STOP_IDS = 64  # stop_token_ids a request may give
MAX_N = 16  # choices a request may ask for (n)
MAX_BIAS = 300  # logit_bias entries (runtime.sampling.MAX_BIAS)
MAX_LOGPROBS = 20  # alternatives a token's log-probability may come with (runtime.sampling.TOP_LOGPROBS)
SEED_MOD = 2**63


MAX_BODY = 8 << 20  # bytes of a request body, by default (serve --max-request-bytes)

@dataclass
class Ask:
    """A checked request: the prompt (text, token ids or chat messages) and the settings."""

    chat: bool
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None  # None: the rest of the context (chat), else given or 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    speculate: bool = True  # llamactl's: false keeps this request out of speculative steps (serve --draft)
    n: int = 1  # choices, each drawn with its own seed (seed + i where a seed is given)
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # vLLM's: no stop token before this many tokens
    tools: tuple[list[dict], str | dict] | None = None  # a chat's tools and tool_choice (serve.tools.check's)
    echo: bool = False  # completions: the prompt first (with its log-probabilities where logprobs is given)
    grammar: tuple[str, str, str] | None = None  # structured output (serve.grammar.spec's), compiled into
    compiled: object | None = None  # ... this on the tokenizing thread

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools the model may call (given, and tool_choice not none), else None."""
        return self.tools[0] if self.tools and self.tools[1] != "none" else None
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: token ids that end a choice


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{name} must be a number, not {type(v).__name__}", name)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise ApiError(400, f"{name} {v} is out of range: use {'more than' if lo_open else 'from'} {lo} to {hi}", name)
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, not {type(v).__name__}", name)
    if v < lo or (hi is not None and v > hi):
        raise ApiError(400, f"{name} {v} is out of range: use {lo} or more" + (f", up to {hi}" if hi else ""), name)
    return v


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false, not {type(v).__name__}", name)
    return v


def _unsupported(body: dict) -> None:
    """Fields llamactl does not implement: refused when they would change the answer."""
    checks = {"suffix": lambda v: bool(v)}
    for name, bad in checks.items():
        try:
            refused = bad(body.get(name))
        except TypeError:
            refused = True
        if refused:
            raise ApiError(400, f"{name} is not supported by this server", name)


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {token id (a string or an integer): bias from -100 to 100}, at most
    MAX_BIAS entries -> ((id, bias), ...) (ids checked against the vocabulary at submission)."""
    if v is None:
        return ()
    if not isinstance(v, dict) or len(v) > MAX_BIAS:
        raise ApiError(400, f"logit_bias must be an object of up to {MAX_BIAS} token ids to biases", "logit_bias")
    out = []
    for key, bias in v.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id", "logit_bias") from None
        if tid < 0 or isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias: token {key!r} needs an id of 0 or more and a bias from -100 to 100",
                           "logit_bias")
        out.append((tid, float(bias)))
    return tuple(out)


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives a request asks for with each token's log-probability, or None: completions
    take `logprobs` (0 to 20), chats `logprobs: true` and `top_logprobs` (0 to 20)."""
    if not chat:
        return _integer(body, "logprobs", 0, MAX_LOGPROBS)
    on = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not on:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if on else None


def logprobs_block(chat: bool, entries: list[tuple[str, float | None, list[tuple[str, float]]]],
                   offset: int = 0) -> dict:
    """OpenAI's `logprobs` of a choice (or of a stream chunk) for its tokens: entries (the token's
    text, its log-probability (None: an echoed prompt's first token), its alternatives as (text,
    log-probability)); offset: the text's length before the first (completions' text_offset)."""
    if chat:
        def one(t: str, lp: float) -> dict:
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        return {"content": [one(t, lp) | {"top_logprobs": [one(a, v) for a, v in tops]} for t, lp, tops in entries]}
    offsets, at = [], offset
    for t, _, _ in entries:
        offsets.append(at)
        at += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if lp is None else dict(tops) for _, lp, tops in entries], "text_offset": offsets}


def _messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a string role", where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ApiError(400, f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
            raise ApiError(400, f"{where}.tool_calls must be an assistant's list of calls", f"{where}.tool_calls")
        if content is None and calls:  # an assistant's calls, in text for templates that do not place them
            content = json.dumps([c.get("function") for c in calls if isinstance(c, dict)], ensure_ascii=False)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        msg = {"role": m["role"], "content": content}
        msg |= {k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}
        out.append(msg)
    return out


def _prompt(v: Any) -> str | list[int]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise ApiError(400, "prompt is empty", "prompt")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise ApiError(400, "several prompts in one request are not supported: send one request each", "prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")


def parse(raw: bytes, chat: bool, model_name: str) -> Ask:
    """A request body -> Ask; raises ApiError (400, 404 for another model's name)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON ({type(e).__name__}: {str(e)[:80]})") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise ApiError(400, "the request body nests too deep: send a flat JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if model not in (None, "", model_name):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                       code="model_not_found")
    _unsupported(body)
    ask = Ask(chat=chat)
    if chat:
        if "messages" not in body:
            raise ApiError(400, "messages is required", "messages")
        ask.messages = _messages(body["messages"])
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", "prompt")
        ask.prompt = _prompt(body["prompt"])
        limit, name = body.get("max_tokens"), "max_tokens"
    ask.max_tokens = _integer({name: limit}, name, 1)
    if ask.max_tokens is None and not chat:
        ask.max_tokens = 16
    ask.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    ask.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _integer(body, "top_k", -1)
    ask.top_k = 0 if top_k is None or top_k == -1 else top_k  # -1 and 0: off, as in vLLM and llama.cpp
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)
    ask.seed = None if seed is None else seed % SEED_MOD
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)
                             or len(stop) > MAX_STOP):
        raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOP} strings", "stop")
    ask.stop = [s for s in (stop or []) if s]
    ask.stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        ask.include_usage = _flag(opts, "include_usage")
    ask.ignore_eos = _flag(body, "ignore_eos")
    ask.speculate = _flag(body, "speculate", True)
    ask.n = _integer(body, "n", 1, MAX_N) or 1
    best_of = _integer(body, "best_of", 1, MAX_N)
    if best_of not in (None, ask.n):
        raise ApiError(400, f"best_of {best_of} with n {ask.n}: choosing the best of more choices ranks them by "
                       "log-probability, which this server does not compute yet; pass best_of equal to n, or leave "
                       "it out", "best_of")
    ask.logprobs = _logprobs(body, chat)
    ask.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    ask.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    ask.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True)
    ask.logit_bias = _logit_bias(body.get("logit_bias"))
    ask.min_tokens = _integer(body, "min_tokens", 0) or 0
    ask.grammar = grammar.spec(body)
    ask.echo = _flag(body, "echo")
    if ask.echo and chat:
        raise ApiError(400, "echo is for completions", "echo")
    if not chat and (body.get("tools") or body.get("tool_choice") not in (None, "none")):
        raise ApiError(400, "tools are for chats: send them to /v1/chat/completions", "tools")
    ask.tools = tools.check(body) if chat else None
    forced = tools.forced_schema(*ask.tools) if ask.tools else None
    if forced is not None:
        if ask.grammar is not None:
            raise ApiError(400, "a required or named tool_choice and a response_format: give one", "tool_choice")
        ask.grammar = ("json", forced, "tool_choice")
    if ask.max_tokens is not None and ask.min_tokens > ask.max_tokens:
        raise ApiError(400, f"min_tokens {ask.min_tokens} is more than max_tokens {ask.max_tokens}", "min_tokens")
    ids = body.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) > MAX_STOP_IDS
                            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ApiError(400, f"stop_token_ids must be a list of up to {MAX_STOP_IDS} token ids", "stop_token_ids")
    ask.stop_token_ids = list(ids or [])
    return ask


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk(rid: str, model: str, chat: bool, text: str | None, finish: str | None, first: bool = False,
          index: int = 0, logprobs: dict | None = None, calls: list[dict] | None = None) -> dict:
    """One server-sent event's object of a stream (of choice `index`; logprobs: logprobs_block's
    of its token; calls: a chat's tool_calls, sent whole)."""
    if chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = [c | {"index": j} for j, c in enumerate(calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}


def whole(rid: str, model: str, chat: bool, choices: list[tuple], prompt_tokens: int,
          completion_tokens: int) -> dict:
    """The response to a request without stream: choices [(text, finish reason, logprobs_block's
    or None, a chat's tool_calls or None)], in order."""
    def one(i: int, text: str, finish: str, logprobs: dict | None, calls: list[dict] | None = None) -> dict:
        if chat and calls:
            return {"index": i, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                    "logprobs": logprobs, "finish_reason": "tool_calls"}
        if chat:
            return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}

    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [one(i, *c) for i, c in enumerate(choices)],
            "usage": usage(prompt_tokens, completion_tokens)}
