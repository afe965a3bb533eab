"""Tensor parallelism on the CPU: gloo processes started by `--tp N` give the tokens of one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_hf_model
from llamactl.folder.artifact import open_artifact
from llamactl.cli.app import app
from llamactl.runtime.load import load_model, load_shard
from llamactl.runtime.tp import plan_shard

PROMPT = ["-p", "The kernel schedules", "-n", "10", "--device", "cpu", "--dtype", "float32", "--json"]


def generate(folder: Path, *extra: str) -> dict:
    """--tp N runs start their processes; the one-process reference runs here (CliRunner), saving a start."""
    argv = ["generate", str(folder), *PROMPT, *extra]
    if "--tp" not in extra:
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 0, r.output[-3000:]
        return json.loads(r.stdout)
    r = subprocess.run([sys.executable, "-m", "llamactl", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def gqa_bf16(tmp_path_factory) -> Path:
    """A tiny GQA model (4 heads, 2 KV heads) stored in bf16."""
    from transformers import AutoModelForCausalLM

    src = make_hf_model(tmp_path_factory.mktemp("gqa32"), heads=4, kv_heads=2, hidden=64, layers=2, seed=5)
    out = tmp_path_factory.mktemp("gqa16")
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / f).write_bytes((src / f).read_bytes())
    return out


@pytest.mark.slow
def test_two_processes_give_the_tokens_of_one(gqa_bf16, tmp_path):
    """bf16 weights and an int4 checkpoint (RTN g32): greedy and seeded sampling at --tp 2 equal
    --tp 1 token for token (float32 on the CPU, gloo)."""
    one, two = generate(gqa_bf16, "--temperature", "0"), generate(gqa_bf16, "--temperature", "0", "--tp", "2")
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 10
    assert two["tensor_parallel"]["world_size"] == 2 and not two["tensor_parallel"]["kv_heads_replicated"]
    sampled = ["--temperature", "0.9", "--seed", "7"]
    assert generate(gqa_bf16, *sampled, "--tp", "2")["token_ids"] == generate(gqa_bf16, *sampled)["token_ids"]
    q = tmp_path / "int4"
    r = CliRunner().invoke(app, ["quantize", str(gqa_bf16), "-o", str(q), "--method", "rtn", "--group-size", "32", "--eval-tokens", "0"])
    assert r.exit_code == 0, r.output
    assert generate(q, "--temperature", "0", "--tp", "2")["token_ids"] == generate(q, "--temperature", "0")["token_ids"]


@pytest.mark.slow
def test_kv_heads_that_do_not_split_are_replicated(tmp_path):
    mqa = make_hf_model(tmp_path / "mqa", heads=4, kv_heads=1, hidden=64, layers=2, seed=6)
    two = generate(mqa, "--temperature", "0", "--tp", "2")
    assert two["tensor_parallel"]["kv_heads_replicated"] and two["tensor_parallel"]["kv_heads"] == [0, 1]
    assert two["token_ids"] == generate(mqa, "--temperature", "0")["token_ids"]


def test_each_rank_reads_only_its_slices(gqa_bf16):
    """The loader reads each rank's rows and columns of the split layers (half of them at --tp 2)
    and all of the replicated ones; the shards put back together are the whole model."""
    art = open_artifact(gqa_bf16)
    full = load_model(art, torch.device("cpu"), torch.float32)
    index = art.tensor_index()
    split = {n for n in index if ".layers." in n and not n.endswith("norm.weight")}
    total = {n: int(torch.tensor(index[n]["shape"]).prod()) for n in index}
    reads, ranks = [], []
    for rank in range(2):
        seen: dict[str, int] = {}
        ranks.append(load_shard(art, torch.device("cpu"), torch.float32, None, rank, 2,
                                read=lambda name, n: seen.__setitem__(name, n)))
        reads.append(seen)
    for name in index:
        if name in split:
            assert reads[0][name] == reads[1][name] == total[name] // 2, name
        else:
            assert reads[0][name] == reads[1][name] == total[name], name
    for i in range(2):
        a, b = (m.model.layers[i] for m in ranks)
        f = full.model.layers[i]
        torch.testing.assert_close(torch.cat([a.self_attn.q_proj.weight, b.self_attn.q_proj.weight]), f.self_attn.q_proj.weight)
        torch.testing.assert_close(torch.cat([a.mlp.down_proj.weight, b.mlp.down_proj.weight], 1), f.mlp.down_proj.weight)


def test_shard_plans_and_their_refusals():
    from llamactl.folder.config import LlamaArgs
    from llamactl.errors import InputError

    args = LlamaArgs.from_hf({"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
                              "num_hidden_layers": 1, "intermediate_size": 1024, "vocab_size": 100})
    assert [plan_shard(args, r, 2).kv for r in range(2)] == [(0, 1), (1, 2)]
    four = [plan_shard(args, r, 4) for r in range(4)]
    assert [s.kv for s in four] == [(0, 1), (0, 1), (1, 2), (1, 2)] and all(s.kv_replicated for s in four)
    assert [s.ffn for s in four][-1] == (768, 1024)
    with pytest.raises(InputError, match="do not split 3 ways"):
        plan_shard(args, 0, 3)
    with pytest.raises(InputError, match="whole units of 512"):
        plan_shard(args, 0, 4, group_size=512)


@pytest.mark.slow
def test_bench_reports_the_world_and_its_all_reduces(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "llamactl", "bench", "--synthetic", "tiny", "--device", "cpu", "--dtype", "float32",
                        "--prompt-len", "16", "--gen-len", "8", "--warmup", "0", "--repeat", "1", "--tp", "2",
                        "--format", "json", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(out.read_text())["results"][0]
    assert row["world_size"] == 2 and row["allreduce_ms_per_step"] > 0 and row["decode_tok_s"] > 0
    assert row["tensor_parallel"]["query_heads"] == [0, 4]  # rank 0's shard: its bytes, its fraction of the ceiling


@pytest.mark.slow
def test_a_tensor_parallel_server_answers_as_one_process(gqa_bf16):
    """serve --tp 2 (gloo): rank 0 serves and schedules, rank 1 follows its steps; two requests at
    once (greedy and seeded), the greedy one equal to one-process `generate`; SIGTERM ends both (0)."""
    pytest.importorskip("uvicorn")
    from concurrent.futures import ThreadPoolExecutor

    from servers import Server

    ref = generate(gqa_bf16, "--temperature", "0")
    s = Server([str(gqa_bf16), "--tp", "2", "--dtype", "float32", "--max-batch", "2", "--max-seq", "128"])
    try:
        assert "tensor-parallel over 2 (gloo)" in "".join(s.lines)
        bodies = [{"prompt": "The kernel schedules", "max_tokens": 10, "temperature": 0},
                  {"prompt": "A second request", "max_tokens": 6, "temperature": 0.8, "seed": 3}]
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda b: s.client.post("/v1/completions", json=b).json(), bodies))
        assert outs[0]["choices"][0]["text"] == ref["text"]
        again = s.client.post("/v1/completions", json=bodies[1]).json()
        assert again["choices"][0]["text"] == outs[1]["choices"][0]["text"]
    finally:
        code = s.stop()
    assert code == 0, "".join(s.lines)[-2000:]
