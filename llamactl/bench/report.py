"""bench results -> table rows, JSON, CSV, markdown; and --compare of two JSON results."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from llamactl.errors import InputError

COLUMNS = [  # (header, key, format)
    ("model", "model", "{}"), ("stage", "stage", "{}"), ("batch", "batch", "{}"), ("prompt", "prompt_len", "{}"),
    ("gen", "gen_len", "{}"), ("TTFT ms", "ttft_s", "ms"), ("prefill tok/s", "prefill_tok_s", "{:,.0f}"),
    ("decode tok/s", "decode_tok_s", "{:,.1f}"), ("per row", "decode_tok_s_per_row", "{:,.1f}"),
    ("ms/token p50", "latency_ms_p50", "{:.2f}"),
    ("p95", "latency_ms_p95", "{:.2f}"), ("speed-up", "speedup", "{:.2f}x"), ("peak mem", "peak_mem_bytes", "bytes"),
    ("weights", "weight_bytes", "bytes"), ("KV cache", "kv_bytes", "bytes"), ("attention", "attention_backend", "{}"),
    ("products", "products", "{}"),
    ("of ceiling", "bandwidth_ceiling_frac", "{:.0%}"),
]


SERVER_COLUMNS = [  # a load test's rows (bench --url)
    ("model", "model", "{}"), ("stage", "stage", "{}"), ("concurrency", "batch", "{}"), ("prompt", "prompt_len", "{}"),
    ("gen", "gen_len", "{}"), ("requests", "requests", "{}"), ("errors", "errors", "{}"),
    ("req/s", "requests_s", "{:.2f}"), ("output tok/s", "output_tok_s", "{:,.1f}"),
    ("TTFT ms p50", "ttft_ms_p50", "{:.1f}"), ("p95", "ttft_ms_p95", "{:.1f}"), ("p99", "ttft_ms_p99", "{:.1f}"),
    ("ITL ms p50", "itl_ms_p50", "{:.2f}"), ("p95", "itl_ms_p95", "{:.2f}"), ("e2e s p50", "e2e_s_p50", "{:.2f}"),
    ("p95", "e2e_s_p95", "{:.2f}"),
]


def add_speedups(results: list[dict]) -> None:
    """speedup: decode tok/s against the first measured row of the same batch and prompt length."""
    base: dict[tuple, float] = {}
    for r in results:
        key = (r["batch"], r["prompt_len"], r["gen_len"])
        if "skipped" in r:
            continue
        base.setdefault(key, r["decode_tok_s"])
        r["speedup"] = r["decode_tok_s"] / base[key] if base[key] else None


def _fmt(value: Any, fmt: str) -> str:
    from llamactl.ui import human_bytes

    if value is None:
        return "-"
    if fmt == "ms":
        return f"{value * 1000:.1f}"
    if fmt == "bytes":
        return human_bytes(value)
    return fmt.format(value)


def rows(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    if results and all("concurrency" in r for r in results):
        return [h for h, _, _ in SERVER_COLUMNS], [[_fmt(r.get(k), f) for _, k, f in SERVER_COLUMNS] for r in results]
    headers = [h for h, _, _ in COLUMNS]
    out = []
    for r in results:
        if "skipped" in r:
            out.append([r["model"], r["stage"], str(r["batch"]), str(r["prompt_len"]), str(r["gen_len"]),
                        f"skipped: {r['skipped']}"] + [""] * (len(COLUMNS) - 6))
        else:
            out.append([_fmt(r.get(k), f) for _, k, f in COLUMNS])
    quality = [r for r in results if r.get("quality")]
    if quality:
        headers += ["ppl", "KL", "top-1"]
        for row, r in zip(out, results):
            q = r.get("quality") or {}
            row += [_fmt(q.get("ppl"), "{:.3f}"), _fmt(q.get("kl_mean"), "{:.4f}"), _fmt(q.get("top1_agreement"), "{:.1%}")]
    return headers, out


def row_line(r: dict) -> str:
    """One measured row as a log line, printed as soon as it is measured: a run cut short (a time
    limit, Ctrl-C) still shows what it measured before the table."""
    where = f"{r['model']} | {r['stage']} | batch {r['batch']}, prompt {r['prompt_len']}"
    if r.get("skipped"):
        return f"{where}: skipped ({r['skipped']})"
    if "concurrency" in r:
        fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
        return (f"{where}: {r['output_tok_s']:.1f} output tok/s, {r['requests_s']:.2f} req/s, TTFT p50/p95 "
                f"{fmt(r['ttft_ms_p50'], '{:.0f}')}/{fmt(r['ttft_ms_p95'], '{:.0f}')} ms, ITL p50 "
                f"{fmt(r['itl_ms_p50'], '{:.1f}')} ms, TPOT {fmt(r.get('tpot_ms_mean'), '{:.2f}')} ms, {r['errors']} errors")
    if "speculation" in r:  # bench --draft
        s = r["speculation"]
        return (f"{where}: decode {r['decode_tok_s']:.1f} tok/s against {r['plain_decode_tok_s']:.1f} plain "
                f"({r['speedup_vs_plain']:.2f}x), {(s['acceptance'] or 0):.0%} of proposals kept, "
                f"{s['tokens_per_step'] or 0:.2f} tokens a verify step" + ("" if r["same_tokens"] else ", OTHER TOKENS"))
    return (f"{where}: decode {r['decode_tok_s']:.1f} tok/s ({r['bandwidth_ceiling_frac']:.1%} of the ceiling), "
            f"prefill {r['prefill_tok_s']:.0f} tok/s" + (f", gemv {r['gemv']}" if r.get("gemv") else ""))


def to_markdown(report: dict) -> str:
    headers, body = rows(report["results"])
    env = report["env"]
    cuda = f"CUDA {env['cuda']}, " if env.get("cuda") else ""
    if env.get("kind") == "load test":
        lines = [f"llamactl {env['llamactl_version']} (commit {env.get('commit')}), load test of {env['url']} from "
                 f"{env['host']}, {env['time']}", ""]
    else:
        lines = [f"llamactl {env['llamactl_version']} (commit {env.get('commit')}), torch {env['torch']}, "
                 f"{cuda}{env['device_name']}, {env['dtype']}, copy bandwidth {env['copy_bandwidth_gbs']} GB/s", ""]
    lines += ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def to_csv(report: dict) -> str:
    keys: list[str] = []
    for r in report["results"]:
        keys += [k for k in r if k not in keys and not isinstance(r[k], dict)]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    for r in report["results"]:
        w.writerow(r)
    return buf.getvalue()


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2, default=str) + "\n"


def _key(r: dict) -> tuple:
    return (r["model"], r.get("stage"), r["batch"], r["prompt_len"], r["gen_len"])


def parse_percent(value: str) -> float:
    try:
        return float(value.rstrip("%")) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise InputError(f"--max-slowdown {value!r} is not a percentage", "for example --max-slowdown 5%")


def load_report(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"bench result {path} does not exist", "write one with llamactl bench --format json -o FILE")
    try:
        report = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not a llamactl bench JSON result (not JSON: {type(e).__name__})",
                         "write one with llamactl bench --format json -o FILE") from None
    rows = report.get("results") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        raise InputError(f"{path} is not a llamactl bench JSON result (no list of results)",
                         "write one with llamactl bench --format json -o FILE")
    number = (int, float)
    for i, r in enumerate(rows):
        ok = isinstance(r, dict) and isinstance(r.get("model"), str) and isinstance(r.get("batch"), int) \
            and isinstance(r.get("prompt_len"), int) and ("skipped" in r or all(
                isinstance(r.get(m), number) and not isinstance(r.get(m), bool) and r[m] >= 0
                for m in ("decode_tok_s", "prefill_tok_s")))
        if not ok:
            raise InputError(f"{path}: result {i} lacks model, batch, prompt_len or non-negative decode/prefill tok/s",
                             "write one with llamactl bench --format json -o FILE")
    return report


def compare(base: dict, new: dict, max_slowdown: float) -> tuple[list[dict], bool]:
    """Matched rows with relative changes; ok is False when decode or prefill slowed beyond max_slowdown."""
    old = {_key(r): r for r in base["results"] if "skipped" not in r}
    diffs, ok = [], True
    for r in new["results"]:
        b = old.get(_key(r))
        if b is None or "skipped" in r:
            continue
        row = {"model": r["model"], "stage": r.get("stage"), "batch": r["batch"], "prompt_len": r["prompt_len"]}
        for metric in ("decode_tok_s", "prefill_tok_s"):
            change = r[metric] / b[metric] - 1 if b[metric] else 0.0
            row[metric] = (b[metric], r[metric], change)
            if change < -max_slowdown:
                ok = False
                row["regressed"] = True
        diffs.append(row)
    if not diffs:
        raise InputError("the two bench results share no configuration (model, stage, batch, prompt and gen lengths)",
                         "compare results of the same command")
    return diffs, ok
