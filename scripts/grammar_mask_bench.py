"""Which grammar engine makes token masks fastest (issue 54): xgrammar against llguidance, each
following the same JSON documents token by token with a tokenizer (default: the embedded
model's), timing the next-token bitmask and the token's acceptance, and each compiling the
schema. outlines-core is left out: its vocabulary is built from a Hub download or a hand-made
token map. Prints and writes JSON. Usage: python scripts/grammar_mask_bench.py OUT.json [--model M]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["street", "city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
DOCS = [{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
         "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}},
        {"name": "Grace Hopper", "age": 85, "email": "grace@example.org", "tags": ["cobol", "navy"],
         "address": {"street": "1 Main St", "city": "Arlington", "zip": "22201"}}]


def xgrammar_run(tok, vocab: int, schema: str, docs: list[list[int]]) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema, any_whitespace=False)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for ids in docs:
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            ok = m.accept_token(t)
            times.append(time.perf_counter() - t0)
            if not ok:
                raise RuntimeError("xgrammar refused the document")
    return {"compile_ms": compile_s * 1e3, "us_per_token": statistics.median(times) * 1e6,
            "us_per_token_mean": statistics.fmean(times) * 1e6, "tokens": len(times)}


def llguidance_run(tok, vocab: int, schema: str, docs: list[list[int]]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    first = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for ids in docs:
        m = first.deep_copy()
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            ok = m.consume_token(t)
            times.append(time.perf_counter() - t0)
            if not ok:
                raise RuntimeError(f"llguidance refused the document: {m.get_error()}")
    return {"compile_ms": compile_s * 1e3, "us_per_token": statistics.median(times) * 1e6,
            "us_per_token_mean": statistics.fmean(times) * 1e6, "tokens": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from llamactl.runtime.load import load

    art, model, tok, _ = load(args.model, "cpu", "float32")
    vocab = model.args.vocab_size
    schema = json.dumps(SCHEMA)
    rows = {}
    for name, run in (("xgrammar", xgrammar_run), ("llguidance", llguidance_run)):
        for seps in ((", ", ": "), (",", ":")):  # each engine's compact JSON: the form it accepts
            docs = [tok(json.dumps(d, separators=seps), add_special_tokens=False).input_ids for d in DOCS]
            try:
                rows[name] = run(tok, vocab, schema, docs) | {"separators": list(seps)}
                break
            except RuntimeError as e:
                rows[name] = {"error": str(e)}
        print(f"{name:10} {rows[name]}", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"model": str(art.path), "vocab": vocab, "schema": SCHEMA, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
