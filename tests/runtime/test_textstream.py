"""TextStream: token ids -> text pieces as they are generated, each piece decoded beside the few
tokens before it; the pieces add up to the whole output's decode, for a byte-level BPE tokenizer
(the embedded model's) and a SentencePiece-style one (Llama 2's layout: Metaspace pieces, byte
fallback, the leading space dropped at the start of a decode)."""

from __future__ import annotations

import json
import random

import pytest

TEXTS = ["Café naïve 中文 🙂 done.\n  indented\tTab and a long line of words " * 3,
         " leading space, then ,,, punctuation... and don't stop\n\n\nnewlines",
         "ÿ Ω ≈ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — \u00a0non-breaking"]


def sentencepiece_style():
    """A small Llama-2-style tokenizer built here: BPE over Metaspace pieces with byte fallback
    (<0x00>..<0xFF>), decoded as Llama's: ▁ -> space, bytes joined, one leading space stripped."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the cat sat on the mat", "a quick brown fox jumps over the lazy dog", "don't stop, then go"] * 20
    tk = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    data = json.loads(tk.to_str())["model"]
    vocab = dict(data["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in data["merges"]]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tk.model = models.BPE(vocab=vocab, merges=merges, unk_token=None, byte_fallback=True)
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.pre_tokenizer = None
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece-style"])
def tokenizer(request):
    if request.param == "byte-level":
        from llamactl.runtime.load import load

        return load(None, "cpu", "float32")[2]
    return sentencepiece_style()


def streamed(tok, ids: list[int]) -> tuple[str, str]:
    from llamactl.runtime.textstream import TextStream

    s = TextStream(tok)
    pieces = "".join(s.add(i) for i in ids)
    return pieces, pieces + s.finish()


@pytest.mark.parametrize("text", TEXTS)
def test_the_pieces_add_up_to_the_whole_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    pieces, done = streamed(tokenizer, ids)
    assert pieces == whole and done == whole
    assert "\ufffd" not in pieces  # a character split over tokens waits for its last byte


def test_random_ids_too(tokenizer):
    """Random ids (special ones skipped): the pieces are the whole decode's start, and finish()
    gives the rest. Not byte-fallback ids: bytes that make no character (what only a random model
    emits) are grouped into U+FFFD by the whole decode as no piece-by-piece decode can know."""
    rng = random.Random(0)
    ids_ok = [i for t, i in tokenizer.get_vocab().items() if not t.startswith("<0x")]
    for _ in range(20):
        ids = [rng.choice(ids_ok) for _ in range(rng.randrange(1, 60))]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        pieces, done = streamed(tokenizer, ids)
        assert whole.startswith(pieces) and done == whole


def test_text_stream_holds_back_a_stop_string_and_cuts_before_it():
    from llamactl.runtime.textstream import TextStream

    class Chars:  # one character a token
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    s = TextStream(Chars(), ["END", "\n\n"])
    out = "".join(s.add(ord(c)) for c in "abc EN")
    assert out == "abc " and not s.stopped  # "EN" may begin END: held back
    out += "".join(s.add(ord(c)) for c in "D more")
    assert out == "abc " and s.stopped and s.text == "abc "
    s = TextStream(Chars(), ["END"])
    assert "".join(s.add(ord(c)) for c in "xEN") + s.finish() == "xEN"  # the end releases what was held
