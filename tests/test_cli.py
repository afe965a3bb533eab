"""The CLI contract through Typer's CliRunner: exit codes, stdout/stderr, one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from llamactl.cli.app import app

runner = CliRunner()


def invoke(*args, input=None, env=None):
    return runner.invoke(app, [str(a) for a in args], input=input, env=env)


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_generate_from_embedded_model_streams_text():
    r = invoke("generate", "-p", "The kernel", "--max-new-tokens", "40", "--seed", "0")
    assert r.exit_code == 0, r.output
    assert len(r.stdout.strip()) > 20
    assert "decode" in r.stderr and "tok/s" in r.stderr


def test_generate_json_has_the_documented_keys_and_seed_repeats():
    args = ("generate", "-p", "Python", "-n", "12", "--seed", "3", "--temperature", "1.0", "--json")
    a, b = invoke(*args), invoke(*args)
    assert a.exit_code == 0, a.output
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    for key in ("text", "token_ids", "ttft_s", "prefill_tok_s", "decode_tok_s", "peak_mem_bytes"):
        assert key in ja
    assert len(ja["token_ids"]) <= 12 and ja["text"] == jb["text"] and ja["token_ids"] == jb["token_ids"]
    assert ja["peak_mem_bytes"] > 0 and ja["decode_tok_s"] > 0


def test_prompt_from_stdin_and_greedy_is_deterministic():
    a = invoke("generate", "-n", "8", "--temperature", "0", "--json", input="The file system\n")
    b = invoke("generate", "-p", "The file system", "-n", "8", "--temperature", "0", "--json")
    assert a.exit_code == 0, a.output
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def test_quiet_silences_stderr():
    r = invoke("--quiet", "generate", "-p", "x", "-n", "3")
    assert r.exit_code == 0 and r.stderr == ""


def test_inspect_json(tiny_gqa, trained_model):
    r = invoke("inspect", tiny_gqa, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["num_attention_heads"] == 4 and info["num_key_value_heads"] == 2
    # 2 (K and V) x 2 layers x 2 KV heads x head_dim 16 x 2 bytes
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert info["quantization"] is None and info["lineage"] == []
    big = json.loads(invoke("inspect", trained_model, "--json").stdout)
    assert big["params"] == 16_913_280
    assert big["kv_bytes_per_token"] == 2 * 6 * 6 * 64 * 2
    assert big["kv_bytes_at_4k"] == big["kv_bytes_per_token"] * 4096


def test_inspect_table_on_embedded_model():
    r = invoke("inspect")
    assert r.exit_code == 0
    assert "16,913,280" in r.stdout and "9.0 KiB/token" in r.stdout


def test_missing_path(tmp_path):
    assert_one_line_error(invoke("inspect", tmp_path / "nope"), str(tmp_path / "nope"), "does not exist")


def test_folder_that_is_not_a_checkpoint(tmp_path):
    assert_one_line_error(invoke("generate", tmp_path, "-p", "x"), "missing the files", "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
                                                      "intermediate_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 2}))
    assert_one_line_error(invoke("inspect", tmp_path), "missing the files", "model.safetensors")


def test_non_llama_model_type(tmp_path, tiny_gqa):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_gqa, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(invoke("inspect", bad), "'gpt2'", "not a LLaMA")


def test_truncated_safetensors(tmp_path, tiny_gqa):
    bad = tmp_path / "trunc"
    shutil.copytree(tiny_gqa, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_one_line_error(invoke("generate", bad, "-p", "x"), "model.safetensors", "truncated or corrupt")


def test_prompt_longer_than_context(tmp_path):
    from conftest import make_hf_model

    short = make_hf_model(tmp_path / "short", max_pos=32)
    assert_one_line_error(invoke("generate", short, "-p", "word " * 100), "prompt has", "context is 32")


def test_no_prompt_at_all():
    assert_one_line_error(invoke("generate", input=""), "no prompt")


@pytest.mark.parametrize("args", [
    ("generate", "-p", "x", "--max-new-tokens", "0"),
    ("generate", "-p", "x", "--temperature", "-1"),
    ("generate", "-p", "x", "--top-p", "1.5"),
    ("generate", "-p", "x", "--device", "tpu"),
    ("generate", "-p", "x", "--dtype", "int3"),
    ("generate", "--no-such-option"),
])
def test_impossible_option_values_are_usage_errors(args):
    r = invoke(*args)
    assert r.exit_code == 2, r.output


def test_debug_shows_traceback(tmp_path):
    r = invoke("inspect", tmp_path / "nope", env={"LLAMACTL_DEBUG": "1"})
    assert r.exit_code == 1 and "Traceback" in r.stderr and "CheckpointError" in r.stderr


def test_cuda_requested_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert_one_line_error(invoke("generate", "-p", "x", "--device", "cuda"), "no CUDA device")


def test_streamed_text_equals_the_decoded_tokens():
    from llamactl.runtime.generate import Result, Sampling, Step, generate
    from llamactl.runtime.load import load

    _, model, tok, _ = load(None, "cpu", "float32")
    events = list(generate(model, tok, tok("Usage:\n").input_ids, 120, Sampling(temperature=1.0, seed=5), set(),
                           ignore_eos=True))
    streamed = "".join(e.text for e in events if isinstance(e, Step))
    result = events[-1]
    assert isinstance(result, Result) and streamed == result.text == tok.decode(result.token_ids, skip_special_tokens=True)
    assert "\n" in streamed  # the segment reset at newlines was exercised


def test_generate_names_its_gemv_and_says_when_int8_inputs_change_nothing():
    """--quant-inputs int8 acts only on int4/int8 models on llamactl's GPU kernels; elsewhere it warns."""
    r = invoke("generate", "-p", "The kernel", "-n", "4", "--seed", "0", "--quant-inputs", "int8", "--json")
    from llamactl.layers import cpu as lcpu

    gemv = "llamactl cpu" if lcpu.quant_fast() or lcpu.bf16_fast() else "torch"  # the CPU's kernels here
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["extra"]["gemv"] == gemv
    assert "--quant-inputs int8 changed nothing" in r.stderr
    plain = invoke("generate", "-p", "The kernel", "-n", "4", "--seed", "0", "--quant-inputs", "float")
    assert plain.exit_code == 0 and "changed nothing" not in plain.stderr and f"gemv {gemv}" in plain.stderr
    bad = invoke("generate", "-p", "x", "--quant-inputs", "fp8")
    assert bad.exit_code == 2 and "use float, int8, fp16 or int16" in bad.output


@pytest.mark.parametrize("args", [["--help"], ["inspect", "/nonexistent"], ["bench", "--compare", "a.json", "b.json"],
                                  ["generate", "-p", "x", "--quant-inputs", "fp8"]])
def test_quick_answers_do_not_import_torch(args, tmp_path):
    """--help, one-line errors and bench --compare answer without importing torch (12-35 s under load)."""
    import subprocess
    import sys

    code = ("import sys\nfrom llamactl.cli.app import app\ntry:\n    app(prog_name='llamactl', args=sys.argv[1:])\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO TORCH')")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.stdout.strip().endswith("NO TORCH"), r.stdout[-300:] + r.stderr[-300:]


def test_global_flags_work_after_the_command():
    r = invoke("generate", "-p", "The kernel", "-n", "2", "--temperature", "0", "-q")
    assert r.exit_code == 0 and r.stderr == ""


def test_chat_templates_by_name_or_file_and_a_bad_one(tmp_path):
    from llamactl.runtime.chat import BUILTIN, apply, resolve

    class Tok:
        chat_template = None

    t = Tok()
    assert apply(t, None) is None and apply(t, "plain") == "plain" and t.chat_template == BUILTIN["plain"]
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert apply(t, str(f)) == str(f) and t.chat_template == f.read_text() and apply(t, None) == "the model's"
    r = runner.invoke(app, ["generate", "--chat", "--chat-template", str(tmp_path / "none"), "-p", "hi"])
    assert r.exit_code != 0 and "neither a built-in" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["generate", "--chat", "-p", "The capital of France is", "-n", "3", "--device", "cpu",
                            "--temperature", "0"])
    assert r.exit_code == 0 and "no chat template" not in r.output  # the embedded model's own
    assert resolve("chatml") == BUILTIN["chatml"]
    child = tmp_path / "q"  # a folder made from the embedded model chats as it does
    assert invoke("quantize", "embedded", "-o", str(child), "--method", "rtn", "--eval-tokens", "0").exit_code == 0
    assert json.loads((child / "tokenizer_config.json").read_text())["chat_template"] == BUILTIN["plain"]
    r = invoke("generate", str(child), "--chat", "-p", "Hi", "-n", "2", "--device", "cpu")
    assert r.exit_code == 0 and "no chat template" not in r.output


def test_kv_dtype_names_the_cache_and_refuses_what_cannot_run():
    r = invoke("generate", "-p", "The kernel", "-n", "4", "--temperature", "0", "--kv-dtype", "int8", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["extra"]["kv_dtype"] == "int8"
    assert_one_line_error(invoke("generate", "-p", "x", "--dtype", "float32", "--kv-dtype", "bf16"),
                          "--kv-dtype bf16 with a float32 model",
                          "--kv-dtype auto")
    bad = invoke("generate", "-p", "x", "--kv-dtype", "int4")
    assert bad.exit_code == 2 and "use auto, bf16, fp16, fp8 or int8" in bad.output
    bad = invoke("bench", "--kv-dtype", "auto,q8")
    assert bad.exit_code == 2 and "--kv-dtype 'auto,q8'" in bad.output
