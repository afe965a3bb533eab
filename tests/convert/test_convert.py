"""convert: Meta checkpoints and GGUF files to Hugging Face folders, and folders to GGUF."""

from __future__ import annotations

import json
import os
import math
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import make_hf_model, trained_model_path
from llamactl.cli.app import app
from llamactl.convert.meta import LAYER_TENSORS, unpermute_rotary

runner = CliRunner()
needs_gguf = pytest.mark.skipif(find_spec("gguf") is None, reason="pip install -e '.[convert]'")
META_NAMES = {hf: meta for meta, (hf, _) in LAYER_TENSORS.items()}


def hf_state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state |= load_file(str(f))
    return state


def make_meta(hf: Path, out: Path, shards: int = 1, vocab_split: bool = False) -> Path:
    """A Meta-format release of the HF folder `hf`: q/k rows in the interleaved rotary order,
    tensors split across `shards` as Meta's model-parallel code splits them."""
    cfg = json.loads((hf / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    src = hf_state(hf)
    meta: dict[str, tuple[torch.Tensor, int | None]] = {
        "tok_embeddings.weight": (src["model.embed_tokens.weight"], 0 if vocab_split else 1),
        "norm.weight": (src["model.norm.weight"], None),
        "output.weight": (src.get("lm_head.weight", src["model.embed_tokens.weight"]), 0)}
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, meta_name in META_NAMES.items():
            t = src[f"model.layers.{i}.{hf_name}"]
            if "q_proj" in hf_name:
                t = unpermute_rotary(t, heads)
            elif "k_proj" in hf_name:
                t = unpermute_rotary(t, kv)
            meta[f"layers.{i}.{meta_name}"] = (t, LAYER_TENSORS[meta_name][1])
    out.mkdir(parents=True)
    for s in range(shards):
        part = {k: (t if d is None else t.chunk(shards, dim=d)[s]).clone() for k, (t, d) in meta.items()}
        torch.save(part, out / f"consolidated.{s:02d}.pth")
    (out / "params.json").write_text(json.dumps({
        "dim": cfg["hidden_size"], "n_layers": cfg["num_hidden_layers"], "n_heads": heads, "n_kv_heads": kv,
        "vocab_size": cfg["vocab_size"], "multiple_of": 256, "norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg.get("rope_theta", 10000.0)}))
    return out


def meta_reference_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits [S, V] of Meta's reference LLaMA (its model.py, float32, complex rotary on
    interleaved pairs) on an unsharded release: the layout the conversion must reproduce."""
    p = json.loads((folder / "params.json").read_text())
    w = {k: v.float() for k, v in torch.load(folder / "consolidated.00.pth", weights_only=True).items()}
    dim, heads, kv, eps = p["dim"], p["n_heads"], p["n_kv_heads"], p["norm_eps"]
    hd, s = dim // heads, ids.numel()
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    cis = torch.polar(torch.ones(s, hd // 2), torch.outer(torch.arange(s).float(), freqs))  # [S, hd/2]

    def norm(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    def rotary(x):  # [S, H, hd], pairs (2i, 2i+1) as complex numbers
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * cis[:, None, :]).flatten(-2)

    h = w["tok_embeddings.weight"][ids]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for i in range(p["n_layers"]):
        L = lambda n: w[f"layers.{i}.{n}"]  # noqa: E731
        x = norm(h, L("attention_norm.weight"))
        q = rotary((x @ L("attention.wq.weight").t()).view(s, heads, hd))
        k = rotary((x @ L("attention.wk.weight").t()).view(s, kv, hd)).repeat_interleave(heads // kv, dim=1)
        v = (x @ L("attention.wv.weight").t()).view(s, kv, hd).repeat_interleave(heads // kv, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask, dim=-1)
        h = h + torch.einsum("hqk,khd->qhd", att, v).reshape(s, dim) @ L("attention.wo.weight").t()
        x = norm(h, L("ffn_norm.weight"))
        ff = torch.nn.functional.silu(x @ L("feed_forward.w1.weight").t()) * (x @ L("feed_forward.w3.weight").t())
        h = h + ff @ L("feed_forward.w2.weight").t()
    return norm(h, w["norm.weight"]) @ w["output.weight"].t()


def llamactl_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.load import load_model

    model = load_model(open_artifact(folder), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        return model(ids.view(1, -1), torch.arange(ids.numel()))[0].float()


def convert(*args) -> object:
    return runner.invoke(app, ["convert", *map(str, args)])


def refused(r, *fragments) -> None:
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for f in fragments:
        assert f in r.stderr, r.stderr


@pytest.fixture(scope="module")
def gqa(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("gqa"), hidden=64, heads=4, kv_heads=2, layers=2, seed=11)


@pytest.mark.parametrize("shards,vocab_split", [(1, False), (2, False), (2, True)])
def test_meta_checkpoint_to_hf_is_exact(gqa, tmp_path, shards, vocab_split):
    """One and two shards (embedding split on the model dim as Llama 2, on the vocabulary as
    Llama 3): the same tensors as the HF model they came from, the manifest hashes the source."""
    meta = make_meta(gqa, tmp_path / "meta", shards, vocab_split)
    out = tmp_path / "hf"
    r = convert(meta, "-o", out, "--allow-pickle", "--tokenizer", gqa, "--json")
    assert r.exit_code == 0, r.output
    a, b = hf_state(gqa), hf_state(out)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    man = json.loads((out / "llamactl.json").read_text())
    assert man["stage"] == "convert" and man["params"]["source"]["kind"] == "meta"
    assert set(man["params"]["source"]["sha256"]) == {"params.json"} | {f"consolidated.{i:02d}.pth" for i in range(shards)}
    assert man["params"]["shards"] == shards and "context length 4096" in r.stderr
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2


def test_meta_conversion_matches_the_reference_implementation(tmp_path):
    """The trained model as a Meta release: llamactl's logits on the converted folder equal
    Meta's reference forward (interleaved rotary) on the original tensors."""
    meta = make_meta(trained_model_path(), tmp_path / "meta")
    out = tmp_path / "hf"
    assert convert(meta, "-o", out, "--allow-pickle", "--tokenizer", trained_model_path(), "--context", "2048").exit_code == 0
    ids = torch.tensor([1, 450, 848, 338, 263, 2323, 310, 278, 1208, 2989, 13, 13, 450])
    ref, got = meta_reference_logits(meta, ids), llamactl_logits(out, ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    g = runner.invoke(app, ["generate", str(out), "-p", "The kernel", "-n", "6", "--temperature", "0", "--json"])
    e = runner.invoke(app, ["generate", str(trained_model_path()), "-p", "The kernel", "-n", "6", "--temperature", "0", "--json"])
    assert json.loads(g.stdout)["token_ids"] == json.loads(e.stdout)["token_ids"]


def test_sentencepiece_tokenizer_model(gqa, tmp_path):
    """Llama 1/2's SentencePiece tokenizer.model becomes a tokenizer.json with the same ids and BOS."""
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((Path(__file__).resolve().parents[2] / "llamactl" / "assets" / "docs-eval.txt").read_text()[:200_000])
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=500, model_type="bpe",
                                   byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)  # as Llama 2's
    meta = make_meta(gqa, tmp_path / "meta")
    (meta / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    out = tmp_path / "hf"
    r = convert(meta, "-o", out, "--allow-pickle")
    assert r.exit_code == 0, r.output
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    for s in ("The kernel schedules tasks.", "  two  spaces, ünïcode and 123"):
        assert tok(s).input_ids == [1] + sp.encode(s)


def test_tiktoken_tokenizer_model(tmp_path):
    """Llama 3's tiktoken tokenizer.model: the converted tokenizer encodes as tiktoken does, with
    <|begin_of_text|> first and the 256 special tokens after the ordinary ones."""
    tiktoken = pytest.importorskip("tiktoken")
    import base64

    from llamactl.convert.tokenizer import LLAMA3_SPECIAL, convert_meta_tokenizer

    pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ranks = {bytes([i]): i for i in range(256)}
    for piece in (b"th", b"the", b" the", b"er", b"ke", b"ker", b"kern", b"kernel", b" kernel", b"in", b"ing"):
        ranks[piece] = len(ranks)
    model = tmp_path / "tokenizer.model"
    model.write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    info = convert_meta_tokenizer(model, tmp_path, vocab_size=len(ranks) + len(LLAMA3_SPECIAL), context=8192)
    assert info == {"kind": "tiktoken", "tokens": len(ranks) + len(LLAMA3_SPECIAL)}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    enc = tiktoken.Encoding("t", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    for s in ("the kernel is thinking", "Other kernels: 12345!"):
        assert tok(s).input_ids == [len(ranks)] + enc.encode(s)
    assert tok.convert_tokens_to_ids("<|eot_id|>") == len(ranks) + 9


def test_meta_bad_inputs(gqa, tmp_path):
    meta = make_meta(gqa, tmp_path / "meta", shards=2)
    out = tmp_path / "o"
    refused(convert(meta, "-o", out, "--tokenizer", gqa), "pickled weights", "--allow-pickle")
    refused(convert(meta, "-o", out, "--allow-pickle"), "no tokenizer.model", "--tokenizer")
    broken = tmp_path / "broken-tok"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')  # not a tokenizer
    ctx = ("--context", "256")  # (else a note on the context comes first)
    refused(convert(meta, "-o", out, "--allow-pickle", *ctx, "--tokenizer", broken), "its tokenizer does not load")
    from llamactl.convert.tokenizer import copy_hf_tokenizer
    from llamactl.errors import CheckpointError

    (tmp_path / "small").mkdir()
    with pytest.raises(CheckpointError, match="has 8192 tokens but the model's embedding has 100 rows"):
        copy_hf_tokenizer(trained_model_path(), tmp_path / "small", 100)
    (meta / "consolidated.01.pth").rename(meta / "consolidated.02.pth")
    refused(convert(meta, "-o", out, "--allow-pickle", "--tokenizer", gqa), "numbered [0, 2]")
    (meta / "consolidated.02.pth").rename(meta / "consolidated.01.pth")
    params = json.loads((meta / "params.json").read_text())
    (meta / "params.json").write_text(json.dumps({**params, "n_heads": "four"}))
    refused(convert(meta, "-o", out, "--allow-pickle", "--tokenizer", gqa), "n_heads is 'four'")
    (meta / "params.json").write_text(json.dumps({k: v for k, v in params.items() if k != "dim"}))
    refused(convert(meta, "-o", out, "--allow-pickle", "--tokenizer", gqa), "dim is missing")
    (meta / "params.json").write_text(json.dumps({**params, "n_layers": 10**9}))  # no set of 10^9 names is built
    refused(convert(meta, "-o", out, "--allow-pickle", "--tokenizer", gqa), "n_layers is 1000000000")
    (meta / "params.json").write_text(json.dumps(params))
    shard = meta / "consolidated.01.pth"
    shard.rename(tmp_path / "away.pth")
    for make, what in ((lambda: os.mkfifo(shard), "a FIFO"), (lambda: shard.mkdir(), "a folder"),
                       (lambda: shard.symlink_to(tmp_path / "away.pth"), "links outside the model folder")):
        make()
        refused(convert(meta, "-o", out, "--allow-pickle", "--tokenizer", gqa), what)  # not a hang, not a traceback
        shard.rmdir() if shard.is_dir() and not shard.is_symlink() else shard.unlink()
    (tmp_path / "away.pth").rename(shard)
    sd = torch.load(meta / "consolidated.01.pth", weights_only=True)
    sd["layers.0.attention.wo.weight"] = sd["layers.0.attention.wo.weight"][:, :8].clone()
    torch.save(sd, meta / "consolidated.01.pth")
    refused(convert(meta, "-o", out, "--allow-pickle", "--tokenizer", gqa), "layers.0.attention.wo.weight has shapes")
    torch.save({"model": {"x": torch.ones(1)}, "step": 3}, meta / "consolidated.01.pth")
    refused(convert(meta, "-o", out, "--allow-pickle", "--tokenizer", gqa), "consolidated.01.pth", "plain dict of tensors")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]


@needs_gguf
def test_hf_to_gguf_and_back_is_exact(tmp_path):
    """16-bit: HF -> GGUF -> HF returns the same tensors and tokenizer."""
    src = trained_model_path()
    gguf_file = tmp_path / "m.gguf"
    r = convert(src, "-o", gguf_file, "--json")
    assert r.exit_code == 0, r.output
    facts = json.loads(r.stdout)["metrics"]
    assert facts["tensor_types"] == {"BF16": 2 + 7 * 6, "F32": 1 + 2 * 6} and facts["requantized_layers"] == 0
    back = tmp_path / "back"
    r = convert(gguf_file, "-o", back, "--json")
    assert r.exit_code == 0, r.output
    a, b = hf_state(src), hf_state(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoTokenizer

    t0, t1 = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(str(back))
    text = "The kernel <s> schedules\n\n  ünïcode 123 </s>"
    assert t0(text).input_ids == t1(text).input_ids and len(t1) == len(t0)
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    assert json.loads(reader.fields["llamactl.source"].contents())["kind"] == "hf"
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"


@needs_gguf
@pytest.mark.quant
@pytest.mark.skipif(find_spec("accelerate") is None, reason="transformers' GGUF loader needs accelerate (the bnb extra)")
def test_transformers_gguf_loader_reads_our_file(tmp_path):
    """transformers' own GGUF loader (from_pretrained(gguf_file=...)) gives the logits of the folder
    the file came from, exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = trained_model_path()
    assert convert(src, "-o", tmp_path / "m.gguf").exit_code == 0
    ids = torch.tensor([AutoTokenizer.from_pretrained(str(src))("The kernel <s> schedules\n\n  ünïcode 123").input_ids])
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)


@needs_gguf
@pytest.mark.parametrize("bits,sym,group,gguf_type", [(4, True, 32, "Q4_0"), (4, True, 128, "Q4_0"), (8, True, 32, "Q8_0")])
@pytest.mark.slow
def test_quantized_layers_travel_as_blocks_without_requantizing(tmp_path, bits, sym, group, gguf_type):
    """RTN groups that fit 32-weight blocks are written as Q4_0/Q8_0 code for code, and read back
    into the very same GPTQ tensors (groups of 32)."""
    from llamactl.layers.gptq import dequantize_gptq

    q = tmp_path / "q"
    args = ["quantize", str(trained_model_path()), "-o", str(q), "--method", "rtn", "--bits", str(bits),
            "--group-size", str(group), "--eval-tokens", "0"] + ([] if sym else ["--asym"])
    assert runner.invoke(app, args).exit_code == 0
    r = convert(q, "-o", tmp_path / "q.gguf", "--json")
    facts = json.loads(r.stdout)["metrics"]
    assert facts["tensor_types"][gguf_type] == 42 and facts["exact_layers"] == 42 and facts["requantized_layers"] == 0
    back = tmp_path / "back"
    r = convert(tmp_path / "q.gguf", "-o", back, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["params"]["kept_quantized"] == gguf_type
    a, b = hf_state(q), hf_state(back)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.5.mlp.down_proj"):
        wa = dequantize_gptq(*(a[f"{name}.{k}"] for k in ("qweight", "qzeros")), a[f"{name}.scales"].float(), a[f"{name}.g_idx"], bits)
        wb = dequantize_gptq(*(b[f"{name}.{k}"] for k in ("qweight", "qzeros")), b[f"{name}.scales"].float(), b[f"{name}.g_idx"], bits)
        assert torch.equal(wa, wb)
    if group == 32:
        assert all(torch.equal(a[k], b[k]) for k in a if k.endswith((".qweight", ".qzeros", ".scales")))
    cfg = json.loads((back / "config.json").read_text())["quantization_config"]
    assert (cfg["bits"], cfg["group_size"], cfg["sym"]) == (bits, 32, True)


@needs_gguf
def test_asymmetric_and_act_order_layers(tmp_path):
    """Asymmetric groups become Q4_1 (offsets rounded to fp16: the weights move by < 1% of a
    step); --type q4_0 requantizes them and the added KL is measured and printed."""
    from gguf import GGUFReader, quants

    q = tmp_path / "q"
    assert runner.invoke(app, ["quantize", str(trained_model_path()), "-o", str(q), "--method", "rtn", "--asym",
                               "--eval-tokens", "0"]).exit_code == 0
    r = convert(q, "-o", tmp_path / "a.gguf", "--json")
    facts = json.loads(r.stdout)["metrics"]
    assert facts["tensor_types"]["Q4_1"] == 42 and facts["q4_1_offsets_rounded_to_fp16"]
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.load import load_model

    lin = load_model(open_artifact(q), torch.device("cpu"), torch.float32).model.layers[0].mlp.down_proj
    t = next(t for t in GGUFReader(str(tmp_path / "a.gguf")).tensors if t.name == "blk.0.ffn_down.weight")
    got = torch.from_numpy(quants.dequantize(t.data, t.tensor_type))
    want = lin.dequantized(torch.float32)
    step = lin.scales.float().max().item()
    assert (got - want).abs().max().item() < 1e-2 * step  # measured 0.3% of a step
    r = convert(q, "-o", tmp_path / "b.gguf", "--type", "q4_0", "--eval-tokens", "512")
    assert r.exit_code == 0, r.output
    assert "42 layers requantized to q4_0" in r.stderr and "added KL" in r.stdout


def _set_u32(data: bytes, key: str, value: int) -> bytes:
    """A GGUF file's bytes with metadata `key` (a uint32) set to value."""
    import struct

    name = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(name) + len(name)
    assert struct.unpack("<I", data[at : at + 4])[0] == 4  # GGUF's UINT32 type
    return data[: at + 4] + struct.pack("<I", value) + data[at + 8 :]


def _shift_offset(data: bytes, tensor: str, by: int) -> bytes:
    """A GGUF file's bytes with tensor's data offset (in its header entry) moved by `by` bytes."""
    import struct

    name = struct.pack("<Q", len(tensor)) + tensor.encode()
    at = data.index(name) + len(name)
    dims = struct.unpack("<I", data[at : at + 4])[0]
    at += 4 + 8 * dims + 4  # n_dims, dims, type: then the offset
    offset = struct.unpack("<Q", data[at : at + 8])[0]
    return data[:at] + struct.pack("<Q", offset + by) + data[at + 8 :]


@needs_gguf
def test_gguf_bad_inputs(tmp_path):
    src = trained_model_path()
    good = tmp_path / "m.gguf"
    assert convert(src, "-o", good).exit_code == 0
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 3])
    refused(convert(cut, "-o", tmp_path / "o"), "cut.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + data[4:1000])
    refused(convert(fake, "-o", tmp_path / "o"), "magic")
    for key, value, says in (("llama.block_count", 10**9, "block_count is 1000000000, the file holds"),
                             ("llama.attention.head_count", 0, "not a positive count"),
                             ("llama.attention.head_count", 3, "do not split")):
        bad = tmp_path / "header.gguf"
        bad.write_bytes(_set_u32(data, key, value))  # counts in the header are checked, not trusted
        refused(convert(bad, "-o", tmp_path / "o"), says)
    bad = tmp_path / "offset.gguf"
    bad.write_bytes(_shift_offset(data, "blk.0.attn_q.weight", 2))  # it would read its neighbour's bytes
    refused(convert(bad, "-o", tmp_path / "o"), "not a multiple of the file's alignment")
    bad.write_bytes(_shift_offset(data, "blk.0.attn_q.weight", 32))
    refused(convert(bad, "-o", tmp_path / "o"), "overlaps the tensor before it")
    import gguf

    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    refused(convert(other, "-o", tmp_path / "o"), "architecture 'gpt2' is not supported")
    notes = tmp_path / "notes.gguf"
    notes.write_text("my notes")
    refused(convert(src, "-o", notes, "--force"), "is not a GGUF file")
    assert notes.read_text() == "my notes"
    refused(convert(src, "-o", good), "already exists", "--force")
    refused(convert(good, "-o", tmp_path / "x.gguf"), "converts to a Hugging Face folder first")
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@needs_gguf
def test_llama31_rope_scaling_survives_every_direction(tmp_path):
    """Llama 3.1's RoPE scaling: Meta's use_scaled_rope becomes rope_type llama3; GGUF carries it
    as llama.cpp's rope_freqs factors and reads back as the same config and logits."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf = make_hf_model(tmp_path / "hf", rope=rope, heads=4, kv_heads=2, seed=4)
    meta = make_meta(hf, tmp_path / "meta")
    params = json.loads((meta / "params.json").read_text())
    (meta / "params.json").write_text(json.dumps({**params, "use_scaled_rope": True, "rope_theta": 500000.0}))
    assert convert(meta, "-o", tmp_path / "m", "--allow-pickle", "--tokenizer", hf).exit_code == 0
    got = json.loads((tmp_path / "m" / "config.json").read_text())
    assert got["rope_parameters"] == rope and got["max_position_embeddings"] == 131072
    assert convert(hf, "-o", tmp_path / "r.gguf").exit_code == 0
    assert convert(tmp_path / "r.gguf", "-o", tmp_path / "back").exit_code == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"] == rope
    ids = torch.arange(2, 40)
    torch.testing.assert_close(llamactl_logits(tmp_path / "back", ids), llamactl_logits(hf, ids), rtol=0, atol=0)


@needs_gguf
def test_a_vocabulary_larger_than_the_tokenizer_is_padded(tmp_path):
    """An embedding with more rows than the tokenizer has tokens (vocabularies padded to a
    multiple, as many releases are): the GGUF lists a token per row, the extra ones unused."""
    import gguf

    src = make_hf_model(tmp_path / "wide", vocab=8256, seed=8)
    assert convert(src, "-o", tmp_path / "w.gguf").exit_code == 0
    r = gguf.GGUFReader(str(tmp_path / "w.gguf"))
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 8256
    types = r.fields["tokenizer.ggml.token_type"].contents()
    assert types[-1] == 5 and types[8191] != 5
    back = tmp_path / "back"
    assert convert(tmp_path / "w.gguf", "-o", back).exit_code == 0
    ids = torch.arange(5, 30)
    torch.testing.assert_close(llamactl_logits(back, ids), llamactl_logits(src, ids), rtol=0, atol=0)
