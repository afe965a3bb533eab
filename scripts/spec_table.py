"""Speculative decoding's batch-1 speed-up table (issue 50), from measured step costs: a plain
decode step (the Decoder's over a paged cache, in its mode), a verify step of K+1 positions (Decoder.verify_rows: a CUDA graph in graphs mode) for each
K, and a draft's own step (a model `--draft` names: a smaller model, or self-int4 / self-int8, the
target's round-to-nearest copy; none: prompt lookup, free). With a per-proposal acceptance a, a
verify step keeps (1 - a^(K+1)) / (1 - a) tokens on average, and costs verify(K) + K draft steps,
so the speed-up over plain decoding is that over (verify(K) + K * draft) / step.

Usage: python scripts/spec_table.py OUT.json [--model PATH | --synthetic llama3-8b] [--draft self-int4|PATH]
       [--k 1,2,4,6,8] [--acceptance 0.6,0.7,0.8,0.9] [--ctx 512] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llamactl.bench.targets import load_targets
from llamactl.runtime.kv_cache import PagedCache
from llamactl.runtime.step import Decoder, sync

REPS = 30


def timed(fn, device) -> float:
    """Seconds a call of fn, after two warm calls."""
    for _ in range(2):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / REPS


def step_costs(model, ctx: int, ks: list[int], mode: str) -> dict:
    """(one decode step, {K: a verify step of K+1 positions}) at position ctx, seconds: the serving
    engine's (one row of a paged cache; a packed verify forward, as serve.runner runs it)."""
    size = 16
    blocks = -(-(ctx + max(ks) + 2) // size) + 1
    cache = PagedCache.for_model(model, 1, blocks, size, (blocks - 1) * size)
    cache.set_rows([0], [list(range(1, blocks))])
    dec = Decoder(model, 1, cache.max_seq, mode, cache=cache)
    device = model.device
    dec.prefill_packed([torch.randint(0, model.args.vocab_size, (ctx,)).tolist()], [0], [0])
    tok = torch.zeros(1, dtype=torch.long, device=device)
    pos = torch.full((1,), ctx, dtype=torch.long, device=device)
    step = timed(lambda: dec.step(tok, pos), device)
    print(f"step {step * 1e3:.3f} ms", file=sys.stderr, flush=True)  # (a first start compiles for minutes)
    lens = torch.ones(1, dtype=torch.long, device=device)
    verify = {}
    for k in ks:
        verify[k] = timed(lambda k=k: dec.verify_rows(torch.ones(1, k + 1, dtype=torch.long, device=device), pos,
                                                       lens * (k + 1)), device)
        print(f"verify K={k}: {verify[k] * 1e3:.3f} ms", file=sys.stderr, flush=True)
    return {"step_s": step, "verify_s": verify}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=None)
    ap.add_argument("--synthetic", default=None)
    ap.add_argument("--draft", default=None, help="a model folder or self-int4 / self-int8 (none: prompt lookup)")
    ap.add_argument("--k", default="1,2,4,6,8")
    ap.add_argument("--acceptance", default="0.6,0.7,0.8,0.9")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mode", default=None, help="the step's mode (default: graphs on CUDA, eager on the CPU)")
    a = ap.parse_args()
    device = torch.device(a.device)
    mode = a.mode or ("graphs" if device.type == "cuda" else "eager")
    ks = [int(k) for k in a.k.split(",")]
    target = load_targets([a.model] if a.model else [], a.synthetic, device, a.dtype)[0]
    costs = step_costs(target.model, a.ctx, ks, mode)
    draft_s = 0.0
    if a.draft:
        if a.draft.startswith("self-int"):
            quant = a.draft[len("self-"):]
            draft = load_targets([], a.synthetic, device, a.dtype, quant)[0] if a.synthetic else None
            if draft is None:
                raise SystemExit("self-int drafts here take --synthetic (a folder's copy: llamactl quantize, then --draft PATH)")
        else:
            draft = load_targets([a.draft], None, device, a.dtype)[0]
        draft_s = step_costs(draft.model, a.ctx, ks[:1], mode)["step_s"]
    rows = []
    for k in ks:
        cost = (costs["verify_s"][k] + k * draft_s) / costs["step_s"]
        for acc in (float(x) for x in a.acceptance.split(",")):
            kept = (1 - acc ** (k + 1)) / (1 - acc)
            rows.append({"k": k, "acceptance": acc, "tokens_per_verify": round(kept, 3),
                         "verify_over_step": round(costs["verify_s"][k] / costs["step_s"], 3),
                         "speedup": round(kept / cost, 3)})
    out = {"model": target.label, "draft": a.draft, "device": str(device), "mode": mode, "ctx": a.ctx,
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
           "step_ms": round(costs["step_s"] * 1e3, 3), "draft_step_ms": round(draft_s * 1e3, 3),
           "verify_ms": {k: round(v * 1e3, 3) for k, v in costs["verify_s"].items()}, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("model", "step_ms", "draft_step_ms", "verify_ms")}))
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
