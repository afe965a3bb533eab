"""bench --draft: speculative decoding against plain decoding, measured in the same run (issue 50).

Batch 1, greedy, EOS ignored, generate's loop (runtime.generate) on a prompt of real text (the
evaluation text's first --prompt-len tokens, so prompt lookup has a text to find its proposals
in): plain and speculative generations alternate, warm-up runs first, and each row reports the
medians of both, their ratio, the proposals kept and the tokens a verify step gave.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

from llamactl.bench.targets import load_targets
from llamactl.bench.trials import Target, Trial
from llamactl.folder.artifact import open_artifact, resolve_model_path
from llamactl.folder.checkpoint import load_tokenizer
from llamactl.quality import DEFAULT_EVAL
from llamactl.quantize.draft import SELF_COPIES, load_draft
from llamactl.runtime import generate as gen


def drafter(draft: str, target: Target, tokenizer, options, log: Callable[[str], None]):
    """What generate's `draft` takes for this target: "ngram", or a draft model (a folder; self-int4
    / self-int8: the folder's copy, or for random weights the same shape's quantized weights)."""
    if draft == "ngram":
        return draft
    if target.synthetic and draft in SELF_COPIES:
        m = target.model
        return load_targets([], target.synthetic, m.device, str(m.dtype).replace("torch.", ""), draft[len("self-"):],
                            options=options)[0].model
    return load_draft(draft, target.artifact.path if target.artifact else None, tokenizer, target.model, False, options,
                      log)


def measure(target: Target, draft: str, k: int, trial: Trial, options=None,
            log: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    """One row per prompt length: the target with `draft` (up to k proposals a verify step) and
    without, alternating."""
    tokenizer = load_tokenizer(target.artifact or open_artifact(resolve_model_path(None)))
    proposer = drafter(draft, target, tokenizer, options, log)
    text = DEFAULT_EVAL.read_text()
    rows = []
    for p in trial.prompt_lens:
        ids = tokenizer(text[: 16 * p + 1024]).input_ids[:p]  # (a token is a few characters: no need for all of it)
        plain, spec = [], []
        for run in range(trial.warmup + trial.repeat):
            a = list(gen.generate(target.model, tokenizer, ids, trial.gen_len, gen.Sampling(temperature=0), set(), True,
                                  options=options))[-1]
            b = list(gen.generate(target.model, tokenizer, ids, trial.gen_len, gen.Sampling(temperature=0), set(), True,
                                  options=options, draft=proposer, speculate=k))[-1]
            if run >= trial.warmup:
                plain.append(a)
                spec.append(b)
        s = spec[-1].extra["speculation"]
        decode = statistics.median(r.decode_tok_s for r in spec)
        base = statistics.median(r.decode_tok_s for r in plain)
        rows.append({"model": target.label, "stage": f"llamactl speculative ({draft}, up to {k})", "batch": 1,
                     "prompt_len": len(ids), "gen_len": trial.gen_len, "device": str(target.model.device),
                     "dtype": str(target.model.dtype).replace("torch.", ""),
                     "ttft_s": statistics.median(r.ttft_s for r in spec),
                     "prefill_tok_s": statistics.median(r.prefill_tok_s for r in spec), "decode_tok_s": decode,
                     "plain_decode_tok_s": base, "speedup_vs_plain": decode / base if base else None,
                     "same_tokens": all(x.token_ids == y.token_ids for x, y in zip(plain, spec)),
                     "speculation": {k_: s[k_] for k_ in ("draft", "k", "acceptance", "tokens_per_step", "verify_steps")},
                     "peak_mem_bytes": spec[-1].peak_mem_bytes})
    return rows

