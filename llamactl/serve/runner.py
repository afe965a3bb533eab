"""The serving runner: the scheduler's plans (serve.scheduler) become model calls. It owns the
paged KV cache (runtime.kv_cache.PagedCache: a block pool sized by memory, a table row per batch
row), the Decoder over it, each row's sampling settings and last token on the device, the host
buffers a step reads through (serve.staging), the warm-up, and under tensor parallelism the
actions rank 0 sends to the other ranks, which replay them (`follow`).
"""

from __future__ import annotations

import time
from importlib.util import find_spec

import torch

from llamactl.errors import InputError
from llamactl.options import RuntimeOptions
from llamactl.runtime.kv_cache import PagedCache
from llamactl.runtime.kv_format import KVFormat
from llamactl.runtime.sampling import RowSampling, snapshot_rows
from llamactl.runtime.settings import Sampling
from llamactl.runtime.speculate import PagedDraft
from llamactl.runtime.transfer import lists_to_device, to_device
from llamactl.runtime.step import Decoder
from llamactl.runtime.tp import receive, send
from llamactl.serve.plan import Decode, Params, Prefill, Verify
from llamactl.serve.scheduler import BATCH_PREFILL_TOKENS
from llamactl.serve.staging import Launched, Staging

BLOCK_SIZE = 16  # positions a KV block holds (a prefix is reused by whole blocks)
GPU_MEMORY_FRACTION = 0.9  # of the card, for weights, activations and the KV pool, by default (as vLLM's)
CPU_KV_BYTES = 2 << 30  # the most a CPU server's pool takes by default
# kept free beyond the estimated activations: the CUDA graphs' private pools (a llama3-8b server's
# 26 decode and 31 prefill graphs at 256 rows held 8.5 GiB and ran an H100 out of memory when
# only 0.5 GiB was kept), library workspaces, allocator slack
RESERVE_BYTES = 4 << 30
# A GPU server sized by fraction warms up over a pool of PROBE_BLOCKS, measures its peak, then
# takes what is left (blocks_left; serve.engine.Engine.warm_up): the estimate above left a
# llama3-8b server on an H100 a 44.9 GiB pool and 124 MiB free (its graphs' pools held 13.1 GiB),
# and its first 256-row mixed forward ran out of memory (docs/bench/runs/2026-12-07-paged-h100).
# MARGIN_BYTES stays free beyond the measured peak.
PROBE_BLOCKS = 64
MARGIN_BYTES = 1 << 30


def activation_bytes(model, max_batch: int, prefill_tokens: int) -> int:
    """An upper estimate of what a forward allocates beyond weights and cache: the largest prefill's
    hidden states and MLP (prefill_tokens tokens), and a full decode step's sampling over the
    vocabulary (float logits, their sort and its int64 indices, the draws' int64 hashes), kept
    twice (a greedy and a sampled graph)."""
    a, item = model.args, torch.empty((), dtype=model.dtype).element_size()
    sampling = max_batch * a.vocab_size * 48  # a step's draw over the vocabulary: logits, sort, int64 hashes
    return prefill_tokens * (6 * a.hidden_size + 4 * a.intermediate_size) * item + 2 * sampling


def kv_blocks(model, max_batch: int, max_seq: int, block_size: int, kv_memory_gib: float | None,
              fraction: float | None, prefill_tokens: int, fmt: KVFormat | None = None, draft=None) -> int:
    """Blocks of the KV pool: kv_memory_gib of them; else on a GPU what `fraction` of the card
    (GPU_MEMORY_FRACTION) leaves after what is in use now (weights; other processes) and the
    activations; on the CPU a fixed grid of max_batch x max_seq, at most CPU_KV_BYTES. fmt: what
    the pool stores (runtime.kv_format; default: the model's dtype); draft: a draft model whose
    K/V each block holds too (in its own dtype)."""
    per = PagedCache.block_bytes(model, block_size, fmt) + (PagedCache.block_bytes(draft, block_size) if draft else 0)
    if kv_memory_gib is not None:
        return int(kv_memory_gib * (1 << 30) // per) + 1
    dev = model.device
    if dev.type != "cuda":
        return min(max_batch * -(-max_seq // block_size), CPU_KV_BYTES // per) + 1
    free, total = torch.cuda.mem_get_info(dev)
    budget = (fraction or GPU_MEMORY_FRACTION) * total - (total - free)
    budget -= activation_bytes(model, max_batch, prefill_tokens) + RESERVE_BYTES
    return int(budget // per) + 1


def blocks_left(total: int, used: int, warm_up: int, fraction: float, block_bytes: int) -> int:
    """Blocks that `fraction` of a card of `total` bytes holds beside `used` bytes (in use with no
    pool: weights, the CUDA context, other processes) and `warm_up` bytes (what a warm-up took at
    its peak beyond that: the graphs' pools, the largest forward's activations)."""
    return int((fraction * total - used - warm_up - MARGIN_BYTES) // block_bytes) + 1


class Runner:
    """Model calls for one engine: prefill(), launch() and set_sampling() on its thread."""

    def __init__(self, model, max_batch: int, max_seq: int, mode: str, options: RuntimeOptions | None,
                 world=None, prefill_graphs: bool = True, *, blocks: int, block_size: int = BLOCK_SIZE,
                 fmt: KVFormat | None = None, draft=None):
        """world: tensor parallelism (tp.World): rank 0 sends each model action to the other ranks
        first (every rank computes the same tokens: the head is replicated). prefill_graphs: a
        whole prompt of few tokens, or a few joining together, replays a CUDA graph where the steps
        do (not under tensor parallelism: untried there). blocks: the KV pool's (kv_blocks), fmt:
        what it stores (runtime.kv_format). draft: a draft model whose proposals (propose()) the
        verify steps check, its K/V in blocks of its own under the same table."""
        self.device, self.mode, self.world = model.device, mode, world
        self.max_batch = max_batch
        self.rows = RowSampling.make([Sampling(temperature=0)] * max_batch, self.device)
        if blocks < 2:
            raise InputError("no device memory is left for the KV cache after the weights and activations",
                             "pass --kv-memory GiB, a higher --gpu-memory-fraction, or a smaller --max-batch")
        self.cache = PagedCache.for_model(model, max_batch, blocks, block_size, max_seq, fmt=fmt)
        self.decoder = Decoder(model, max_batch, max_seq, mode, options=options, rows=self.rows,
                               prefill_graphs=prefill_graphs and world is None, cache=self.cache)
        self.max_seq = max_seq
        self.draft = None if draft is None else PagedDraft(draft, self.cache, max_batch, mode, options)
        self._tok = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # each row's last token
        self._staging = Staging(max_batch, self.device)
        self.scores: list = []  # the last prefill's prompt scores, per chunk (prefill())
        self._forwarded: tuple | None = None  # a "forward" action's logits [b, V] and positions [b], until its "draw"
        self._followers_stopped = False

    def set_flags(self, **flags: bool) -> None:
        """RowSampling's step flags from now (logprobs, adjusted, masked: whether some running
        request asks for log-probabilities, has penalties or a bias, follows a grammar)."""
        changed = {k: on for k, on in flags.items() if getattr(self.rows, k) != on}
        if changed:
            self._do(("flags", changed))

    def set_masks(self, rows: list[int], masks) -> None:
        """Rows' bitmasks of the tokens allowed next ([n, ceil(V / 32)] int32 on the host; None:
        all), read by the steps launched after."""
        if rows:
            self._do(("masks", rows, masks))

    def adjust_rows(self, rows: list[int], settings: list, seen: list[list[int]], generated: list[list[int]],
                    stops: list[list[int]]) -> None:
        """Joining rows' penalties, biases and min_tokens, their tokens so far seen and generated
        ones counted, and the stop tokens min_tokens holds back (RowSampling.adjust_rows)."""
        self._do(("adjust_rows", rows, settings, seen, generated, stops))

    def logprobs_of(self, slots: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
        """What the last forward recorded for these rows (a prefill's first tokens; syncs)."""
        return self.rows.read_logprobs(slots, self.rows.lp_ids.shape[1])

    def _lp_copy(self, rows: "list[int] | int") -> tuple | None:
        """Device copies of the log-probabilities just recorded for rows (a list, or the first n),
        so a step launched next cannot overwrite them before they are read; None where none are."""
        if not self.rows.logprobs:
            return None
        r = self.rows
        if isinstance(rows, int):
            return r.lp_token[:rows].clone(), r.lp_ids[:rows].clone(), r.lp_vals[:rows].clone()
        at = to_device(rows, self.device, torch.long)
        return r.lp_token[at], r.lp_ids[at], r.lp_vals[at]

    def set_sampling(self, slot: int, p: Params) -> None:
        s = p.sampling
        self._do(("row", slot, s.temperature, s.top_k, s.top_p, s.seed or 0))

    def arrange(self, moves: list[tuple[int, int]], tables: dict[int, list[int]]) -> None:
        """Rows moved (table, settings, last token), then table rows set (a plan's, a step's)."""
        if moves or tables:
            self._do(("arrange", moves, sorted(tables.items())))

    def prefill(self, work: Prefill) -> list[int] | None:
        """Run one prefill forward: whole short prompts from position 0 replay a prefill graph
        where one takes them, several chunks (or any on a GPU) go packed (runtime.ragged), a lone
        one on the CPU as itself. Returns the next token of each chunk, read on the host where
        some chunk ends its prompt (else None, no read: its device time lands in the next one)."""
        slots = [r.slot for r in work.requests]
        graphs = self.decoder.prefill_graphs
        longest = max(len(c) for c in work.ids)
        self.scores = [None] * len(slots)
        scoring = self._scored(work) is not None  # prompt log-probabilities (echo): the packed forward keeps them
        if work.whole and not scoring and graphs is not None and graphs.bucket(len(slots), longest) is not None:
            ids = [c + [0] * (longest - len(c)) for c in work.ids]
            toks = self._do(("prefill_slots", ids, slots, [len(c) for c in work.ids]))  # [k]
        elif scoring or len(slots) > 1 or self.device.type == "cuda":
            toks = self._packed(work, [], [])  # [k]
        else:
            toks = self._do(("prefill", work.ids[0], slots[0], work.starts[0], work.ends[0]))  # [1]
        return toks.tolist() if any(work.ends) else None

    def _packed(self, work: Prefill, drows: list[int], dpos: list[int]) -> torch.Tensor:
        """work's chunks in one packed forward, after decode rows drows at dpos (a mixed step):
        their tokens [d + k]; the chunks' prompt scores, where asked for, into self.scores."""
        score = self._scored(work)
        toks = self._do(("prefill_packed", work.ids, [r.slot for r in work.requests], work.starts, work.ends,
                         drows, dpos, *([score] if score else [])))
        self.scores = [None] * len(work.requests)
        if score:
            toks, scores = toks
            self.scores = self._host_scores(scores, work)
        return toks

    @staticmethod
    def _scored(work: Prefill) -> list[list[int] | None] | None:
        """Per chunk, its prompt's token after each of its positions, where its request asks for
        prompt log-probabilities (and they are not all scored yet), else None; None for no chunk."""
        out = []
        for r, chunk, start in zip(work.requests, work.ids, work.starts):
            k = r.params.prompt_logprobs
            nxt = r.tokens[start + 1 : min(start + len(chunk) + 1, r.prompt_len)]
            out.append(nxt if k is not None and len(r.prompt_scores) < r.prompt_len - 1 else None)
        return out if any(x is not None for x in out) else None

    @staticmethod
    def _host_scores(scores: list, work: Prefill) -> list:
        """The prefill's prompt scores on the host: per chunk, (start, [(log-probability,
        [(id, value)] of the request's k)]) or None."""
        return [None if sc is None else (start, snapshot_rows(sc, r.params.prompt_logprobs))
                for sc, r, start in zip(scores, work.requests, work.starts)]

    def mixed(self, work: Prefill, step: Decode) -> tuple[list[int] | None, Launched]:
        """One packed forward of a prefill's chunks and a decode step's rows (a mixed step): the
        chunks' next tokens as prefill() returns them, the rows' as launch() does."""
        t0 = time.perf_counter()
        drows, dpos = list(step.at), [step.positions[i] for i in step.at]
        toks = self._packed(work, drows, dpos)  # [d + k]
        d = len(drows)
        launched = self._staging.read_later(toks[:d], step.requests, list(range(d)), t0, mixed=True,
                                            lp=self._lp_copy(drows) if d else None)
        return (toks[d:].tolist() if any(work.ends) else None), launched

    def verify(self, v: Verify, b: int) -> list[list[int]]:
        """Run a verify step over rows 0..b-1 (a batch bucket): the token drawn after each of
        every row's chunk tokens, read."""
        self.arrange([], v.tables)
        slots = [r.slot for r in v.requests]
        greedy = all(r.params.sampling.greedy for r in v.requests)
        toks = self._do(("verify", v.chunks, slots, v.starts, b, greedy)).tolist()  # [b, L]
        return [toks[s][: len(c)] for s, c in zip(slots, v.chunks)]

    def propose(self, slots: list[int], chunks: list[list[int]], starts: list[int], ks: list[int], b: int,
                idle: list[tuple[int, int, int]]) -> list[list[int]]:
        """The draft model's proposals for rows `slots` (runtime.speculate.PagedDraft.propose)."""
        return self._do(("propose", slots, chunks, starts, ks, b, idle))

    @property
    def block_bytes(self) -> int:
        """Bytes a block of the pool takes, the draft's K/V in it included."""
        return self.cache.nbytes // self.cache.blocks + (self.draft.block_bytes if self.draft is not None else 0)

    def set_last(self, slots: list[int], tokens: list[int]) -> None:
        """Rows' last tokens (what their next decode step feeds), from the host."""
        self._do(("last", slots, tokens))

    def launch(self, step: Decode) -> Launched:
        """Start one decode step; its tokens come back through the Launched (nothing read here)."""
        t0 = time.perf_counter()
        self.arrange([], step.tables)
        out = self._do(("step", step.rows, step.positions, step.kv_len, step.greedy))  # [b]
        return self._staging.read_later(out, step.requests, step.at, t0, lp=self._lp_copy(step.rows))

    def launch_forward(self, step: Decode) -> float:
        """Start a decode step's forward alone (its draw waits for launch_draw: a grammar's masks,
        made on the host while it runs); returns when it was launched."""
        t0 = time.perf_counter()
        self.arrange([], step.tables)
        self._do(("forward", step.rows, step.positions, step.kv_len))
        return t0

    def launch_draw(self, step: Decode, launched: float) -> Launched:
        """The draw of the forward launch_forward(step) started, with the rows' masks as set now."""
        out = self._do(("draw", step.greedy))  # [b]
        return self._staging.read_later(out, step.requests, step.at, launched, lp=self._lp_copy(step.rows))

    # -- model actions: run here, and on a tensor-parallel leader sent to the other ranks first -----

    def _do(self, action: tuple):
        if self.world is not None and self.world.rank == 0:
            send(action, self.world)
        return self._apply(action)

    def _apply(self, action: tuple):
        kind, *a = action
        if kind == "row":  # in place: a captured decode graph reads these same tensors
            i, t, k, p, seed = a
            self.rows.temperature[i], self.rows.top_k[i], self.rows.top_p[i], self.rows.seed[i] = t, k, p, seed
        elif kind == "arrange":  # rows moved down, then tables set
            moves, tables = a
            if moves:
                src, dst = lists_to_device([list(x) for x in zip(*moves)], self.device, torch.long)
                self.cache.move(src, dst)
                self.rows.move(src, dst)
                self._tok[dst] = self._tok[src]
            if tables:
                self.cache.set_rows([r for r, _ in tables], [b for _, b in tables])
        elif kind == "prefill":  # one prompt chunk into its slot; the last one sets the row's token
            ids, slot, start, last = a
            tok = self.decoder.prefill(torch.tensor([ids]), slot=slot, start=start)  # ids from the host
            if last:
                self._tok[slot] = tok[0]
            return tok  # [1]
        elif kind == "prefill_packed":  # chunks of several rows in one forward, and decode rows first (mixed)
            chunks, slots, starts, ends, drows, dpos, *score = a
            d = len(drows)
            at = to_device(drows, self.device, torch.long) if d else None
            toks = self.decoder.prefill_packed(chunks, slots, starts, (self._tok[at], drows, dpos) if d else None,
                                               **({"score": score[0]} if score else {}))
            scores = None
            if score:
                toks, scores = toks
            done = [d + i for i, e in enumerate(ends) if e]  # [d + k]: the rows' tokens, then the chunks'
            if d:
                self._tok[at] = toks[:d]
            if done:
                at_done, slot_done = lists_to_device([done, [slots[i - d] for i in done]], self.device, torch.long)
                self._tok[slot_done] = toks[at_done]
            return (toks, scores) if score else toks
        elif kind == "prefill_slots":  # whole prompts of one padded length, one a slot
            ids, slots, lens = a
            toks = self.decoder.prefill_slots(torch.tensor(ids), slots, lens)  # [k]
            self._tok[to_device(slots, self.device, torch.long)] = toks
            return toks
        elif kind == "verify":  # rows' last tokens and proposals, every position's draw
            chunks, slots, starts, b, greedy = a
            self.rows.greedy = greedy
            width = max(len(c) for c in chunks)
            tok, pos, lens = torch.zeros(b, width, dtype=torch.long), torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
            for c, slot, start in zip(chunks, slots, starts):
                tok[slot, : len(c)] = torch.tensor(c)
                pos[slot], lens[slot] = start, len(c)
            return self.decoder.verify_rows(*(to_device(x, self.device) for x in (tok, pos, lens)))  # [b, L]
        elif kind == "propose":
            return self.draft.propose(*a)
        elif kind == "flags":
            for k, on in a[0].items():
                setattr(self.rows, k, on)
        elif kind == "masks":
            self.rows.set_masks(*a)
        elif kind == "adjust_rows":
            self.rows.adjust_rows(*a)
        elif kind == "last":
            slots, tokens = a
            if slots:
                at, toks = lists_to_device([slots, tokens], self.device, torch.long)
                self._tok[at] = toks
        elif kind == "step":  # one decode step of the first b rows
            b, pos, kv_len, greedy = a
            self.rows.greedy = greedy
            out = self.decoder.step(self._tok[:b], self._staging.positions(pos), kv_len)  # [b]
            self._tok[:b].copy_(out)
            return out
        elif kind == "forward":  # a decode step's forward alone, drawn by the "draw" after it
            b, pos, kv_len = a
            at = self._staging.positions(pos)  # [b]
            self._forwarded = (self.decoder.step_logits(self._tok[:b], at, kv_len), at)  # [b, V], [b]
        elif kind == "draw":
            greedy, = a
            (logits, at), self._forwarded = self._forwarded, None
            self.rows.greedy = greedy
            out = self.decoder.draw(logits, at)  # [b]
            self._tok[: out.numel()].copy_(out)
            return out
        else:
            raise ValueError(f"unknown engine action {kind!r}")

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks above 0 of a tensor-parallel server: run rank 0's model actions until it stops."""
        while (action := receive(self.world))[0] != "stop":
            self._apply(action)

    def stop_followers(self) -> None:
        """A tensor-parallel leader's last message (once): the other ranks' follow() returns."""
        if self.world is not None and self.world.rank == 0 and not self._followers_stopped:
            self._followers_stopped = True
            send(("stop",), self.world)

    # -- warm-up: every shape the scheduler will ask for, before the first request ------------------

    def warm_up_plan(self, sched) -> str:
        """What warm_up runs, said before it starts (on a GPU's first start it takes minutes)."""
        steps = f"{2 * len(sched.buckets)} decode steps ({', '.join(map(str, sched.buckets))} rows, greedy and sampled)"
        if self._grammar_forwards():
            steps += f", {len(sched.buckets)} grammar steps' forwards"
        if self.device.type != "cuda":
            return steps
        if self.mode == "eager":
            what = f"running {steps} once"
        else:
            graphs = self.decoder.prefill_graphs
            prefills = f" and {len(graphs.shapes())} short prefills" if graphs is not None else ""
            what = f"capturing {steps}{prefills} as CUDA graphs"
        return (f"{what}; the first start on a GPU also compiles and tunes its kernels (minutes; later starts reuse "
                "the compiler caches)")

    def _grammar_forwards(self) -> bool:
        """Whether the warm-up captures the forwards of grammar rows' steps (structured output can
        run: xgrammar is installed; the steps are graphs): else the first constrained requests of
        each batch size pay for a capture."""
        return self.decoder.use_graph and find_spec("xgrammar") is not None

    @torch.inference_mode()
    def warm_up(self, sched) -> None:
        """One decode step per batch bucket of sched (serve.scheduler.Scheduler) with every row free
        (captures the CUDA graphs before the first request; free rows write position 0, which a
        prefill overwrites before it is read), then the prefill graphs and packed prefills (one
        mixed with a decode row; the largest with every row, where steps mix)."""
        for greedy in (True, False):  # a graph each: argmax alone, or the per-row draw
            self.rows.greedy = greedy
            for b in sched.buckets:
                self.decoder.step(self._tok[:b], torch.zeros(b, dtype=torch.long, device=self.device), 64)
        if self._grammar_forwards():  # a grammar's step: its forward alone, drawn after the host's masks
            for b in sched.buckets:
                self.decoder.step_logits(self._tok[:b], torch.zeros(b, dtype=torch.long, device=self.device))
        spec = sched.buckets[: 1 + sum(b < sched.spec_rows for b in sched.buckets)] if sched.spec_k else []
        for greedy in (True, False) if self.decoder.use_graph else ():
            self.rows.greedy = greedy  # verify steps' graphs, every width at the buckets that speculate (free rows)
            for b in spec:
                zeros = torch.zeros(b, dtype=torch.long, device=self.device)
                for width in range(2, sched.spec_k + 2):
                    self.decoder.verify_rows(torch.zeros(b, width, dtype=torch.long, device=self.device), zeros, zeros)
        if self.draft is not None:  # its steps at the buckets that speculate, and a packed forward
            for b in spec:
                self.draft.dec.step(self._tok[:b], torch.zeros(b, dtype=torch.long, device=self.device))
            self.draft.dec.prefill_packed([[0] * min(16, self.max_seq)], [0], [0])
        graphs = self.decoder.prefill_graphs
        if graphs is not None:  # the short prefills' graphs, into free rows
            graphs.capture_all()
        if self.device.type == "cuda":
            # packed prefills into free rows (their tables the null block's) too, so that the
            # libraries' first calls (Triton's compiles, cuBLAS's handles) land here and not in a
            # request's time to its first token: two short chunks, one past a "prefix", and the
            # largest forward the scheduler plans
            s = min(16, self.max_seq // 2)
            self.decoder.prefill_packed([[0] * s, [0] * s], [0, 1 % self.max_batch], [0, s])
            self.decoder.prefill_packed([[0] * s], [0], [0], (self._tok[:1], [1 % self.max_batch], [s]))  # mixed
            n = min(1024, self.max_seq)
            k = max(1, max(BATCH_PREFILL_TOKENS, sched.prefill_chunk) // n)
            rows = list(range(self.max_batch))  # every row decoding through it, where steps mix
            mixed = (self._tok, rows, [s] * self.max_batch) if sched.mix and sched.batch_prefill else None
            self.decoder.prefill_packed([[0] * n] * k, [0] * k, [0] * k, mixed)
            torch.cuda.synchronize(self.device)
