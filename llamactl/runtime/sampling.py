"""Sampling settings per row of a batch, on the device and graph-safe (batched decoding, a server).

Each row has its own temperature (0: greedy), top-k (0: off), top-p (1: off) and seed. A row's
random numbers come from a counter-based hash of (seed, position of the token drawn, vocab id),
not from a generator's state: the same row draws the same token whether it decodes alone or in a
batch, in any slot, in a CUDA graph or not, and nothing advances between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llamactl.runtime.settings import Sampling
from llamactl.runtime.transfer import to_device

@torch.library.custom_op("llamactl::cumsum_last", mutates_args=())
def cumsum_last(x: torch.Tensor) -> torch.Tensor:
    """x.cumsum(-1), opaque to Inductor: with a dynamic row count (a server's compiled buckets) its
    split scan over the vocabulary failed to generate on CUDA (torch 2.11: first "list indices must
    be integers", then, without split reductions, "NYI TritonSplitDimKernel reductions"), which
    stopped llama2-7b's `serve --mode compile`; as a call, the step runs ATen's cumsum."""
    return x.cumsum(-1)


@cumsum_last.register_fake
def _(x):
    return torch.empty_like(x)


TOP_LOGPROBS = 20  # alternatives a step records per row where log-probabilities are asked for (OpenAI's most)
MAX_BIAS = 300  # logit_bias entries a row may have (OpenAI's most)
MAX_BANNED = 72  # stop tokens a row's min_tokens holds back (a model's EOS ids and a request's stop_token_ids)
_P = 2**31 - 1  # the hash works modulo this prime, on int64 without overflow (products < 2^62)
_A, _B, _C, _D = 1_103_515_245, 2_147_482_951, 48_271, 69_621


def _mix(h: torch.Tensor) -> torch.Tensor:
    """Two rounds of multiply (mod P) and xor-shift: nonlinear in the input bits."""
    h = (h * _A) % _P
    h = h ^ (h >> 15)
    h = (h * _D) % _P
    return h ^ (h >> 13)


def vocab_hash(vocab: int, device) -> torch.Tensor:
    """[V] int64: each vocab id's share of the hash (the same for every row and step)."""
    return _mix(torch.arange(vocab, device=device) + 7) * _A % _P


def uniforms(seed: torch.Tensor, pos: torch.Tensor, vocab: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """seed: [B] int64, pos: [B] int64 -> [B, V] uniforms in (0, 1), one draw per vocab id.
    ids: vocab_hash(vocab), made once (a compiled step then reads it instead of deriving it
    from an arange, which Inductor 2.11 indexed in int32 and overflowed)."""
    ids = vocab_hash(vocab, seed.device) if ids is None else ids  # [V]
    h = (_mix(seed % _P) * _B % _P + _mix(pos % _P + 1) * _C % _P) % _P  # [B]
    h = _mix((h[:, None] + ids[None, :]) % _P)  # [B, V]
    return (_mix(h).double() + 0.5).div(_P).float()


@dataclass
class RowSampling:
    """Per-row settings as device tensors [B] (temperature, top_k, top_p, seed)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    greedy: bool = False  # the host's word that every row's temperature is 0 (steps skip the draw)
    ids: torch.Tensor | None = None  # vocab_hash of the model's vocabulary (prepare())
    # the host's word that some row asks for log-probabilities: steps record, for each row they
    # draw for, the log-probability of its token and its TOP_LOGPROBS likeliest, of the
    # distribution it draws from (the logits over its temperature; a greedy row's own), into
    # lp_token [R], lp_ids [R, K], lp_vals [R, K] at the row (a graph of their own)
    logprobs: bool = False
    lp_token: torch.Tensor | None = None
    lp_ids: torch.Tensor | None = None
    lp_vals: torch.Tensor | None = None
    # the host's word that some row has penalties or a logit bias (Sampling.adjusts_logits): steps
    # adjust every row's logits before the draw and count the tokens drawn (a graph of their own);
    # the buffers (penalties [R], bias [R, MAX_BIAS], counts [R, V]) are made by `adjust_rows`
    adjusted: bool = False
    penalty: torch.Tensor | None = None  # [R, 3]: presence, frequency, repetition
    bias_ids: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    counts: torch.Tensor | None = None  # [R, V] int32: each row's generated tokens
    seen: torch.Tensor | None = None  # [R, V] bool: its prompt's and generated tokens (repetition)
    generated: torch.Tensor | None = None  # [R] int32: how many tokens each row has generated
    min_tokens: torch.Tensor | None = None  # [R] int32: its stop tokens held back until it has this many
    banned: torch.Tensor | None = None  # [R, MAX_BANNED] long: those stop tokens (padded with the first)
    ban_valid: torch.Tensor | None = None  # [R, MAX_BANNED] bool: whether the row has any
    # the host's word that some row follows a grammar (serve.grammar): steps keep each row's draw
    # to the tokens its bitmask allows (a graph of their own); mask [R, ceil(V / 32)] int32, all
    # ones for a row that follows none, made by set_masks
    masked: bool = False
    mask: torch.Tensor | None = None
    _word: torch.Tensor | None = None  # [V]: the word of each token's bit
    _bit: torch.Tensor | None = None  # [V]: its place in the word

    def prepare(self, vocab: int) -> None:
        """Make the vocabulary's share of the hash and the log-probability buffers now, outside
        any compiled step."""
        if self.ids is None or self.ids.numel() != vocab:
            self.ids = vocab_hash(vocab, self.seed.device)
            rows, k, dev = self.seed.numel(), min(TOP_LOGPROBS, vocab), self.seed.device
            self.lp_token = torch.zeros(rows, device=dev)
            self.lp_ids = torch.zeros(rows, k, dtype=torch.long, device=dev)
            self.lp_vals = torch.zeros(rows, k, device=dev)

    @classmethod
    def make(cls, rows: list[Sampling], device) -> "RowSampling":
        """Each row's settings (runtime.settings.Sampling; a seed of None draws with seed 0)."""
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(col([r.temperature for r in rows], torch.float32), col([r.top_k for r in rows], torch.long),
                   col([r.top_p for r in rows], torch.float32), col([r.seed or 0 for r in rows], torch.long))

    def adjust_rows(self, rows: list[int], settings: list[Sampling], seen: list[list[int]],
                    generated: list[list[int]], stops: list[list[int]]) -> None:
        """Rows' penalties, logit bias and min_tokens (buffers made at the first call), their
        prompt's and generated tokens seen and the generated ones counted (a row joining, or
        rejoining after a preemption); stops: the tokens each row's min_tokens holds back."""
        if self.penalty is None:
            r, v, dev = self.seed.numel(), self.ids.numel(), self.seed.device
            self.penalty = torch.tensor([[0.0, 0.0, 1.0]] * r, device=dev)
            self.bias_ids = torch.zeros(r, MAX_BIAS, dtype=torch.long, device=dev)
            self.bias_vals = torch.zeros(r, MAX_BIAS, device=dev)
            self.counts = torch.zeros(r, v, dtype=torch.int32, device=dev)
            self.seen = torch.zeros(r, v, dtype=torch.bool, device=dev)
            self.generated = torch.zeros(r, dtype=torch.int32, device=dev)
            self.min_tokens = torch.zeros(r, dtype=torch.int32, device=dev)
            self.banned = torch.zeros(r, MAX_BANNED, dtype=torch.long, device=dev)
            self.ban_valid = torch.zeros(r, MAX_BANNED, dtype=torch.bool, device=dev)
        for row, st, ids, gen, stop in zip(rows, settings, seen, generated, stops):
            stop = list(stop)[:MAX_BANNED]
            self.banned[row] = torch.tensor((stop + [stop[0] if stop else 0] * MAX_BANNED)[:MAX_BANNED])
            self.ban_valid[row] = bool(stop)  # the padding repeats the first id: the same value for each copy
            self.min_tokens[row], self.generated[row] = st.min_tokens, len(gen)
            self.penalty[row] = torch.tensor([st.presence_penalty, st.frequency_penalty, st.repetition_penalty])
            bias = list(st.logit_bias) + [(0, 0.0)] * (MAX_BIAS - len(st.logit_bias))
            self.bias_ids[row] = torch.tensor([i for i, _ in bias])
            self.bias_vals[row] = torch.tensor([b for _, b in bias])
            self.counts[row] = 0
            self.seen[row] = False
            if ids:
                self.seen[row, torch.tensor(ids, device=self.seen.device)] = True
            if gen:
                self.counts[row].index_add_(0, torch.tensor(gen, device=self.seen.device),
                                            torch.ones(len(gen), dtype=torch.int32, device=self.seen.device))

    def set_masks(self, rows: list[int], masks: torch.Tensor | None) -> None:
        """Rows' bitmasks of allowed tokens ([n, ceil(V / 32)] int32, host or device; None: all
        allowed). The buffers are made at the first call."""
        if self.mask is None:
            v, dev = self.ids.numel(), self.seed.device
            self.mask = torch.full((self.seed.numel(), -(-v // 32)), -1, dtype=torch.int32, device=dev)
            self._word = torch.arange(v, device=dev) // 32
            self._bit = (torch.arange(v, device=dev) % 32).to(torch.int32)
        at = to_device(rows, self.mask.device, torch.long)
        self.mask[at] = -1 if masks is None else to_device(masks, self.mask.device, torch.int32)

    def _allowed(self, logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        # logits [B, V] of rows (None: the first B) -> -inf where a row's bitmask disallows a token
        words = self.mask[slice(0, logits.shape[0]) if rows is None else rows]  # [B, W]
        bits = (words[:, self._word] >> self._bit) & 1  # [B, V]
        return logits.masked_fill(bits == 0, float("-inf"))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows src's settings to rows dst (a server's rows kept packed)."""
        for t in (self.temperature, self.top_k, self.top_p, self.seed, self.penalty, self.bias_ids, self.bias_vals,
                  self.counts, self.seen, self.generated, self.min_tokens, self.banned, self.ban_valid, self.mask):
            if t is not None:
                t[dst] = t[src]

    def _adjusted(self, logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        # logits [B, V] of rows (None: the first B) -> with each row's bias and penalties, float32
        at = slice(0, logits.shape[0]) if rows is None else rows
        x = logits.float().scatter_add(-1, self.bias_ids[at], self.bias_vals[at])
        pen, counts = self.penalty[at], self.counts[at].float()  # [B, 3], [B, V]
        x = x - pen[:, :1] * (counts > 0) - pen[:, 1:2] * counts
        rep = pen[:, 2:3]
        x = torch.where(self.seen[at], torch.where(x > 0, x / rep, x * rep), x)
        ban = self.banned[at]  # [B, MAX_BANNED]: a row's stop tokens while it has fewer than min_tokens
        held = self.ban_valid[at] & (self.generated[at] < self.min_tokens[at])[:, None]
        return x.scatter(-1, ban, torch.where(held, float("-inf"), x.gather(-1, ban)))

    def count(self, tok: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Tokens [B] a step feeds its rows (None: the first B), each the row's last generated one,
        counted and seen: every generated token is fed once, so the counts are the generated text's
        (a prompt's own chunks, and draws a chunk not ending its prompt makes, are not). Where
        `adjusted`; graph-safe."""
        if not self.adjusted:
            return
        at = torch.arange(tok.numel(), device=tok.device) if rows is None else rows
        self.counts.index_put_((at, tok), torch.ones_like(tok, dtype=torch.int32), accumulate=True)
        self.seen[at, tok] = True
        self.generated[at] += 1

    def counting(self) -> tuple[torch.Tensor, ...] | None:
        """Copies of what count() adds to (None where it adds nothing), for recount() to put back:
        a CUDA graph's capture runs its step three times first, and must not count three tokens."""
        on = self.adjusted and self.counts is not None
        return tuple(t.clone() for t in (self.counts, self.seen, self.generated)) if on else None

    def recount(self, saved: tuple[torch.Tensor, ...]) -> None:
        for t, v in zip((self.counts, self.seen, self.generated), saved):
            t.copy_(v)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] of the first B rows, every one greedy -> their tokens [B] (recorded
        where log-probabilities are asked for; adjusted where `adjusted`)."""
        logits = self._shaped(logits, None)
        tok = logits.argmax(-1)
        if self.logprobs:
            self._record(logits, self.temperature[: logits.shape[0]], tok, None)
        return tok

    def _shaped(self, logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        # logits [B, V] of rows (None: the first B) -> as each row draws from them: its bias,
        # penalties and min_tokens where `adjusted`, its grammar's mask where `masked`
        if self.adjusted:
            logits = self._adjusted(logits, rows)
        if self.masked:
            logits = self._allowed(logits, rows)
        return logits

    def _record(self, logits: torch.Tensor, t: torch.Tensor, tok: torch.Tensor, rows: torch.Tensor | None) -> None:
        # logits [B, V], t [B], tok [B] -> the log-probability buffers at rows (None: the first B)
        x = logits.float() / torch.where(t > 0, t, torch.ones_like(t))[:, None]
        lsm = torch.log_softmax(x, -1)  # [B, V]
        vals, ids = lsm.topk(self.lp_ids.shape[1], dim=-1)  # [B, K]
        chosen = lsm.gather(-1, tok.view(-1, 1))[:, 0]  # [B]
        if rows is None:
            n = logits.shape[0]
            self.lp_token[:n], self.lp_ids[:n], self.lp_vals[:n] = chosen, ids, vals
        else:
            self.lp_token[rows], self.lp_ids[rows], self.lp_vals[rows] = chosen, ids, vals

    def read_logprobs(self, rows: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """What the last step recorded for rows (host; syncs): (its token's log-probability, its
        k likeliest as (id, log-probability), likeliest first) each."""
        at = torch.tensor(rows, dtype=torch.long, device=self.lp_token.device)
        return snapshot_rows((self.lp_token[at], self.lp_ids[at], self.lp_vals[at]), k)

    def sample(self, logits: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [B, V] for rows `rows` ([B] indexes of the settings; None: the first B), the
        token each row draws at positions pos: [B] (where the drawn token will sit) -> [B]."""
        if rows is not None:
            t, k, p, seed = self.temperature[rows], self.top_k[rows], self.top_p[rows], self.seed[rows]
        else:  # the first rows (a batch bucket may be fewer than the settings)
            n = logits.shape[0]
            t, k, p, seed = self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seed[:n]
        logits = self._shaped(logits, rows)
        v = logits.shape[-1]
        x = logits.float() / t.clamp(min=1e-6)[:, None]  # [B, V]
        ordered, order = torch.sort(x, dim=-1, descending=True)  # [B, V]
        kk = torch.where(k > 0, k.clamp(max=v), torch.full_like(k, v))  # [B]
        kth = ordered.gather(-1, (kk - 1)[:, None])  # [B, 1]
        probs = ordered.softmax(-1)
        drop = (cumsum_last(probs) - probs) > p[:, None]  # keep the token that crosses top_p
        cut = ordered.masked_fill(drop, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
        x = x.masked_fill(torch.empty_like(x).scatter_(-1, order, cut) == float("-inf"), float("-inf"))
        u = uniforms(seed, pos, v, self.ids if self.ids is not None and self.ids.numel() == v else None)
        drawn = (x - torch.log(-torch.log(u))).argmax(-1)  # Gumbel-max: exactly softmax(x)
        tok = torch.where(t > 0, drawn, logits.argmax(-1))
        if self.logprobs:
            self._record(logits, t, tok, rows)
        return tok


def snapshot_rows(lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor], k: int) -> list[tuple[float, list]]:
    """(token log-probabilities [n], ids [n, K], values [n, K]) -> per row (its token's, its k
    likeliest as (id, value)), on the host."""
    tok, ids, vals = (t.tolist() for t in lp)
    return [(t, list(zip(i[:k], v[:k]))) for t, i, v in zip(tok, ids, vals)]
