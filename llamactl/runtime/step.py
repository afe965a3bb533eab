"""Fixed-shape prefill and decode steps, run eagerly, captured in a CUDA graph, or compiled.

The decode step takes a token [B, 1] and a position [1] (every row at the same position), or
positions [B, 1] (each row at its own: sequences of different lengths in one batch; llamactl's
decode attention then reads each row's cache to its own length), and returns
the next token [B] on the device, so no value crosses to the host between steps. A prefill may
write one sequence into one row of the cache (`slot`) while the other rows keep theirs. Modes:
  eager    plain PyTorch (CPU or GPU)
  graphs   the eager step captured once in a torch.cuda.CUDAGraph and replayed (GPU)
  compile  torch.compile (inductor, default mode) of the step, then captured in a CUDA
           graph the same way (GPU); on the CPU, compiled without graphs
  aot      the greedy step of one shape compiled ahead of time by AOTInductor (CPU): one C++
           call a step, no Python or Dynamo (llamactl.runtime.aot); prefill stays eager
"""

from __future__ import annotations

from typing import Callable

import torch

from llamactl.errors import InputError, first_line
from llamactl.layers.plan import prepare, unfold_cache_writes
from llamactl.options import RuntimeOptions
from llamactl.runtime import kv_format
from llamactl.runtime.aot import AotStep
from llamactl.runtime.graphs import PrefillGraphs, capture
from llamactl.runtime.kv_cache import StaticCache
from llamactl.runtime.ragged import TILE, Ragged, uniform
from llamactl.runtime.sampling import TOP_LOGPROBS, RowSampling
from llamactl.runtime.transfer import lists_to_device, to_device

MODES = ("eager", "graphs", "compile", "aot")


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a host clock read after it is meaningful."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_backend(model, batch: int, max_seq: int, device: torch.device) -> str:
    """Which SDPA kernel PyTorch's dispatcher picks for the decode step's shapes."""
    a = model.args
    q = torch.zeros(batch, a.num_attention_heads, 1, a.head_dim, device=device, dtype=model.dtype)
    k = torch.zeros(batch, a.num_key_value_heads, max(max_seq, 1), a.head_dim, device=device, dtype=model.dtype)
    mask = torch.ones(1, 1, 1, k.shape[2], device=device, dtype=torch.bool)
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    try:
        rep = a.num_attention_heads // a.num_key_value_heads  # the model folds GQA groups into query rows
        q = q.reshape(batch, a.num_key_value_heads, rep, a.head_dim)
        mask = mask.repeat(1, 1, rep, 1)
        choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, False)
        return f"sdpa:{names.get(int(choice), str(choice))}"
    except Exception:  # private API; absent or changed in this torch
        return "sdpa"


def compile_regions(device: torch.device, options: RuntimeOptions) -> bool:
    """Whether torch.compile traces one decoder layer and reuses it (model._layer_region):
    options.compile_regions, else never. Regions compile faster (a 30-layer CPU model: about
    a tenth of the time) but on CUDA decoded about 2% slower (docs/bench/README.md), and on the
    CPU they rule out Inductor's C++ wrapper, which decoded 1.3-1.6x faster (docs/bench/cpu.md)."""
    return False if options.compile_regions is None else options.compile_regions


def _inductor_options(compile_mode: str, llamactl_gemv: bool, dynamic_rows: bool = False,
                      cpp_wrapper: bool = False) -> dict:
    """Inductor's settings for this compile only (torch.compile's `options`; no global config):
    its own cudagraphs off (the whole step is captured once, by the Decoder), and its matrix-vector
    tuning only where llamactl's GEMVs do not run (with them Inductor generates a few small
    kernels, and the tuning cost seconds of every warm start). With a dynamic row count (a
    server's buckets) reductions are not split: Inductor (torch 2.11, CUDA) fails to generate the
    split scan of top-p's cumsum over the vocabulary for a symbolic row count ("list indices must
    be integers or slices, not NoneType"), which stopped llama2-7b's `serve --mode compile` (and
    the cumsum itself is a call, sampling.cumsum_last, as Inductor's split scan then failed too).
    cpp_wrapper: the step's kernels called from generated C++ rather than Python (a CPU step of
    one fixed shape: no Python between its kernels)."""
    opts = {"triton.cudagraphs": False, "coordinate_descent_tuning": not llamactl_gemv}
    if cpp_wrapper:
        opts["cpp_wrapper"] = True
        # (Dynamo's guards on such a step: Decoder._checked. Skipping the nn-module guards at
        # compile time, torch.compiler.skip_guard_on_all_nn_modules_unsafe, dropped the shape checks
        # a prefill of another length needs: "expected size 12==64" from a step compiled for 64 rows.)
    if dynamic_rows:
        opts["split_reductions"] = False
    if compile_mode == "max-autotune":
        opts["max_autotune"] = True
    return opts


class Decoder:
    """Prefill and greedy/sampled decode over a cache of its own (runtime.kv_cache.StaticCache:
    `batch` rows of `max_seq` positions), in one of MODES."""

    def __init__(self, model, batch: int, max_seq: int, mode: str = "eager",
                 sample: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 buckets: list[int] | None = None, compile_mode: str = "default",
                 options: RuntimeOptions | None = None, rows: "RowSampling | None" = None,
                 prefill_graphs: bool = False, cache=None):
        """sample: logits [B, V] -> tokens [B] with fixed shapes, drawing from the default generator
        (graph-safe; see generate.sample); None means greedy. buckets: cache lengths to round
        max_seq up to, so one compiled step serves many prompt lengths. options: what the step
        runs (llamactl's kernels where they run, else cuBLAS and SDPA); `plan` says what does.
        rows: sampling settings per row (llamactl.runtime.sampling.RowSampling), instead of `sample`.
        prefill_graphs: whole prompts of few tokens (a server's joins) replay CUDA graphs where
        steps do (llamactl.runtime.graphs). cache: the KV cache to run over (a server's
        runtime.kv_cache.PagedCache: its table rows are the batch rows), else a StaticCache of
        `batch` rows of max_seq made here."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {MODES}")
        if mode == "aot" and (model.device.type != "cpu" or sample is not None or rows is not None):
            raise InputError("the ahead-of-time step (--aot, --mode aot) is for greedy decoding on the CPU",
                             "pass --temperature 0, or use the compiled step (--compile, --mode compile) on a GPU, "
                             "with sampling or in a server")
        self.model, self.batch, self.mode = model, batch, mode
        self.device = model.device
        self.sample = sample or (lambda logits: logits.argmax(dim=-1))
        self.rows = rows
        if rows is not None:
            rows.prepare(model.args.vocab_size)
        self.options = options or RuntimeOptions()
        self.plan = prepare(model, self.options)
        fitting = [b for b in sorted(buckets or []) if b >= max_seq]
        self.max_seq = min(fitting[0] if fitting else max_seq, model.args.max_position_embeddings)
        self.max_seq = max(self.max_seq, max_seq)
        if cache is not None:
            self.max_seq = cache.max_seq
        if cache is None:  # the format options.kv_dtype names (runtime.kv_format)
            cache = StaticCache.for_model(model, batch, self.max_seq,
                                          fmt=kv_format.resolve(self.options.kv_dtype, model.dtype, model.device))
        self.cache = cache
        model.setup_positions(self.max_seq)
        self._step = self._eager_step
        # regions (torch's invoke_subgraph) fail on a dynamic row dimension (torch 2.13: KeyError
        # in stamp_out_subgraph), so a server's compiled step traces the whole model
        self.compile_regions = mode == "compile" and rows is None and compile_regions(self.device, self.options)
        for layer in model.model.layers:
            layer.compile_region = self.compile_regions
        if self.compile_regions:
            unfold_cache_writes(model)
        if mode == "compile":
            # a server's batch buckets (rows): one compile for every bucket of 2 rows or more, the
            # row dimension marked dynamic (_rows_dynamic), one for a lone row; else one shape, static
            self._step = torch.compile(self._eager_step, fullgraph=True, dynamic=None if rows is not None else False,
                                       options=_inductor_options(compile_mode, self.plan.kernels, rows is not None,
                                                                 self._cpp_wrapper(rows)))
        if mode == "aot":
            self._step = AotStep(model, self.cache)
        self.graph: torch.cuda.CUDAGraph | None = None
        # Sampling under compile + a graph of our own is unverified (Inductor's RNG seeds): compile only.
        self.use_graph = mode == "graphs" or (mode == "compile" and sample is None)
        self.use_graph = self.use_graph and self.device.type == "cuda"
        # per (kind of position ("shared": [1], "rows": [B, 1]), rows): static inputs, graph, static output
        self._graphs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graph else None  # every graph's memory
        self.verify_failed: dict[tuple[int, int], str] = {}  # (rows, width) of verify steps left eager, and why
        self.prefill_graphs = None
        if prefill_graphs and self.use_graph:
            self.prefill_graphs = PrefillGraphs(self._prefill_slots, batch, self.max_seq, self.device, pool=self._pool)
        # Kinds of step this Decoder has run compiled (guards checked). A compiled CPU step of one
        # shape runs its later calls of a kind without Dynamo's guards (they cost 2.3 ms of a
        # 30-layer step): torch.compiler.set_stance(skip_guard_eval_unsafe=True) then checks only
        # the guards that tell cache entries apart (another Decoder's shapes, another model), and
        # a kind's first call, with every guard, has made its entry.
        self._checked: set[tuple] = set()
        self._skip_guards = mode == "compile" and self.device.type == "cpu" and rows is None

    def _cpp_wrapper(self, rows) -> bool:
        """Inductor's C++ wrapper for a CPU step of one shape (not with regions: Inductor has no
        C++ wrapper for invoke_subgraph, torch 2.13)."""
        return self.device.type == "cpu" and rows is None and not self.compile_regions

    def _eager_step(self, tok: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        # tok: [B, 1], pos: [1] or [B, 1] -> next token [B]
        return self._draw(self._forward(tok, pos, kv_len), pos)

    def _forward(self, tok: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        # tok: [B, 1], pos: [1] or [B, 1] -> the logits after each row's token [B, V]
        if self.rows is not None:
            self.rows.count(tok.view(-1))  # (penalties: each row's newest generated token)
        return self.model(tok, pos, self.cache, kv_len=kv_len)[:, -1]

    def _draw(self, logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # logits [B, V] of rows at positions pos: [1] or [B, 1] -> each row's next token [B]
        if self.rows is None:
            return self.sample(logits)
        if self.rows.greedy:  # the host's word that no row samples: skip the draw (a graph of its own)
            return self.rows.argmax(logits)
        drawn_at = (pos.view(-1) + 1).expand(logits.shape[0])  # where each row's new token will sit
        return self.rows.sample(logits, drawn_at)

    @torch.inference_mode()
    def step_logits(self, tok: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """A decode step's forward alone, rows at their own positions: tok [B], pos [B] (on the
        device) -> the logits [B, V] that draw() samples (a graph's output: read before the next
        step). For a step whose draw waits on the host: a grammar's masks, made from the last
        step's tokens while this forward runs."""
        tok, pos = tok.view(-1, 1), pos.view(-1, 1)
        if not self.use_graph:
            return self._forward(tok, pos, kv_len if self.mode == "eager" else None)
        # a graph per batch bucket, and apart where count() runs (adjusted): captured or not
        kind = ("logits", tok.numel(), self.rows is not None and self.rows.adjusted)
        if kind not in self._graphs:
            self._capture(kind, tok, pos, self._forward)
        static_tok, static_pos, graph, out = self._graphs[kind]
        static_tok.copy_(tok)
        static_pos.copy_(pos)
        graph.replay()
        return out

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The draw of a step_logits forward at positions pos [B]: each row's next token [B] with
        the rows' settings and masks as they are now. Where steps are graphs, a graph too (per
        batch bucket, the sampler's flags and the forward's logits buffer, captured at first use):
        a grammar's step waits for its draw's launch, and each eager operator would let go of the
        GIL and wait for it again (docs/decisions/2026-12-07-api.md)."""
        if not self.use_graph:
            return self._draw(logits, pos.view(-1, 1))
        flags = (() if self.rows is None else
                 (self.rows.greedy, self.rows.logprobs, self.rows.adjusted, self.rows.masked))
        kind = ("draw", logits.shape[0], logits.data_ptr(), *flags)
        if kind not in self._graphs:
            self._capture(kind, pos.view(-1, 1), pos.view(-1, 1), lambda _tok, at: self._draw(logits, at))
        _, static_pos, graph, out = self._graphs[kind]
        static_pos.copy_(pos.view(-1, 1))
        graph.replay()
        return out

    @property
    def aot_cached(self) -> bool | None:
        """Mode aot: whether the step's library was loaded from the cache (None before the first step)."""
        return self._step.cached if self.mode == "aot" else None

    @property
    def kernels(self) -> dict[str, str]:
        """What runs, for people: {"gemv": plan.label, "decode_attention": ...}."""
        return {"gemv": self.plan.label, "decode_attention": self.plan.attention_label}

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, slot: int | None = None, start: int = 0,
                valid: int | None = None) -> torch.Tensor:
        """ids: [B, S] at positions start.. start+S-1 -> the next token [B] (the K/V are written to
        the cache; a prompt in chunks is prefilled chunk by chunk, each one's `start` where the last
        ended); with `slot`, ids: [1, S] is one sequence written into cache row `slot` alone.
        valid: only the first `valid` tokens are the prompt's, the rest padding (fewer distinct
        shapes for the GPU libraries to plan); the next token follows token valid - 1, and the
        padding's K/V, past it, are overwritten before anything reads them."""
        s = ids.shape[1]
        n = s if valid is None else valid
        if slot is not None and not (ids.shape[0] == 1 and 0 <= slot < self.batch):
            raise ValueError(f"slot {slot}: one sequence [1, S] into a row below {self.batch}, not {tuple(ids.shape)}")
        if not 0 <= start <= self.max_seq - s:
            raise ValueError(f"positions {start}..{start + s - 1} do not fit the cache of {self.max_seq}")
        if (slot is not None and start == 0 and self.prefill_graphs is not None and self.prefill_graphs.bucket(1, s)
                and not self._recording()):
            return self.prefill_slots(ids, [slot], [n])  # a whole prompt, or its first chunk: a graph
        ids = to_device(ids, self.device)
        logits = self.model(ids, torch.arange(start, start + s, device=self.device), self.cache, last_only=True, slot=slot,
                            kv_len=start + s, last_at=None if valid is None else valid - 1)
        self.prefill_finite = torch.isfinite(logits).all()  # on the device: read by who syncs anyway (generate)
        if self.rows is None:
            return self.sample(logits[:, -1])
        drawn_at = torch.full((ids.shape[0],), start + n, dtype=torch.long, device=self.device)
        which = None if slot is None else to_device([slot], self.device, torch.long)
        return self.rows.sample(logits[:, -1], drawn_at, which)

    def _recording(self) -> bool:
        """Whether draws record log-probabilities, adjust logits or follow grammars now (prefill
        graphs, captured without, do none of it)."""
        return self.rows is not None and (self.rows.logprobs or self.rows.adjusted or self.rows.masked)

    @torch.inference_mode()
    def prefill_slots(self, ids: torch.Tensor, slots: list[int], valid: list[int]) -> torch.Tensor:
        """Several prompts joining at once, in one forward: ids: [B, S] (row i: a prompt of valid[i]
        tokens, then padding; on any device) into cache rows `slots`, at positions 0..S-1 -> each
        one's next token [B] (with `rows`' settings of its slot). Short ones replay a CUDA graph
        (prefill_graphs) where the Decoder has them."""
        b, s = ids.shape
        if not (len(slots) == len(valid) == b and s <= self.max_seq and all(0 < n <= s for n in valid)):
            raise ValueError(f"prefill_slots: {b} prompts of {s} for slots {slots}, lengths {valid}")
        if self.prefill_graphs is not None and self.prefill_graphs.bucket(b, s) is not None and not self._recording():
            toks, self.prefill_finite = self.prefill_graphs.run(ids, slots, valid)
            return toks
        ids = to_device(ids, self.device)
        at, n = lists_to_device([slots, valid], self.device, torch.long)
        toks, self.prefill_finite = self._prefill_slots(ids, at, n)
        return toks

    @torch.inference_mode()
    def verify(self, ids: list[int], start: int) -> torch.Tensor:
        """Tokens ids at positions start.. of cache row 0 in one forward (their K/V written) -> the
        logits after each [len(ids), V]: a speculative step's check of its proposals (eager)."""
        s = len(ids)
        if not 0 <= start <= self.max_seq - s:
            raise ValueError(f"positions {start}..{start + s - 1} do not fit the cache of {self.max_seq}")
        pos = torch.arange(start, start + s, device=self.device)
        # the whole cache's span, not start + s: one attention shape a proposal count (a new
        # shape a step cost cuDNN's SDPA a plan each time: 122 ms steps on an H200)
        return self.model(torch.tensor([ids], device=self.device), pos, self.cache)[0]

    @torch.inference_mode()
    def prefill_packed(self, chunks: list[list[int]], rows: list[int], starts: list[int],
                       decode: tuple[torch.Tensor, list[int], list[int]] | None = None,
                       score: list[list[int] | None] | None = None):
        """Several sequences' chunks in one forward, packed end to end without padding
        (runtime.ragged; a paged cache whose table rows `rows` hold their blocks): chunk i at
        positions starts[i].. of row rows[i] -> the token after each chunk [n] (with `rows`'
        settings of its row). decode: (tokens [d] on the device, their rows, their positions),
        a decode step of d rows carried by the same forward, their next tokens first -> [d + n].
        score: per chunk, its prompt's token after each of its tokens (as many as are the
        prompt's), or None: those chunks' prompt log-probabilities come from the same forward, and
        the return is (tokens, [per chunk: (log-probabilities [m], ids [m, K], values [m, K]) of
        the model's own distribution, or None])."""
        tok, drows, dpos = decode or (None, [], [])
        lens = [1] * len(drows) + [len(c) for c in chunks]
        scored = score is not None and any(s is not None for s in score)
        marks = [False] * len(drows) + [s is not None for s in score] if scored else False
        packed = Ragged.build(self.cache, drows + rows, dpos + starts, lens, decode=len(drows), every=marks)
        ids = to_device([[t for c in chunks for t in c]], self.device, torch.long)  # [1, T - d]
        if drows:
            ids = torch.cat([tok.view(1, -1), ids], 1)  # [1, T]
            if self.rows is not None:
                self.rows.count(tok.view(-1), to_device(drows, self.device, torch.long))
        if not scored:
            return self._packed(ids, packed)[0]  # [d + n]
        sizes = [n if m else 1 for n, m in zip(lens, marks)]
        ends = to_device(sizes, self.device, torch.long).cumsum(0) - 1  # each sequence's last entry
        toks, logits = self._packed(ids, packed, ends)  # logits [L, V]: the marked sequences' every token
        out, at = [], len(drows)  # the decode rows' entries (one each) come first
        for size, nxt in zip(sizes[len(drows) :], score):
            if nxt:
                lsm = torch.log_softmax(logits[at : at + len(nxt)].float(), -1)  # [m, V]
                vals, top = lsm.topk(min(TOP_LOGPROBS, lsm.shape[-1]), -1)
                out.append((lsm.gather(-1, torch.tensor(nxt, device=self.device)[:, None])[:, 0], top, vals))
            else:
                out.append(None)
            at += size
        return toks, out

    @torch.inference_mode()
    def verify_rows(self, tok: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """A speculative step of cache rows 0..b-1 of a paged cache (a batch bucket): tok [b, L] on
        the device (each row's last token, then its proposals, then padding) at positions pos[r]..,
        lens [b] its real tokens (0: a free row) -> the token drawn after each [b, L], with its
        row's settings at the position after it: the draw plain decoding makes there (the sampler
        hashes the seed and the position), so a proposal equal to it is kept. One CUDA graph per
        (b, L) where the steps are graphs (an eager packed forward cost 6-10 one-token steps)."""
        b, width = tok.shape
        if width > TILE:
            raise ValueError(f"a verify step of {width} tokens a row; the most is {TILE}")
        extras = (self.rows.greedy, self.rows.logprobs, self.rows.adjusted, self.rows.masked) if self.rows is not None else ()
        kind = ("verify", b, width, *extras)
        if not self.use_graph:
            return self._verify(tok, pos, lens)
        if kind not in self._graphs:
            static = (tok.clone(), pos.clone(), lens.clone())
            try:
                graph, out = capture(self._verify, static, self._pool)
            except RuntimeError as e:  # this shape's verify steps run eagerly from now on; `verify_failed` says why
                self.verify_failed[(b, width)] = first_line(e)
                self._graphs[kind] = None
            else:
                self._graphs[kind] = (static, None, graph, out)
        if self._graphs[kind] is None:
            return self._verify(tok, pos, lens)
        static, _, graph, out = self._graphs[kind]
        for x, y in zip(static, (tok, pos, lens)):
            x.copy_(y)
        graph.replay()
        return out

    def _verify(self, tok: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        # tok [b, L], pos [b], lens [b] -> the draws after every token [b, L] (runtime.ragged.uniform)
        b, width = tok.shape
        packed = uniform(self.cache, pos, lens, width)
        # every row greedy (none with a bias, mask or penalty speculates): the argmax
        greedy = self.rows is not None and self.rows.greedy
        return self._packed(tok.reshape(1, b * width), packed, greedy=greedy)[0].view(b, width)

    def _packed(self, ids: torch.Tensor, packed, ends: torch.Tensor | None = None,
                greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # ids: [1, T] packed as `packed` (a runtime.ragged.Ragged) says -> (the token drawn after each
        # of its tokens packed.last [n] (only those at entries `ends`, where given), each with its
        # row's settings at the position after it, or where greedy the argmax (not a draw over the
        # sorted vocabulary); the logits [n, V])
        logits = self.model(ids, packed.positions, self.cache, slot=packed)[:, -1]  # [n, V]
        if greedy:
            return logits.argmax(-1), logits
        self.prefill_finite = torch.isfinite(logits).all()
        drawn, last = (logits, packed.last) if ends is None else (logits[ends], packed.last[ends])
        if self.rows is None:
            return self.sample(drawn), logits
        return self.rows.sample(drawn, packed.positions[0, last] + 1, packed.token_rows[last]), logits

    def _prefill_slots(self, ids: torch.Tensor, at: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # ids: [B, S], at: [B] cache rows, n: [B] prompt lengths -> next tokens [B], all logits finite []
        pos = torch.arange(ids.shape[1], device=self.device)  # [S]: every row at 0..S-1 (one mask, one RoPE table)
        logits = self.model(ids, pos, self.cache, last_only=True, slot=at, kv_len=ids.shape[1],
                            last_at=n - 1)[:, -1]  # [B, V]
        finite = torch.isfinite(logits).all()
        if self.rows is None:
            return self.sample(logits), finite
        return self.rows.sample(logits, n, at), finite

    @torch.inference_mode()
    def step(self, tok: torch.Tensor, pos: int | torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """tok: [B] at position pos (an int: every row there), or at positions pos: [B] (each row
        at its own, on the device) -> the next token [B]. With positions, B may be fewer than the
        cache's rows: the step runs on cache rows 0..B-1 alone (a batch bucket: one CUDA graph per
        B). kv_len: every position is below it, so an eager step's SDPA reads only that much of
        the cache (ignored by graphs and compile)."""
        rows = isinstance(pos, torch.Tensor)
        greedy = self.rows is not None and self.rows.greedy
        extras = (self.rows.logprobs, self.rows.adjusted, self.rows.masked) if self.rows is not None else ()
        kind = ("rows" if rows else "shared", tok.numel(), greedy, *extras)  # a graph per batch bucket and kind
        if rows and not 0 < tok.numel() <= self.batch:
            raise ValueError(f"{tok.numel()} rows for a cache of {self.batch}")
        if not self.use_graph or kind not in self._graphs:
            pos_t = pos.view(-1, 1) if rows else torch.tensor([pos], device=self.device)  # [B, 1] or [1]
            if not self.use_graph:
                args = (*self._rows_dynamic(tok.view(-1, 1), pos_t), kv_len if self.mode == "eager" else None)
                if self._skip_guards:
                    if kind in self._checked:
                        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                            return self._step(*args)
                    self._checked.add(kind)
                return self._step(*args)
            self._capture(kind, tok.view(-1, 1), pos_t)
        static_tok, static_pos, graph, out = self._graphs[kind]
        static_tok.copy_(tok.view(-1, 1))
        if rows:
            static_pos.copy_(pos.view(-1, 1))
        else:
            static_pos.fill_(pos)  # no host tensor a step
        graph.replay()
        return out

    def _rows_dynamic(self, tok: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tok [B, 1], pos [B, 1] of a compiled step with rows: B marked dynamic between 2 and the
        cache's rows less one, so those buckets share one compile; 1 row (specialized by torch) and
        all the rows (the step then takes the whole cache, not a slice) compile apart."""
        if self.mode == "compile" and self.rows is not None and pos.dim() == 2 and 1 < tok.shape[0] < self.batch:
            torch._dynamo.mark_dynamic(tok, 0, min=2, max=self.batch - 1)
            torch._dynamo.mark_dynamic(pos, 0, min=2, max=self.batch - 1)
        return tok, pos

    def _capture(self, kind: tuple, tok: torch.Tensor, pos: torch.Tensor, fn: Callable | None = None) -> None:
        # The warm-up runs (capture) run this step's own token and position: they write the K/V
        # the step writes, so the cache is as if they had not run; the sampler's counts, which
        # they add to, are put back. fn: what is captured (the step)
        static_tok, static_pos = self._rows_dynamic(tok.clone(), pos.clone())
        counts = self.rows.counting() if self.rows is not None else None
        graph, out = capture(fn or self._step, (static_tok, static_pos), self._pool)
        if counts is not None:
            self.rows.recount(counts)
        self._graphs[kind] = (static_tok, static_pos, graph, out)
