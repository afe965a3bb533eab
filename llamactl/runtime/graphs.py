"""Short prefills as CUDA graphs: whole prompts joining a server's batch, without their launches.

A short prefill is hundreds of eager PyTorch ops whose host time exceeds their kernels' (measured
in docs/bench/README.md): it is bound by its launches, and is most of a lone request's time to its
first token, and of a small burst's.
So prompts that join at position 0 with at most `tokens` tokens in all are prefilled by replaying a
graph captured for a bucket of rows and a padded length: rows padded to a power of two (a padding
row repeats the last prompt: the same tokens written into the same slot, so the cache is as if
it were not there), lengths padded to the next of LENGTHS (padding past a prompt writes K/V at
positions that a later token overwrites before anything reads them). Longer prefills are bound by
the GPU's arithmetic, where launches hide behind the kernels, and stay eager.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from llamactl.errors import first_line
from llamactl.runtime.transfer import copy_in

# Padded prompt lengths (tokens): every 64 up to 256, then every half power of two. The padding is
# arithmetic done for nothing, cheap while a prefill is bound by its launches.
LENGTHS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
GRAPH_TOKENS = 2048  # rows x padded length of the largest captured prefill


@functools.lru_cache(maxsize=None)
def capture_stream(device: int) -> torch.cuda.Stream:
    """The one side stream every capture on a device runs on. The caching allocator hands a
    freed block only to allocations on the stream that freed it, so graphs sharing a pool but
    captured on streams of their own reuse none of each other's memory: a llama3-8b server's 57
    graphs held 13.1 GiB of an H100 that way (docs/decisions/2026-12-06-paged-cache.md; PyTorch's
    CUDA graph trees keep one stream per pool for the same reason)."""
    return torch.cuda.Stream(device=device)


def capture(fn: Callable[..., object], args: tuple, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn(*args) captured in a CUDA graph after three runs on the stream that captures it
    (compiles, library plans, handles and workspaces happen there, not in the graph); returns the
    graph and fn's output, whose memory the graph's replays rewrite. pool: another graph's memory
    pool, shared: what one capture freed, a later one reuses (one stream for all). Raises
    RuntimeError where the capture failed."""
    stream = capture_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):  # synchronizes first
        out = fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def replay_seconds(fns: list[Callable[[], object]], replays: int = 12) -> float:
    """Median seconds of one call of fns, all captured in one CUDA graph (after a warm call of
    each) and the graph replayed `replays` times: what the probes time (scripts/*_probe.py), each
    fn one copy of the inputs, so that enough copies keep L2 from serving them."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


class PrefillGraphs:
    """Graphs of forward(ids [K, S], slots [K], valid [K]) -> (tokens [K], finite []) for K rows of
    whole prompts (at positions 0..S-1) written into cache rows `slots`, one per (K, S) bucket,
    captured on first use (or by capture_all)."""

    def __init__(self, forward: Callable, max_rows: int, max_seq: int, device: torch.device,
                 tokens: int = GRAPH_TOKENS, pool=None, capture=capture):
        """forward: the eager prefill (the Decoder's); max_rows: the most prompts joining at once
        (the cache's rows); tokens: the most rows x padded length captured; pool: the memory pool
        to share (the decode graphs'); capture: how a graph is made (`capture`, or the CPU tests'
        eager stand-in)."""
        self.forward, self.device, self.tokens, self._pool = forward, device, tokens, pool
        self.max_rows = max_rows
        self._capture = capture
        self.rows = [1 << i for i in range(max(max_rows, 1).bit_length() + 1) if 1 << i < 2 * max_rows]
        self.lengths = [s for s in LENGTHS if s <= max_seq]
        # (K, S) -> static input [K, S + 2] (ids, then the slot and the valid length of each row),
        # graph, its outputs
        self._graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.CUDAGraph, tuple]] = {}
        self.failed: dict[tuple[int, int], str] = {}  # buckets whose capture failed (eager), and why

    def bucket(self, k: int, s: int) -> tuple[int, int] | None:
        """The (rows, length) graph that takes k prompts padded to s tokens, or None (eager)."""
        kb = next((r for r in self.rows if r >= k), None)
        sb = next((n for n in self.lengths if n >= s), None)
        if kb is None or sb is None or kb * sb > self.tokens or (kb, sb) in self.failed:
            return None
        return kb, sb

    def shapes(self) -> list[tuple[int, int]]:
        """Every bucket, the shortest first."""
        return [(k, s) for s in self.lengths for k in self.rows if k * s <= self.tokens]

    def capture_all(self) -> int:
        """Capture every bucket now (into the cache's rows, which must be free: a bucket of more
        rows than the cache has writes the last one again); returns how many are captured."""
        for k, s in self.shapes():
            if (k, s) not in self._graphs and (k, s) not in self.failed:
                self.run(torch.zeros(k, s, dtype=torch.long), [min(i, self.max_rows - 1) for i in range(k)], [s] * k)
        return len(self._graphs)

    def run(self, ids: torch.Tensor, slots: list[int], valid: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: [k, s] (a bucket must take it: see bucket) -> tokens [k], finite []: views of the
        graph's outputs, valid until its next replay."""
        k, s = ids.shape
        kb, sb = self.bucket(k, s)
        host = torch.zeros(kb, sb + 2, dtype=torch.long)  # [K, S + 2]: ids, slot, valid
        host[:k, :s] = ids.cpu()
        host[k:, :s] = host[k - 1, :s]  # padding rows repeat the last prompt, into its slot
        host[:, sb] = torch.tensor(slots + [slots[-1]] * (kb - k))
        host[:, sb + 1] = torch.tensor(valid + [valid[-1]] * (kb - k))
        if (kb, sb) not in self._graphs:
            static = host.to(self.device)
            try:
                graph, out = self._capture(self._forward, (static, sb), self._pool)
            except RuntimeError as e:  # this bucket prefills eagerly from now on; `failed` says why
                self.failed[(kb, sb)] = first_line(e)
                tokens, finite = self._forward(static, sb)
                return tokens[:k], finite
            self._graphs[(kb, sb)] = (static, graph, out)
        static, graph, (tokens, finite) = self._graphs[(kb, sb)]
        copy_in(static, host)
        graph.replay()
        return tokens[:k], finite

    def _forward(self, inp: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        # inp: [K, S + 2] -> ids [K, S], slots [K], valid [K]
        return self.forward(inp[:, :s], inp[:, s], inp[:, s + 1])

    def __len__(self) -> int:
        return len(self._graphs)

    def summary(self) -> str:
        """For the serving line: how many graphs, and the buckets left eager after a failed capture."""
        failed = "".join(f"; {k} x {s} eager ({why})" for (k, s), why in self.failed.items())
        return f"{len(self)} prefill graphs{failed}"
