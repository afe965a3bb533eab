"""Speculative decoding: a drafter proposes the next K tokens, the model checks them all in one
forward of K + 1 positions, and every proposal it would have produced itself is kept.

One forward reads the weights once whatever K is, so at batch 1 (bound by those reads) each
accepted proposal is a token for almost nothing. Greedy decoding keeps a proposal that equals the
model's argmax there, then adds the model's own token at the first mismatch (or after the last
proposal): the output is plain greedy decoding's. Sampling draws the model's token at every place
of the verify step as plain sampling draws it there and keeps a proposal that equals its draw:
proposal d is kept with probability p(d), and a draw that differs is distributed as p with d taken
out (Leviathan et al., 2023, with a one-point draft distribution), so the output is distributed as
plain sampling's. One rule (`keep`) for generate and serve.

Drafters: `NgramDraft` (prompt lookup: the tokens that followed the latest earlier occurrence of
the text's last few tokens; free, and strong where the answer copies from the prompt: summaries,
edits of code) and a draft model (a smaller model with the same tokenizer, or a low-bit copy of the
target from `llamactl quantize`, decoding its proposals greedily: one-point proposals again):
`ModelDraft` over a static cache of its own (generate's loop), `PagedDraft` in the serving engine's
paged pool (serve.engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llamactl.runtime.kv_cache import PagedCache
from llamactl.runtime.step import Decoder


class NgramDraft:
    """Prompt lookup over a growing token list: for n = max_n..1, the tokens that followed the
    latest earlier occurrence of the last n tokens."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # an n-gram -> where the token after its latest occurrence is

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            i = len(self.tokens)  # t's index: the n-grams ending at i - 1 now have a follower
            for n in range(1, self.max_n + 1):
                if i - n >= 0:
                    self._after[tuple(self.tokens[i - n : i])] = i
            self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """k tokens that may come next ([] when no suffix was seen before). A continuation that runs
        into the end goes on with itself: a text repeating a short period proposes its next period."""
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(self.tokens)), 0, -1):
            at = self._after.get(tuple(self.tokens[-n:]))
            if at is not None:
                out: list[int] = []
                for i in range(at, at + k):
                    out.append(self.tokens[i] if i < len(self.tokens) else out[i - len(self.tokens)])
                return out
        return []


class ModelDraft:
    """Proposals from a draft model's greedy decoding, over a cache of its own (runtime.step.Decoder,
    one row): each propose() first feeds it the tokens its cache lacks (after a rejection, from
    the first proposal that was not kept), then steps k times."""

    def __init__(self, model, max_seq: int, mode: str = "eager"):
        self.dec = Decoder(model, 1, max_seq, mode)
        self.tokens: list[int] = []
        self.written: list[int] = []  # the tokens whose K/V the draft's cache holds, by position

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        n, have = len(self.tokens), 0
        while have < min(len(self.written), n - 1) and self.written[have] == self.tokens[have]:
            have += 1
        device = self.dec.device
        if have < n - 1:  # the tokens before the last that the cache lacks, in one forward
            self.dec.prefill(torch.tensor([self.tokens[have : n - 1]], device=device), start=have)
        tok, out = torch.tensor([self.tokens[-1]], device=device), []
        for j in range(k):
            tok = self.dec.step(tok, n - 1 + j)  # [1]
            out.append(tok)
        proposals = torch.cat(out).tolist()
        self.written = self.tokens[:n] + proposals[:-1]
        return proposals


class PagedDraft:
    """A draft model's proposals for a paged server's rows (serve.engine): its K/V in a pool of its
    own that mirrors the target's block for block, under the same block table, so the scheduler's
    blocks, preemption and prefix reuse serve both models. Each row first feeds the tokens its
    draft K/V lack (from `start`, where they stop being valid) in one packed forward, whose last
    token's next is its first proposal; then decode steps of the first b rows (CUDA graphs per
    batch bucket, as the target's steps) give the rest, greedily."""

    def __init__(self, model, target: PagedCache, rows: int, mode: str = "eager", options=None):
        self.cache = PagedCache.for_model(model, rows, target.blocks, target.block_size, target.max_seq)
        self.cache.table = target.table  # one table: the target's moves and set_rows are the draft's
        self.dec = Decoder(model, rows, target.max_seq, mode, options=options, cache=self.cache)
        self.device = model.device

    @property
    def block_bytes(self) -> int:
        return self.cache.nbytes // self.cache.blocks

    @torch.inference_mode()
    def propose(self, slots: list[int], chunks: list[list[int]], starts: list[int], ks: list[int],
                b: int, idle: list[tuple[int, int, int]]) -> list[list[int]]:
        """Rows slots[i] (below b) feed chunks[i] (their tokens from starts[i] to the last one,
        whose K/V the target has not computed yet) and propose ks[i] >= 1 tokens -> the proposals,
        per row. The decode steps run rows 0..b-1: idle lists (slot, last token, its position) of
        the other running rows, and a row whose proposals are done feeds its last token again;
        both rewrite K/V the draft already holds there (free rows write the null block)."""
        first = self.dec.prefill_packed(chunks, slots, starts)  # [n]: each row's first proposal
        k = max(ks)
        if k == 1:
            return [[t] for t in first.tolist()]
        tok, pos = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
        for slot, t, p in idle:
            tok[slot], pos[slot] = t, p
        at = torch.tensor(slots, device=self.device)
        last_tok = torch.tensor([c[-1] for c in chunks], device=self.device)  # [n]
        last_pos = torch.tensor([s + len(c) - 1 for s, c in zip(starts, chunks)], device=self.device)  # [n]
        more = torch.tensor(ks, device=self.device)  # [n]
        tok, pos = tok.to(self.device), pos.to(self.device)
        drawn, out = first, [first]
        for j in range(1, k):
            going = j < more  # [n]: rows still proposing
            tok[at] = torch.where(going, drawn, last_tok)
            pos[at] = torch.where(going, last_pos + j, last_pos)
            drawn = self.dec.step(tok, pos)[at]  # [n]
            out.append(drawn)
        table = torch.stack(out, 1).tolist()  # [n, k]
        return [row[:n] for row, n in zip(table, ks)]


@dataclass
class Tally:
    """What speculation did over a run."""

    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else None,
                "tokens_per_step": round((self.accepted + self.verify_steps) / self.verify_steps, 3)
                if self.verify_steps else None}


def keep(draft: list[int], drawn: list[int]) -> list[int]:
    """The tokens a verify step hands out: the proposals up to the first that differs from the
    model's draw at its place, then the model's draw there (drawn: len(draft) + 1 tokens)."""
    kept = 0
    while kept < len(draft) and draft[kept] == drawn[kept]:
        kept += 1
    return draft[:kept] + [drawn[kept]]
