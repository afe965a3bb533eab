"""What passes between the serving scheduler (serve.scheduler), the engine (serve.engine) and the
runner (serve.runner), as vLLM's SchedulerOutput: a request (what it asks for, its token ids, how
far it is computed, its KV blocks and batch row; the events it hands back) and a step's plan (the
joined and cancelled requests, row moves and tables, prefill chunks, a decode or verify step).
Plain data: no torch here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from llamactl.runtime.settings import Sampling

_ids = itertools.count(1)


@dataclass(frozen=True)
class Params:
    """What one request asks for: at most max_tokens, drawn as `sampling` says, ending at EOS
    unless ignore_eos, and at any of stop_ids (not emitted either); speculate: it may propose
    tokens (where the server speculates); logprobs: each token comes with its log-probability and
    this many likeliest alternatives (None: no log-probabilities); grammar: what its tokens
    follow (a compiled grammar of serve.grammar; None: anything); prompt_logprobs: its prompt's
    tokens' log-probabilities with this many alternatives too (echo; its prefill computes every
    position, no prefix hits)."""

    max_tokens: int
    sampling: Sampling = Sampling()
    ignore_eos: bool = False
    speculate: bool = True
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    grammar: object | None = None
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class Event:
    """kind "token" (a generated token id), "prompt" (before the first token of a request that asks
    for its prompt's log-probabilities) or "done" (reason: "stop" at EOS, "length",
    "cancelled" or "error" with `error`); time: time.perf_counter() when it was emitted;
    logprob: the token's log-probability and its request's likeliest alternatives ((id,
    log-probability), likeliest first), where the request asks for them (Params.logprobs)."""

    kind: str
    token: int = -1
    reason: str = ""
    time: float = 0.0
    error: str = ""
    logprob: tuple[float, tuple[tuple[int, float], ...]] | None = None
    prompt: tuple | None = None  # kind "prompt": the prompt's tokens' (log-probability, alternatives), from the second


class Request:
    """One sequence: its token ids (prompt + output), its cache row, how far it is computed. Its
    fields change on the engine's thread only (cancel: any thread)."""

    def __init__(self, prompt: list[int], params: Params, on_event: Callable[[Event], None], arrived: float):
        self.id = next(_ids)
        self.tokens = list(prompt)  # prompt, then each token handed out
        self.prompt_len = len(prompt)
        self.params, self.on_event, self.arrived = params, on_event, arrived
        self.slot: int | None = None  # its batch row while it runs
        self.blocks: list[int] = []  # its KV blocks, position p in blocks[p // block_size]
        self.names: list[bytes] = []  # the prefix names of its full blocks of tokens[:target]
        self.named = 0  # its blocks named in the pool so far
        self.target = self.prompt_len  # tokens to prefill before decoding (after a preemption: all so far)
        self.prefilled = 0  # of those, tokens whose K/V are computed (or queued; a cached prefix's too)
        self.launched = 0  # output tokens computed or in flight (the prefill's first one included)
        self.cached = 0  # prompt tokens found in the prefix cache
        self.prompt_scores: list = []  # prompt token i + 1's (log-probability, alternatives), where asked for
        self.spec_k = 0  # speculation: proposals its next verify step may carry (0: the server's most)
        self.spec_after = 0  # ... none before this many launched tokens (it found nothing to propose)
        self.drafted = 0  # ... its leading tokens whose K/V a draft model holds (runtime.speculate.PagedDraft)
        self.cancelled = False
        self.finished = False

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def generated(self) -> int:
        """Output tokens handed out."""
        return len(self.tokens) - self.prompt_len

    @property
    def decoding(self) -> bool:
        return self.prefilled == self.target

    @property
    def pos(self) -> int:
        """The position of the token fed to its next decode step (its next prompt chunk's while prefilling)."""
        return self.prompt_len + self.launched - 1 if self.decoding else self.prefilled

    @property
    def computed(self) -> int:
        """Its tokens whose K/V are in the cache or on their way (prompt and output)."""
        return self.pos

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step boundary (any thread)."""
        self.cancelled = True


@dataclass
class Prefill:
    """One prefill forward: chunk ids[i] of requests[i]'s tokens at positions starts[i].. of its
    row, the chunks packed end to end (runtime.ragged); ends[i]: the chunk ends its request's
    prompt, and the token after it is read and handed out."""

    requests: list[Request]
    ids: list[list[int]]
    starts: list[int]
    ends: list[bool]

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.ids)

    @property
    def whole(self) -> bool:
        """Every chunk a whole prompt from position 0 (what the prefill graphs take)."""
        return all(self.ends) and not any(self.starts)


@dataclass
class Decode:
    """One decode step of batch rows 0..rows-1 (a bucket: one CUDA graph each), each at
    positions[i]; `requests` receive its tokens (request i: row at[i]); a free row (its table all
    the null block) or one still prefilling steps too, at a position whose K/V nothing reads
    before it is written again. tables: rows whose blocks changed since the plan, set first."""

    requests: list[Request]
    rows: int
    positions: list[int]
    kv_len: int  # every position is below it (an eager step's attention reads that much)
    greedy: bool  # no row samples
    at: list[int] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class StepPlan:
    """What the runner does before this step's prefills: moves (row src -> row dst: its table,
    sampling settings and last token), then tables (a row's blocks, [] for none), then the joined
    requests' sampling settings."""

    joined: list[Request] = field(default_factory=list)  # admitted now: their rows' sampling settings
    cancelled: list[Request] = field(default_factory=list)  # dropped from their rows now
    prefills: list[Prefill] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    # where the scheduler mixes: this step's decode step, planned before its prefills (the rows
    # decoding already), to go through the prefill forward where there is one
    decode: Decode | None = None
    speculate: bool = False  # no prefill, few rows: the engine plans a verify step (Scheduler.verify)


@dataclass
class Verify:
    """One speculative step: chunks[i] (requests[i]'s last token, then its proposals) at positions
    starts[i].. of its row, every position's token drawn; tables: rows whose blocks changed."""

    requests: list[Request]
    chunks: list[list[int]]
    starts: list[int]
    tables: dict[int, list[int]] = field(default_factory=dict)
