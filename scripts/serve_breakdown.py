"""Where a served request's time to first token goes, per concurrency level: runs `llamactl bench
--url` at each level against a running server and reads its /metrics before and after, then prints
the client's TTFT (p50, p95) beside the server's mean (submit to the first token handed out), the prefill forwards
(count, mean) and the engine's gather wait in that level, and the CPU time of the server's HTTP
thread a request.

Usage: python scripts/serve_breakdown.py URL [--concurrency 1,8,32] [--requests 64] [-o OUT.json]
       [bench --url options after --, e.g. -- --prompt-len 128 --gen-len 256]
OUT.json: bench's JSON of every level (so `bench --compare` reads it) and "breakdown", the rows.
The difference between the client's TTFT and the server's is the HTTP side: the request's
intake and tokenizing before submit, and the first event's way back to the client."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request

FIELDS = ("llamactl_time_to_first_token_seconds_sum", "llamactl_time_to_first_token_seconds_count",
          "llamactl_engine_prefill_seconds", "llamactl_engine_prefill_forwards", "llamactl_engine_prefill_tokens",
          "llamactl_engine_gather_seconds", "llamactl_engine_decode_seconds", "llamactl_engine_decode_steps",
          "llamactl_http_thread_cpu_seconds")


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in FIELDS:
            out[name] = float(value)
    return out


def level(url: str, conc: int, requests: int, extra: list[str]) -> tuple[dict, dict]:
    """(the breakdown row, bench's JSON of the level)"""
    before = scrape(url)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "llamactl", "bench", "--url", url, "--concurrency", str(conc),
                        "--requests", str(requests), "--format", "json", "-o", f.name, *extra],
                       check=True, stdout=subprocess.DEVNULL)
        bench = json.load(open(f.name))
    client = bench["results"][0]
    d = {k: v - before.get(k, 0.0) for k, v in scrape(url).items()}
    fwd = max(d["llamactl_engine_prefill_forwards"], 1)
    return {
        "concurrency": conc,
        "client_ttft_ms_p50": client["ttft_ms_p50"], "client_ttft_ms_p95": client["ttft_ms_p95"],
        "server_ttft_ms_mean": 1000 * d["llamactl_time_to_first_token_seconds_sum"]
        / max(d["llamactl_time_to_first_token_seconds_count"], 1),
        "prefill_forwards": int(d["llamactl_engine_prefill_forwards"]),
        "prefill_ms_mean": 1000 * d["llamactl_engine_prefill_seconds"] / fwd,
        "prefill_tokens_mean": d["llamactl_engine_prefill_tokens"] / fwd,
        "gather_ms_per_forward": 1000 * d["llamactl_engine_gather_seconds"] / fwd,
        "decode_ms_per_step": 1000 * d["llamactl_engine_decode_seconds"] / max(d["llamactl_engine_decode_steps"], 1),
        "http_cpu_ms_per_request": 1000 * d.get("llamactl_http_thread_cpu_seconds", float("nan"))
        / max(client["requests"], 1),
        "output_tok_s": client["output_tok_s"],
    }, bench


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("-o", "--output")
    a = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    levels = [level(a.url, int(c), a.requests, extra) for c in a.concurrency.split(",")]
    rows = [row for row, _ in levels]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    if a.output:  # bench's JSON (every level's results, the first level's env) and the breakdown
        with open(a.output, "w") as f:
            json.dump({"env": levels[0][1]["env"], "results": [r for _, b in levels for r in b["results"]],
                       "breakdown": rows}, f, indent=1)


if __name__ == "__main__":
    main()
