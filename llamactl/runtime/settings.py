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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0
