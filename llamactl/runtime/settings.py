"""How a token is drawn: one settings type for `generate`, a server's requests and the rows of a
batch (runtime.sampling.RowSampling holds them as tensors). No torch here: the scheduler holds
these and imports none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy; top_k 0: off; top_p 1: off; seed None: a fresh one (the defaults are
    OpenAI's; `llamactl generate` passes its own temperature, 0.8)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # a server's (runtime.sampling.RowSampling applies them; generate does not take them): OpenAI's
    # presence and frequency penalties over the tokens generated so far, vLLM's repetition penalty
    # over the prompt's and those (1: off; logits of seen tokens divided by it where positive,
    # multiplied where negative), a bias added to the logits of token ids, and vLLM's min_tokens
    # (the stop tokens cannot be drawn before that many tokens)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, a bias or min_tokens change the logits before the draw."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)
