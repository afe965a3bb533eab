"""Fixtures: tiny random LLaMA folders in Hugging Face format, and the trained shared model."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # llamactl's Triton kernels run on the CPU through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llamactl.runtime.load import DEFAULT_MODEL

# Test modules share helpers across the package's folders (test_kernels' tolerances, test_serve's
# server): every folder of tests is importable by module name, whichever file pytest is given.
for _d in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and p.name != "__pycache__"):
    if str(_d) not in sys.path:
        sys.path.append(str(_d))

# the compile caches' signing key (llamactl.folder.signing.signing_key) of this test session, not the user's
if "LLAMACTL_TEST_CONFIG" not in os.environ:
    import atexit
    import tempfile

    _config = tempfile.mkdtemp(prefix="llamactl-config-")
    os.environ["LLAMACTL_TEST_CONFIG"] = os.environ["XDG_CONFIG_HOME"] = _config
    atexit.register(shutil.rmtree, _config, ignore_errors=True)  # the run's key goes with the run

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The trained model of ../shared/models; the embedded copy is the same files.
SHARED_MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "docs-llama-17m"


def greedy_alone(model, ids: torch.Tensor, n: int, mode: str = "eager") -> list[int]:
    """The first n greedy tokens after prompt ids [S], decoded at batch 1 (the reference a batched
    row must match)."""
    from llamactl.runtime.step import Decoder

    dec = Decoder(model, 1, max(40, ids.numel() + n + 1), mode)  # the batched tests' cache length
    tok, out = dec.prefill(ids.view(1, -1)), []
    for i in range(n):
        out.append(int(tok))
        tok = dec.step(tok, ids.numel() + i)
    return out


class GraphStandIn:
    """A CUDA graph's stand-in on the CPU (runtime.graphs.capture's signature, for monkeypatching):
    the capture's three warm-up runs, then replay() runs the captured function again into the
    tensor its capture returned, with the host's choices a graph freezes (the sampler's flags,
    read from `rows`, a RowSampling) as they were at the capture."""

    FLAGS = ("adjusted", "logprobs", "masked", "greedy")

    def __init__(self, rows):
        self.rows = rows

    def __call__(self, fn, args, pool=None):
        for _ in range(3):  # graphs.capture's warm-up runs
            fn(*args)
        graph = _Replayed(fn, args, self)
        return graph, graph.out


class _Replayed:
    def __init__(self, fn, args, stand_in: GraphStandIn):
        self.fn, self.args, self.stand_in = fn, args, stand_in
        self.frozen = {k: getattr(stand_in.rows, k) for k in stand_in.FLAGS}
        self.out = fn(*args)

    def replay(self):
        rows = self.stand_in.rows
        now = {k: getattr(rows, k) for k in self.frozen}
        for k, v in self.frozen.items():
            setattr(rows, k, v)
        self.out.copy_(self.fn(*self.args))
        for k, v in now.items():
            setattr(rows, k, v)


def trained_model_path() -> Path:
    return SHARED_MODEL if SHARED_MODEL.is_dir() else DEFAULT_MODEL


def make_hf_model(folder: Path, *, kv_heads: int = 4, heads: int = 4, rope: dict | None = None,
                  tie: bool = False, max_pos: int = 256, seed: int = 0, shard_bytes: str | None = None,
                  hidden: int = 64, layers: int = 2, head_dim: int | None = None, vocab: int = 8192) -> Path:
    """Save a random LlamaForCausalLM with the embedded model's tokenizer (vocab 8192)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs = {}
    if rope is not None:
        kwargs["rope_parameters"] = rope
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=3, **kwargs)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # random init is tiny; widen it so logits differ visibly between positions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    save_kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(folder, **save_kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("tiny_gqa"), heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tiny_mha(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("tiny_mha"), heads=4, kv_heads=4, tie=True)


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory) -> Path:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return make_hf_model(tmp_path_factory.mktemp("tiny_llama3"), heads=4, kv_heads=1, rope=rope, max_pos=512)


@pytest.fixture(scope="session")
def trained_model() -> Path:
    return trained_model_path()


@pytest.fixture(scope="module")
def embedded():
    """(artifact, model, tokenizer) of the embedded trained model on the CPU in float32, a copy a
    module (the serving tests' engines set up its caches)."""
    from llamactl.runtime.load import load

    art, model, tok, _ = load(None, "cpu", "float32")
    return art, model, tok
