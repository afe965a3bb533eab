"""What a grammar's matcher calls cost the engine's thread while another thread runs Python (the
HTTP server's, streaming tokens): xgrammar's calls let go of the GIL, and each one then waits for
it until the other thread yields (up to sys.getswitchinterval()). Times 32 JSON rows' steps
(accept one by one, accept in one batch call, is_terminated, the batch bitmask fill) alone and
beside a busy thread, for each switch interval given. Tokens are drawn from each row's mask, so
every matcher moves as in a server. Usage: python scripts/grammar_gil_probe.py OUT.json
[--intervals 0.005,0.001] [--rows 32]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time

import torch

from llamactl.runtime.load import load
from llamactl.serve.grammar import Grammars, Matcher

SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}
VOCAB = 128256  # llama3's: the bitmask's width


def steps(rows: int, n: int, seed: int) -> list[list[int]]:
    """n steps of tokens for `rows` fresh matchers, each drawn at random from its row's mask."""
    ms, gen, ids, out = _matchers(rows), torch.Generator().manual_seed(seed), torch.arange(VOCAB), []
    for _ in range(n):
        bits = ((Matcher.masks(ms)[:, ids >> 5] >> (ids & 31)) & 1).bool()
        toks = torch.rand(rows, VOCAB, generator=gen).masked_fill(~bits, -1).argmax(-1).tolist()
        for m, t in zip(ms, toks):
            m.accept(t)
        out.append(toks)
    return out


def _matchers(rows: int) -> list[Matcher]:
    return [Matcher(_compiled(), VOCAB) for _ in range(rows)]


@functools.lru_cache(maxsize=None)
def _compiled():
    """SCHEMA compiled once for the embedded model's tokenizer."""
    _, _, tok, _ = load(None, "cpu", "float32")
    return Grammars(tok, VOCAB, {2}).compile(("json", json.dumps(SCHEMA), "probe"))


def _spin(stop: threading.Event) -> None:
    """Python without pause (the HTTP thread at its busiest) until stop is set."""
    while not stop.is_set():
        pass


def timed(kind: str, toks: list[list[int]]) -> float:
    """us a step for `kind` over the recorded steps (fresh matchers following them)."""
    ms, total = _matchers(len(toks[0])), 0.0
    for step in toks:
        t0 = time.perf_counter()
        if kind == "accept one by one":
            for m, t in zip(ms, step):
                m.accept(t)
        elif kind == "accept in one call":
            Matcher.accept_many(ms, step)
        elif kind == "is_terminated":
            [m.done for m in ms]
        else:  # "fill" (then the step's tokens, untimed)
            Matcher.masks(ms)
        total += time.perf_counter() - t0
        if kind in ("is_terminated", "fill"):
            Matcher.accept_many(ms, step)
    return total / len(toks) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--intervals", default="0.005,0.001")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    toks = steps(a.rows, a.steps, 0)
    kinds = ("accept one by one", "accept in one call", "is_terminated", "fill")
    result = {"rows": a.rows, "steps": a.steps, "alone": {k: timed(k, toks) for k in kinds}, "busy": {}}
    for interval in (float(x) for x in a.intervals.split(",")):
        sys.setswitchinterval(interval)
        stop = threading.Event()
        t = threading.Thread(target=_spin, args=(stop,), daemon=True)
        t.start()
        result["busy"][str(interval)] = {k: timed(k, toks) for k in kinds}
        stop.set()
        t.join()
    for where, row in [("alone", result["alone"])] + [(f"busy, interval {i}", r) for i, r in result["busy"].items()]:
        print(f"{where:24}" + "  ".join(f"{k} {v:9.1f} us" for k, v in row.items()))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
