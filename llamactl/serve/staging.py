"""Host buffers between the serving engine's step loop and the device: each decode step's
positions go in and its tokens come out through pinned buffers on a GPU, copied without a stream
sync, so the loop can launch a step before it reads the last one's tokens (serve.engine)."""

from __future__ import annotations

import torch

from llamactl.runtime.sampling import snapshot_rows
from llamactl.runtime.transfer import to_device


class Launched:
    """A decode step in flight: its requests (serve.plan.Request; request i at batch row
    at[i]), its tokens on their way to the host."""

    def __init__(self, rows: list, at: list[int], host: torch.Tensor, ready: "torch.cuda.Event | None",
                 launched: float, mixed: bool = False, lp: tuple | None = None):
        self.rows, self.at, self._host, self._ready, self.launched = rows, at, host, ready, launched
        self.mixed = mixed  # carried by a prefill forward
        self.lp = lp  # the step's log-probabilities (copies on the device: token [b], ids and values [b, K]), if recorded

    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """Each of the step's rows' (token log-probability, [(id, log-probability)] of its K
        likeliest), read after tokens(); None where the step recorded none."""
        return None if self.lp is None else snapshot_rows(self.lp, self.lp[1].shape[1])

    def tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()  # (without the GIL)
        return self._host.tolist()


class _Ring:
    """RING host buffers of max_batch int64s, pinned on a GPU; one is handed out again only after
    the copy that last used it has run (its event), so the host may run a step ahead."""

    RING = 2

    def __init__(self, max_batch: int, gpu: bool):
        self.gpu = gpu
        self._bufs = [torch.zeros(max_batch, dtype=torch.long, pin_memory=gpu) for _ in range(self.RING)]
        self._done: list["torch.cuda.Event | None"] = [None] * self.RING
        self._i = 0

    def take(self, n: int) -> tuple[int, torch.Tensor]:
        """(its index, the next buffer's first n), once its last copy has run."""
        i, self._i = self._i, (self._i + 1) % self.RING
        if self._done[i] is not None:
            self._done[i].synchronize()
        return i, self._bufs[i][:n]

    def copied(self, i: int) -> "torch.cuda.Event | None":
        """Mark buffer i's copy as queued now (on a GPU: its event, returned)."""
        if not self.gpu:
            return None
        ev = torch.cuda.Event()
        ev.record()
        self._done[i] = ev
        return ev


class Staging:
    """The decode step's positions in (runtime.transfer: pinned, no stream sync) and its tokens
    out, through a _Ring of pinned host buffers on a GPU."""

    def __init__(self, max_batch: int, device: torch.device):
        self.device, self.gpu = device, device.type == "cuda"
        self._tok = _Ring(max_batch, self.gpu)

    def positions(self, pos: list[int]) -> torch.Tensor:
        """pos -> [len(pos)] on the device."""
        return to_device(pos, self.device, torch.long)

    def read_later(self, out: torch.Tensor, rows: list, at: list[int], launched: float,
                   mixed: bool = False, lp: tuple | None = None) -> Launched:
        """Start copying a step's tokens out [b] to the host; Launched.tokens() reads them (and
        Launched.logprobs() lp, device copies of its log-probabilities, where recorded)."""
        i, host = self._tok.take(out.numel())
        host.copy_(out, non_blocking=self.gpu)
        return Launched(rows, at, host, self._tok.copied(i), launched, mixed, lp)
