"""Token ids -> text pieces as they are generated, for `generate` and the server's streams."""

from __future__ import annotations


class TextStream:
    """Decodes only the tokens since the last newline (not the whole output every token, as
    transformers' TextStreamer does), holds back a partial UTF-8 character, and with stop
    strings holds back text that may be the start of one and ends the text before the first."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of text handed out
        self.stopped = False  # a stop string was found: add() returns nothing more
        self._seg_start, self._seg_text = 0, ""  # tokens since the last newline, and their text

    def add(self, token_id: int) -> str:
        """One more token -> the text that can be handed out now (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        seg = self.tokenizer.decode(self.ids[self._seg_start:], skip_special_tokens=True)
        if not seg.endswith("\ufffd"):
            delta = seg[len(self._seg_text):]
            if delta:
                self._seg_text = seg
                self.text += delta
                if seg.endswith("\n"):
                    self._seg_start, self._seg_text = len(self.ids), ""
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
