"""Fuzzing the CLI with hypothesis (bounded): corrupted folders and files give one error line and
exit 1, malformed options exit 2, and nothing raises a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llamactl.cli.app import app

runner = CliRunner()
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                derandomize=True)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "rope_scaling", "rope_parameters", "tie_word_embeddings", "eos_token_id", "bos_token_id",
               "quantization_config", "model_type"]


def _no_traceback(r, codes=(0, 1)):
    assert r.exit_code in codes, (r.exit_code, r.output)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    if r.exit_code == 1:
        assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) <= 2, r.stderr


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_gqa):
    work = tmp_path_factory.mktemp("fuzz") / "m"
    shutil.copytree(tiny_gqa, work)
    return work


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=JSON)
def test_any_config_value_is_loaded_or_refused_in_one_line(folder, tiny_gqa, key, value):
    cfg = json.loads((tiny_gqa / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    _no_traceback(runner.invoke(app, ["inspect", str(folder)]))


@FUZZ
@given(offset=st.integers(0, 400), data=st.binary(min_size=1, max_size=16))
def test_a_damaged_safetensors_header_is_refused_in_one_line(folder, tiny_gqa, offset, data):
    (folder / "config.json").write_text((tiny_gqa / "config.json").read_text())
    name = next(p.name for p in tiny_gqa.glob("*.safetensors"))
    raw = bytearray((tiny_gqa / name).read_bytes())
    raw[offset:offset + len(data)] = data
    (folder / name).write_bytes(bytes(raw))
    try:
        _no_traceback(runner.invoke(app, ["inspect", str(folder)]))
    finally:
        shutil.copy(tiny_gqa / name, folder / name)


@FUZZ
@given(doc=JSON)
def test_any_bench_result_file_compares_or_is_refused(tmp_path_factory, doc):
    d = tmp_path_factory.mktemp("cmp")
    base = d / "base.json"
    base.write_text(json.dumps({"results": [{"model": "m", "stage": "s", "batch": 1, "prompt_len": 8,
                                             "decode_tok_s": 10.0, "prefill_tok_s": 5.0}]}))
    new = d / "new.json"
    new.write_text(json.dumps(doc if not isinstance(doc, dict) else {"results": [doc]}))
    _no_traceback(runner.invoke(app, ["bench", "--compare", str(base), str(new)]))


@FUZZ
@given(option=st.sampled_from(["--prompt-len", "--batch", "--gen-len", "--warmup", "--repeat", "--format", "--mode",
                               "--kernels", "--pdl", "--quant-inputs", "--synthetic-quant", "--max-slowdown"]),
       value=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8).filter(
           lambda v: not v.isdigit() and v not in ("1", "table", "json", "csv", "markdown", "on", "off")))
def test_malformed_bench_options_are_usage_errors(option, value):
    """Run against a missing model so that a value that does parse fails fast (exit 1)."""
    r = runner.invoke(app, ["bench", "/nonexistent-model", option, value])
    _no_traceback(r, codes=(1, 2))
