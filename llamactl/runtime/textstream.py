"""Token ids -> text pieces as they are generated, for `generate` and the server's streams."""

from __future__ import annotations


class TextStream:
    """Decodes each new token beside the few before it (a constant cost a token, where decoding all
    the tokens since some point, as transformers' TextStreamer does, grows with the output on the
    server's thread: docs/bench/README.md), holds back a partial UTF-8 character, and with stop
    strings holds back text that may be the start of one and ends the text before the first.

    The new text is decode(ids[prefix:]) minus decode(ids[prefix:read]): both begin at the same
    token, so what a tokenizer does at the start of a decode (SentencePiece drops a word's leading
    space there) cancels out; prefix and read move up once a token's text is complete (as TGI's
    and vLLM's incremental detokenizers do)."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of text handed out
        self.stopped = False  # a stop string was found: add() returns nothing more
        self._prefix, self._read = 0, 0  # ids[prefix:read]: the context of the next decode, in text already

    def add(self, token_id: int) -> str:
        """One more token -> the text that can be handed out now (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # (else: a character still partial)
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(hold=True)

    def finish(self) -> str:
        """The text still held back, after decoding all tokens at once (which may differ at the end
        from the piecewise decode, e.g. a final partial character)."""
        if not self.stopped:
            final = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if final != self.text and final.startswith(self.text):
                self.text = final
        return self._release(hold=False)

    def _release(self, hold: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:  # a stop string cannot start before `sent`: text that could begin one is held back
            self.stopped = True
            self.text = self.text[: min(hits)]
        end = len(self.text)
        if hold and not self.stopped:
            end -= max((k for s in self.stop for k in range(min(len(s) - 1, end - self.sent), 0, -1)
                        if s.startswith(self.text[end - k:])), default=0)
        out, self.sent = self.text[self.sent:end], end
        return out
