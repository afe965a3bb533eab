"""bench: statistics, the JSON schema, formats, --compare, --profile and bad options."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from llamactl.cli.app import app
from llamactl.bench.stats import median, percentile, spread

runner = CliRunner()
RESULT_KEYS = ("model", "device", "batch", "prompt_len", "gen_len", "ttft_s", "prefill_tok_s", "decode_tok_s",
               "latency_ms_p50", "latency_ms_p95", "peak_mem_bytes", "weight_bytes", "kv_bytes",
               "attention_backend", "bandwidth_ceiling_frac")


def bench(*args):
    return runner.invoke(app, ["bench", *map(str, args)])


def test_percentiles_interpolate_like_numpy():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert median(xs) == 3.0
    assert median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 95) == pytest.approx(4.8)  # numpy.percentile(..., 95, method="linear")
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    assert spread([9.0, 10.0, 11.0]) == {"min": 9.0, "max": 11.0, "rel": pytest.approx(0.1)}
    with pytest.raises(ValueError):
        percentile(xs, 101)


@pytest.fixture(scope="module")
def tiny_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "base.json"
    r = bench("--synthetic", "tiny", "--prompt-len", "16,32", "--gen-len", "8", "--warmup", "1", "--repeat", "2",
              "--format", "json", "-o", out)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == json.loads(out.read_text())
    # each row is logged as soon as it is measured, in one line (a run cut short keeps them)
    for row in json.loads(r.stdout)["results"]:
        line = f"synthetic:tiny | {row['stage']} | batch 1, prompt {row['prompt_len']}: decode {row['decode_tok_s']:.1f} tok/s"
        assert line in r.stderr, (line, r.stderr)
    return out


def test_json_schema_on_synthetic_tiny(tiny_json):
    report = json.loads(tiny_json.read_text())
    env = report["env"]
    for key in ("llamactl_version", "commit", "torch", "cuda", "device_name", "dtype", "copy_bandwidth_gbs"):
        assert key in env
    assert env["copy_bandwidth_gbs"] > 0
    results = report["results"]
    assert [r["prompt_len"] for r in results] == [16, 32]
    for r in results:
        for key in RESULT_KEYS:
            assert key in r, key
        assert r["model"] == "synthetic:tiny" and r["gen_len"] == 8 and r["repeats"] == 2
        assert r["decode_tok_s"] > 0 and r["ttft_s"] > 0
        assert r["latency_ms_p50"] <= r["latency_ms_p95"]
        assert 0 < r["bandwidth_ceiling_frac"] < 1.5
        assert r["products"], r  # what the linears ran at this batch, named
        # SDPA, or llamactl's CPU decode attention with SDPA for prefill
        assert r["attention_backend"].startswith(("sdpa", "llamactl cpu (decode), sdpa"))
        # tiny: 4 layers x 2 KV heads x head_dim 32 x 2 (K, V) x the dtype's bytes (the CPU's default:
        # bf16 where llamactl's CPU kernels run it, else float32)
        size = {"float32": 4, "bfloat16": 2}[r["dtype"]]
        assert r["kv_bytes"] == 4 * 2 * 32 * 2 * size * (r["prompt_len"] + 8)


def test_compare_fails_on_a_planted_slowdown(tiny_json, tmp_path):
    report = json.loads(tiny_json.read_text())
    same = tmp_path / "same.json"
    same.write_text(json.dumps(report))
    assert bench("--compare", tiny_json, same, "--max-slowdown", "5%").exit_code == 0
    slow = copy.deepcopy(report)
    slow["results"][1]["decode_tok_s"] *= 0.90
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    r = bench("--compare", tiny_json, tmp_path / "slow.json", "--max-slowdown", "5%")
    assert r.exit_code == 1 and "SLOWER" in r.stdout
    assert bench("--compare", tiny_json, tmp_path / "slow.json", "--max-slowdown", "15%").exit_code == 0
    fast = copy.deepcopy(report)
    fast["results"][0]["prefill_tok_s"] *= 1.5
    (tmp_path / "fast.json").write_text(json.dumps(fast))
    assert bench("--compare", tiny_json, tmp_path / "fast.json").exit_code == 0


def test_markdown_and_csv_formats_on_the_shared_model(trained_model):
    r = bench(trained_model, "--prompt-len", "16", "--gen-len", "4", "--warmup", "0", "--repeat", "1",
              "--format", "markdown")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[2].startswith("| model | stage |") and "decode tok/s" in lines[2]
    assert len([l for l in lines if l.startswith("| ")]) == 3  # header, separator, one result
    c = bench("--synthetic", "tiny", "--prompt-len", "8", "--gen-len", "4", "--warmup", "0", "--repeat", "1",
              "--format", "csv")
    header, row = c.stdout.strip().splitlines()
    assert header.split(",")[:3] == ["model", "stage", "batch"] and row.startswith("synthetic:tiny,")


@pytest.mark.slow
def test_stages_show_what_cannot_run_here(trained_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU every stage runs")
    r = bench(trained_model, "--stages", "--prompt-len", "8", "--gen-len", "4", "--warmup", "0", "--repeat", "1",
              "--format", "json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    stages = [x["stage"] for x in rows]
    assert stages[0] == "transformers generate() eager" and "llamactl static cache" in stages
    assert rows[0]["speedup"] == 1.0
    skipped = {x["stage"]: x["skipped"] for x in rows if "skipped" in x}
    assert "needs a CUDA device" in skipped["llamactl + CUDA graphs"]
    assert "transformers generate() static cache" in skipped


@pytest.mark.slow
def test_quality_against_the_manifest_root(trained_model, tmp_path):
    q = tmp_path / "rtn"
    assert runner.invoke(app, ["quantize", str(trained_model), "-o", str(q), "--method", "rtn",
                               "--eval-tokens", "0"]).exit_code == 0
    r = bench(q, "--quality", "--eval-tokens", "1024", "--prompt-len", "8", "--gen-len", "4", "--warmup", "0",
              "--repeat", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    qual = json.loads(r.stdout)["results"][0]["quality"]
    assert qual["reference"] == str(trained_model.resolve()) and qual["scored"] == "prefill"
    assert qual["kl_mean"] > 0 and qual["ppl"] > qual["ppl_parent"] * 0.98
    assert 4 < qual["file_bpw"] < 10  # 4-bit linears, 16-bit embedding and head
    # the packaged model is named as in every command
    r = bench(q, "--quality", "--reference", "embedded", "--eval-tokens", "256", "--prompt-len", "8", "--gen-len", "4",
              "--warmup", "0", "--repeat", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["results"][0]["quality"]["kl_mean"] > 0


def test_decode_scoring_matches_prefill_scoring(trained_model):
    """quality.decode_logits (one position at a time, as decoding runs; bench scores int8-input
    rows with it on a GPU) gives the logits of one prefill over the window."""
    import torch

    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.load import load_model
    from llamactl.quality import decode_logits, prefill_logits

    model = load_model(open_artifact(trained_model), torch.device("cpu"), torch.float32)
    ids = torch.arange(100, 164).view(1, -1)
    a, b = decode_logits(model, ids), prefill_logits(model, ids)
    assert a.shape == b.shape == (1, 64, model.args.vocab_size)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_profile_writes_a_trace(tmp_path):
    r = bench("--synthetic", "tiny", "--prompt-len", "8", "--gen-len", "4", "--warmup", "0", "--repeat", "1",
              "--profile", tmp_path / "prof", "--format", "json")
    assert r.exit_code == 0, r.output
    traces = list((tmp_path / "prof").glob("*.pt.trace.json"))
    assert len(traces) == 1 and "traceEvents" in json.loads(traces[0].read_text())


def test_pdl_variants_are_timed_only_where_they_change_something():
    """--pdl off,on doubles the GPU configurations with kernels on, and nothing else; each variant
    is an options object (no environment variable is set)."""
    import torch

    from llamactl.bench import trials as core
    from llamactl.options import RuntimeOptions

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    both = (False, True)

    def flat(vs):
        return [(mode, o.kernels, o.pdl, o.quant_inputs) for mode, o in vs]

    assert flat(core.variants(["compile"], (True, False), both, gpu)) == [
        ("compile", True, False, "int16"), ("compile", True, True, "int16"), ("compile", False, False, "int16")]
    assert flat(core.variants(["eager"], (True,), both, cpu)) == [("eager", True, False, "int16")]
    assert flat(core.variants(["graphs"], (True,), (None,), gpu, base=RuntimeOptions(pdl=False))) == [
        ("graphs", True, False, "int16")]
    # --quant-inputs float,int8: both for a quantized model with kernels on a GPU, else the first
    kinds = ("float", "int8")
    assert flat(core.variants(["compile"], (True, False), (None,), gpu, kinds)) == [
        ("compile", True, True, "float"), ("compile", True, True, "int8"), ("compile", False, True, "float")]
    assert flat(core.variants(["compile"], (True,), (None,), gpu, kinds, quantized=False)) == [("compile", True, True, "float")]
    assert flat(core.variants(["eager"], (True,), (None,), cpu, kinds)) == [("eager", True, True, "float")]
    r = bench("--synthetic", "tiny", "--prompt-len", "8", "--gen-len", "4", "--warmup", "0", "--repeat", "1",
              "--pdl", "off,on", "--format", "json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["results"]) == 1  # the CPU: one row, PDL changes nothing there
    r = bench("--synthetic", "tiny", "--synthetic-quant", "int8", "--dtype", "bfloat16", "--prompt-len", "8", "--gen-len", "4", "--warmup", "0",
              "--repeat", "1", "--quant-inputs", "float,int8", "--format", "json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["results"]) == 1  # nor do int8 inputs (GPU kernels only)


@pytest.mark.parametrize("args,code", [
    (("--prompt-len", "abc"), 2), (("--prompt-len", "0"), 2), (("--batch", "1,x"), 2), (("--synthetic", "gpt5"), 1),
    (("--format", "xml"), 2), (("--mode", "turbo"), 2), (("--gen-len", "1"), 2), (("--pdl", "maybe"), 2),
    (("--quant-inputs", "int4"), 2),
])
def test_bad_options(args, code):
    r = bench(*args)
    assert r.exit_code == code, r.output


def test_compare_missing_file(tmp_path):
    r = bench("--compare", tmp_path / "a.json", tmp_path / "b.json")
    assert r.exit_code == 1 and "does not exist" in r.stderr


def test_a_busy_cpu_is_said(monkeypatch):
    import os

    from llamactl.cli.measure import busy_cpu

    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert busy_cpu() == "load 9.0 on 2 cores"
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    assert busy_cpu() is None


def test_rows_name_the_products_of_their_batch():
    """A bench row says what the linears ran at its batch: int4 layers with groups of 128 and of
    64 at 1 to 65 rows, prepared or not (the layers' own product(), no GPU needed), torch's for the rest."""
    import torch

    from llamactl.layers.int4 import TritonInt4Linear
    from llamactl.layers.plan import products

    lin = TritonInt4Linear.__new__(TritonInt4Linear)  # no weights: product() reads the group size alone
    torch.nn.Module.__init__(lin)
    lin.group_size, lin.skinny, lin.inputs = 128, False, "float"
    assert [lin.product(r) for r in (1, 8, 64, 65)] == ["int4 GEMV", "int4 split-K", "int4 split-K",
                                                        "int4 dequantize + cuBLAS"]
    lin.skinny, lin.bias, lin.perm, lin.pad = True, None, None, 0  # prepared with the kernels on
    assert [lin.product(r) for r in (2, 32, 33)] == ["int4 skinny", "int4 skinny", "int4 split-K"]
    lin.inputs = "int16"  # the GEMV's default inputs: the codes on the int8 MMA
    assert lin.product(8) == "int4 skinny int8 MMA"
    lin.inputs = "float"
    lin.group_size = 64
    assert lin.product(16) == "int4 multirow" and lin.product(17) == "int4 dequantize + cuBLAS"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), lin)
    assert products(model, 8) == "torch Linear; int4 multirow"


def test_a_stopped_bench_writes_the_rows_it_finished(tmp_path, monkeypatch):
    """SIGTERM or Ctrl-C in the second row: -o holds the first, marked interrupted; exit 143, one line."""
    from llamactl.bench import trials
    from llamactl.errors import Terminated

    calls, timed = [], trials.time_llamactl

    def second_stops(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise Terminated()
        return timed(*a, **kw)

    monkeypatch.setattr(trials, "time_llamactl", second_stops)
    out = tmp_path / "rows.json"
    r = bench("--synthetic", "tiny", "--prompt-len", "16,32", "--gen-len", "4", "--warmup", "0", "--repeat", "1",
              "--format", "json", "-o", out)
    assert r.exit_code == 143, r.output
    assert f"terminated; what was finished is in {out}" in r.output and "Traceback" not in r.output
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and [row["prompt_len"] for row in data["results"]] == [16]


def test_a_failed_mode_is_an_error_row_and_the_others_are_kept(tmp_path, monkeypatch):
    """One variant raising mid-run (a mode that crashes on this model) is a row with its error, the
    other rows are measured and written, -o holds each row as it lands, and bench exits non-zero
    with one line naming the failure."""
    from llamactl.bench import trials

    timed, seen = trials.time_llamactl, []

    def compile_fails(model, batch, p, gen_len, trial, mode, *a, **kw):
        if seen:  # -o was written after the row before this one
            assert len(json.loads(out.read_text())["results"]) == len(seen)
        seen.append(mode)
        if mode == "compile":
            raise KeyError("model.lm_head.weight")
        return timed(model, batch, p, gen_len, trial, mode, *a, **kw)

    monkeypatch.setattr(trials, "time_llamactl", compile_fails)
    out = tmp_path / "rows.json"
    r = bench("--synthetic", "tiny", "--mode", "eager,compile", "--prompt-len", "16,32", "--gen-len", "4",
              "--warmup", "0", "--repeat", "1", "--format", "json", "-o", out)
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "2 of 4 rows failed" in r.output and "KeyError" in r.output
    rows = json.loads(out.read_text())["results"]
    assert [(x["prompt_len"], bool(x.get("failed"))) for x in rows] == [(16, False), (16, True), (32, False), (32, True)]
    assert all(x["decode_tok_s"] > 0 for x in rows if not x.get("failed"))


def test_draft_rows_measure_speculation_against_plain_decoding_in_the_same_run(tmp_path):
    """bench --draft: a row per prompt length at batch 1 with generate's speculative loop and its
    plain loop, alternating on real text: their decode rates and ratio, the proposals kept, and
    that both gave the same tokens (float32); random weights draft with their shape's int4 weights."""
    out = tmp_path / "r.json"
    r = bench("--device", "cpu", "--dtype", "float32", "--mode", "eager", "--prompt-len", "96", "--gen-len", "24",
              "--warmup", "0", "--repeat", "2", "--draft", "ngram", "--format", "json", "-o", out)
    assert r.exit_code == 0, r.output
    [row] = [x for x in json.loads(out.read_text())["results"] if "speculation" in x]
    assert row["stage"] == "llamactl speculative (ngram, up to 4)" and row["batch"] == 1 and row["prompt_len"] == 96
    assert row["same_tokens"] and row["decode_tok_s"] > 0 and row["plain_decode_tok_s"] > 0
    assert row["speedup_vs_plain"] == row["decode_tok_s"] / row["plain_decode_tok_s"]
    assert row["speculation"]["verify_steps"] > 0 and "proposals kept" in r.stderr
    # (int4 weights run with bf16 activations, where a verify step's rounding may part from a step's)
    r = bench("--synthetic", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--mode", "eager", "--prompt-len", "32",
              "--gen-len", "12", "--warmup", "0", "--repeat", "1", "--draft", "self-int4", "--speculate", "2",
              "--format", "json")
    assert r.exit_code == 0, r.output
    [row] = [x for x in json.loads(r.stdout)["results"] if "speculation" in x]
    assert row["speculation"]["k"] == 2 and row["speculation"]["draft"] == "model" and row["speculation"]["verify_steps"] > 0
