"""Structured output (`response_format`, vLLM's `guided_json` / `guided_regex` / `guided_choice`)
through xgrammar: a request's grammar is compiled once on the tokenizing thread; while it runs,
a matcher follows its tokens on the engine's thread and gives, before each of its draws, the
bitmask of the tokens the grammar allows next (RowSampling.masked applies it on the device).

xgrammar is optional (`pip install xgrammar`, in the dev extra); without it a request asking for
structured output is a 400 that says so. The JSON grammars are compact (no free whitespace), so a
model cannot spend its tokens on spaces.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from llamactl.serve.errors import ApiError

MAX_SCHEMA_BYTES = 64 << 10  # a JSON schema's size in a request


def spec(body: dict) -> tuple[str, str, str] | None:
    """A request's structured-output ask -> (kind, source, field): ("json", schema text or "" for
    any JSON object (json_object), ...), ("regex", pattern, ...) or None; ApiError (400) naming the
    field where it is malformed."""
    fmt, asks = body.get("response_format"), []
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise ApiError(400, "response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                           "response_format")
        if fmt["type"] == "json_object":
            asks.append(("json", "", "response_format"))
        elif fmt["type"] == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                               "response_format")
            asks.append(("json", _schema_text(js["schema"], "response_format"), "response_format"))
    if body.get("guided_json") is not None:
        schema = body["guided_json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ApiError(400, "guided_json must be a JSON schema (an object or its text)", "guided_json") from None
        if not isinstance(schema, dict):
            raise ApiError(400, "guided_json must be a JSON schema (an object or its text)", "guided_json")
        asks.append(("json", _schema_text(schema, "guided_json"), "guided_json"))
    if body.get("guided_regex") is not None:
        if not isinstance(body["guided_regex"], str) or not body["guided_regex"]:
            raise ApiError(400, "guided_regex must be a regular expression", "guided_regex")
        asks.append(("regex", body["guided_regex"], "guided_regex"))
    choices = body.get("guided_choice")
    if choices is not None:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ApiError(400, "guided_choice must be a list of non-empty strings", "guided_choice")
        asks.append(("regex", "(" + "|".join(re.escape(c) for c in choices) + ")", "guided_choice"))
    if len(asks) > 1:
        raise ApiError(400, "give one of response_format, guided_json, guided_regex and guided_choice",
                       "response_format")
    return asks[0] if asks else None


def _schema_text(schema: dict, field: str) -> str:
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"the JSON schema has {len(text)} bytes; the most is {MAX_SCHEMA_BYTES}", field)
    return text


class Grammars:
    """Compiles requests' grammars for one tokenizer (xgrammar's compiler caches them)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler = None

    def compile(self, ask: tuple[str, str, str]) -> Any:
        """(kind, source, field) (spec's) -> a compiled grammar (for Matcher); ApiError naming the
        field when xgrammar is missing or the grammar does not compile."""
        kind, source, field = ask
        try:
            import xgrammar as xgr
        except ImportError:
            raise ApiError(400, "structured output needs xgrammar, which this server does not have: install it "
                           "(pip install xgrammar) and restart", field) from None
        if self._compiler is None:  # a model without EOS ids (random weights): the tokenizer's (xgrammar refuses [])
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids or None)
            self._compiler = xgr.GrammarCompiler(info)
        try:
            if kind == "regex":
                return self._compiler.compile_regex(source)
            return self._compiler.compile_json_schema(source or '{"type": "object"}', any_whitespace=False)
        except Exception as e:  # xgrammar's errors for schemas or patterns it cannot compile
            raise ApiError(400, f"the grammar does not compile ({type(e).__name__}: {str(e)[:160]})", field) from None


class Matcher:
    """One running request's place in its grammar: the tokens it allows next, as a bitmask row."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self._xgr, self.vocab_size = xgr, vocab_size
        self._m = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Follow a drawn token; False where the grammar refuses it (it cannot: the mask allowed it)."""
        return bool(self._m.accept_token(token))

    @staticmethod
    def accept_many(matchers: list["Matcher"], tokens: list[int]) -> None:
        """Each matcher (distinct) follows its token, in one call where there are several."""
        if len(matchers) == 1:
            matchers[0].accept(tokens[0])
        elif matchers:
            _batch().batch_accept_token([m._m for m in matchers], tokens)

    @property
    def done(self) -> bool:
        """The grammar has ended (what follows can only be a stop token)."""
        return bool(self._m.is_terminated())

    @staticmethod
    def masks(matchers: list["Matcher"]):
        """The tokens each allows next: int32 bitmask rows [n, ceil(V / 32)] (bit t of word t // 32),
        filled in one call (xgrammar's batch fill, on threads: 5x one call a row for 32 JSON rows
        of a 128K vocabulary on a 2-core machine)."""
        first = matchers[0]
        rows = first._xgr.allocate_token_bitmask(len(matchers), first.vocab_size)
        if len(matchers) == 1:
            first._m.fill_next_token_bitmask(rows, 0)
        else:
            _batch().batch_fill_next_token_bitmask([m._m for m in matchers], rows)
        return rows


@functools.lru_cache(maxsize=None)
def _batch():
    """One xgrammar BatchGrammarMatcher for the process (its thread pool)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher()
