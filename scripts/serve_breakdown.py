"""Where a served request's time to first token goes, per concurrency level: `llamactl bench --url`
against a running llamactl server (whose rows carry the server's side of each level, read from
its /metrics: "engine" and "server"), then a table of the client's TTFT (p50, p95) beside the
server's mean (submit to the first token handed out), the prefill forwards (count, mean ms and
tokens), the engine's gather wait a forward, its decode step, and the CPU time of the server's
HTTP thread a request. The difference between the client's TTFT and the server's is the HTTP side.

Usage: python scripts/serve_breakdown.py URL [--concurrency 1,8,32] [--requests 64] [-o OUT.json]
       [bench --url options after --, e.g. -- --prompt-len 128 --gen-len 256]
OUT.json: bench's JSON (so `bench --compare` reads it)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def breakdown(row: dict) -> dict:
    eng, server = row.get("engine", {}), row.get("server", {})
    fwd = max(eng.get("prefill_forwards", 0), 1)
    return {
        "concurrency": row["concurrency"],
        "client_ttft_ms_p50": row["ttft_ms_p50"], "client_ttft_ms_p95": row["ttft_ms_p95"],
        "server_ttft_ms_mean": server.get("ttft_ms_mean", float("nan")),
        "prefill_forwards": int(eng.get("prefill_forwards", 0)),
        "prefill_ms_mean": 1000 * eng.get("prefill_seconds", float("nan")) / fwd,
        "prefill_tokens_mean": eng.get("prefill_tokens", float("nan")) / fwd,
        "gather_ms_per_forward": 1000 * eng.get("gather_seconds", float("nan")) / fwd,
        "decode_ms_per_step": 1000 * eng.get("decode_seconds", float("nan")) / max(eng.get("decode_steps", 0), 1),
        "http_cpu_ms_per_request": server.get("http_cpu_ms_per_request", float("nan")),
        "output_tok_s": row["output_tok_s"],
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("-o", "--output")
    a = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = a.output or f"{tmp}/load.json"
        subprocess.run([sys.executable, "-m", "llamactl", "bench", "--url", a.url, "--concurrency", a.concurrency,
                        "--requests", str(a.requests), "--format", "json", "-o", out, *extra],
                       check=True, stdout=subprocess.DEVNULL)
        rows = [breakdown(r) for r in json.load(open(out))["results"]]
    print("| " + " | ".join(rows[0]) + " |\n|" + " --- |" * len(rows[0]))
    for r in rows:
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
