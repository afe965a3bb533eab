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

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] of the first B rows, every one greedy -> their tokens [B] (recorded
        where log-probabilities are asked for)."""
        tok = logits.argmax(-1)
        if self.logprobs:
            self._record(logits, self.temperature[: logits.shape[0]], tok, None)
        return tok

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
