"""Merge one load test's bench JSON into a part's summary (scripts/gpu_paged.sh), with the bound of
its workload on this GPU: its prompt tokens' FLOPs at the measured GEMM rate, plus its decode steps'
bytes (the weights each step, and the KV of every row's mean context) at the measured copy
bandwidth, at the level's concurrency. Usage: gpu_paged_summary.py RUNS_DIR SUMMARY.json NAME"""

import json
import sys
from pathlib import Path

runs, summary, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rates = json.loads((runs / "rates.json").read_text())
PARAMS, KV_TOKEN = 8.03e9, 2 * 32 * 8 * 128 * 2  # llama3-8b: parameters; K and V bytes of a token
try:
    row = json.loads((runs / f"{name}.json").read_text())["results"][0]
except (OSError, ValueError, KeyError, IndexError) as e:
    row = {"failed": f"{type(e).__name__}: {e}"}
if row.get("prompt_tokens_mean") and row.get("output_tokens_mean"):
    n, c = row["requests"] - row["errors"], row["concurrency"]
    prompt, out = row["prompt_tokens_mean"], row["output_tokens_mean"]
    prefill_s = n * prompt * 2 * PARAMS / rates["bf16_flop_s"]
    steps = n * out / c
    step_bytes = 2 * PARAMS + c * (prompt + out / 2) * KV_TOKEN
    bound_s = prefill_s + steps * step_bytes / rates["copy_bytes_s"]
    row["bound_output_tok_s"] = n * out / bound_s
    row["of_bound"] = row["output_tok_s"] / row["bound_output_tok_s"]
    eng = row.get("engine", {})
    if eng.get("decode_steps"):
        rows = (eng["decode_rows"] - eng.get("mixed_rows", 0)) / eng["decode_steps"]  # steps of their own
        ms = 1000 * eng["decode_seconds"] / eng["decode_steps"]
        ceiling_ms = 1000 * (2 * PARAMS + rows * (prompt + out / 2) * KV_TOKEN) / rates["copy_bytes_s"]
        row["decode_step"] = {"rows_mean": rows, "ms_mean": ms, "ceiling_ms": ceiling_ms, "of_ceiling": ceiling_ms / ms}
        # the engine thread's time a decode step: handing out tokens, grammars (wall, and its CPU),
        # its CPU in all, and its waits for the device's tokens (the rest of a step's wall time:
        # waiting for the GIL or a core)
        row["loop_ms_per_step"] = {k: 1000 * eng.get(f, 0.0) / eng["decode_steps"] for k, f in (
            ("emit", "emit_seconds"), ("grammar", "grammar_seconds"), ("grammar_cpu", "grammar_cpu_seconds"),
            ("engine_cpu", "thread_cpu_seconds"), ("read_wait", "read_wait_seconds"))}
        if eng.get("masked_steps"):  # a constrained step's host part, forward launch to draw launch
            row["loop_ms_per_step"]["masked_host"] = 1000 * eng["masked_host_seconds"] / eng["masked_steps"]
    if eng.get("prefill_seconds"):  # the server's prefill forwards: tokens a second, and of the GEMM rate
        rate = eng["prefill_tokens"] / eng["prefill_seconds"]
        row["prefill"] = {"tok_s": rate, "of_gemm_rate": rate * 2 * PARAMS / rates["bf16_flop_s"],
                          "seconds": eng["prefill_seconds"], "forwards": eng["prefill_forwards"],
                          "decode_rows_carried": eng.get("mixed_rows", 0)}
data = json.loads(summary.read_text()) if summary.exists() else {"rates": rates, "runs": {}}
data["runs"][name] = row
tmp = summary.with_suffix(".tmp")
tmp.write_text(json.dumps(data, indent=1))
tmp.replace(summary)
keys = ("error_examples", "output_tok_s", "ttft_ms_p50", "ttft_ms_p95", "bound_output_tok_s", "of_bound", "errors", "prompt_tokens_mean")
print(name, {k: round(row[k], 3) if isinstance(row.get(k), float) else row.get(k) for k in keys},
      row.get("decode_step"), row.get("loop_ms_per_step"), row.get("prefill"), row.get("server"))
