"""llamactl's LLaMA runtime: RMSNorm, RoPE, grouped-query attention and SwiGLU; the KV cache is handed in.

Module and parameter names follow transformers' LlamaForCausalLM, so a Hugging Face state dict
loads with `load_state_dict(..., assign=True)` and quantized linears can be swapped in by name.
The model holds no KV cache: `forward` takes one (runtime.kv_cache) from whoever runs steps, or
none to attend over its input alone. Every decode step has the same shapes (a [B, 1] token, a [1]
position, a fixed-size cache), which is what CUDA graphs and torch.compile need.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from llamactl.folder.config import LlamaArgs
from llamactl.runtime.kv_cache import LayerCache, PagedLayer, StaticCache
from llamactl.runtime.ragged import Ragged, attend

# SDPA's kernels for prefill on CUDA, without cuDNN's: cuDNN builds a plan for each new shape (an
# H200 spent 1.1 s on the first 192-token prompt, 40 ms after; docs/bench/README.md), which lands
# in the time to first token of every prompt length a server or `generate` has not seen.
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Tokens a forward from which RoPE runs as one Triton kernel (kernels.glue.rope) where
# Attention.rope_kernel: a 32 x 128-token prefill of llama2-7b took 93 ms with it, 111 without;
# below this a prefill is bound by its launches' host time, where the kernel's device time does not
# show and its two Triton launches may cost more than PyTorch's fourteen ops (not yet measured in
# one call: docs/bench/README.md)
ROPE_KERNEL_TOKENS = 2048


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with `linear` or `llama3` scaling applied."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if args.rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if args.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(args: LlamaArgs, max_seq: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_seq, head_dim] in float32, in the rotate-half layout of HF checkpoints."""
    inv_freq = rope_inv_freq(args).to(device)
    freqs = torch.outer(torch.arange(max_seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, S, D], cos/sin: [S, D]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = False  # one Triton kernel (kernels.glue) outside torch.compile; set by layers.prepare
        self.pdl = False  # that kernel's launch a programmatic dependent one (set by layers.prepare)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and not torch.compiler.is_compiling():
            from llamactl.kernels.glue import rms_norm

            return rms_norm(x, self.weight, self.eps, self.pdl)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        h, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(args.hidden_size, h * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=args.attention_bias)
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections()
        self.qkv_sizes = (h * d, kv * d, kv * d)
        # set by layers.prepare for S == 1: "rope" (llamactl's split-KV attention with RoPE and the
        # cache write folded in), "plain" (the attention kernel alone), "cpu" (llamactl's CPU
        # decode attention, kernels/cpu_attention.cpp), or "" (SDPA); with its
        # smallest chunk of the cache and programmatic dependent launch
        self.decode_kernel = ""
        self.attn_min_chunk = 64
        self.pdl = False
        self.rope_kernel = False  # a prefill's RoPE as one Triton kernel (kernels.glue) outside torch.compile
        self.tp_group = None  # tensor parallelism: o_proj's outputs are summed over this group (tp.py)

    def forward(self, x, cos, sin, mask, input_pos, residual, cache: LayerCache | None, slot: int | None = None):
        # x: [B, S, hidden] (normed), cos/sin: [S, D] ([B, S, D] per row), mask: [1 or B, 1, S, max_seq]
        # bool, input_pos: [S] or [B, S] (each row at its own positions), residual: [B, S, hidden],
        # cache: this layer's K/V (None: attend over x alone, at positions 0..S-1),
        # slot: the one cache row of a joining sequence (or a Ragged: sequences packed in x [1, T]) -> residual + attention(x)
        b, s, _ = x.shape
        kernel = s == 1 and slot is None and cache is not None  # llamactl's decode kernels: one position for all rows, or one each
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if isinstance(slot, Ragged):
            return self._ragged(q, k, v, cos, sin, residual, cache, slot)
        rep = self.n_heads // self.n_kv_heads
        paged = isinstance(cache, PagedLayer)
        if kernel and self.decode_kernel == "rope" and paged:
            from llamactl.kernels.attention import paged_decode_attention_rope

            d, rows = self.head_dim, input_pos.dim() == 2
            y = paged_decode_attention_rope(q.reshape(b, self.n_kv_heads, rep, d), k.reshape(b, self.n_kv_heads, d),
                                            v.reshape(b, self.n_kv_heads, d), cache.k, cache.v, cache.owner.table[:b],
                                            cos[:, 0] if rows else cos[0], sin[:, 0] if rows else sin[0],
                                            input_pos.view(-1), self.attn_min_chunk, self.pdl, cache.k_scale,
                                            cache.v_scale)  # [B, H_kv, rep, D]
            return add_linear(self.o_proj, y.reshape(b, 1, self.n_heads * d), residual, self.tp_group)
        if kernel and self.decode_kernel == "rope":
            from llamactl.kernels.attention import decode_attention_rope

            # one token, one kernel: RoPE, the cache write at input_pos, and attention over the cache
            # up to input_pos, with the query heads of a KV head as one tile
            d = self.head_dim
            ck, cv = cache.first(b)  # a bucket: cache rows 0..B-1
            rows = input_pos.dim() == 2  # cos/sin [B, 1, D] at input_pos [B, 1], else [1, D] at [1]
            y = decode_attention_rope(q.reshape(b, self.n_kv_heads, rep, d), k.reshape(b, self.n_kv_heads, d),
                                      v.reshape(b, self.n_kv_heads, d), ck, cv, cos[:, 0] if rows else cos[0],
                                      sin[:, 0] if rows else sin[0], input_pos.view(-1), self.attn_min_chunk,
                                      self.pdl, *cache.first_scales(b))  # [B, H_kv, rep, D]
            return add_linear(self.o_proj, y.reshape(b, 1, self.n_heads * d), residual, self.tp_group)
        q = q.view(b, s, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = k.view(b, s, self.n_kv_heads, self.head_dim)  # [B, S, H_kv, D]
        v = v.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, S, D]
        if (self.rope_kernel and b * s >= ROPE_KERNEL_TOKENS and q.dtype != torch.float32
                and not torch.compiler.is_compiling()):
            from llamactl.kernels.glue import rope

            q, k = rope(q, cos, sin), rope(k, cos, sin)  # [B, H, S, D], [B, H_kv, S, D]
        else:
            if cos.dim() == 3:  # per row: [B, S, D] -> [B, 1, S, D]
                cos, sin = cos[:, None], sin[:, None]
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if kernel and paged and self.decode_kernel == "plain":
            from llamactl.kernels.attention import paged_decode_attention

            table = cache.write(input_pos, k, v)  # [B, M]
            y = paged_decode_attention(q.reshape(b, self.n_kv_heads, rep, self.head_dim), cache.k, cache.v, table,
                                       input_pos.view(-1).expand(b), self.attn_min_chunk, self.pdl, cache.k_scale,
                                       cache.v_scale)  # [B, H_kv, rep, D]
            return add_linear(self.o_proj, y.reshape(b, 1, self.n_heads * self.head_dim), residual, self.tp_group)
        if kernel and self.decode_kernel == "plain":
            from llamactl.kernels.attention import decode_attention

            cache.write(input_pos, k, v)  # the kernel reads the cache rows 0..B-1 as they are (8-bit ones too)
            y = decode_attention(q.reshape(b, self.n_kv_heads, rep, self.head_dim), *cache.first(b), input_pos.view(-1),
                                 self.attn_min_chunk, self.pdl, *cache.first_scales(b))  # [B, H_kv, rep, D]
            return add_linear(self.o_proj, y.reshape(b, 1, self.n_heads * self.head_dim), residual, self.tp_group)
        if (kernel and self.decode_kernel == "cpu" and not paged and q.dtype == cache.dtype
                and cache.fmt.storage in (q.dtype, torch.int8, torch.float8_e4m3fn)):  # positions 0..input_pos alone, 8-bit ones too
            cache.write(input_pos, k, v)
            y = torch.ops.llamactl_cpu.decode_attention.default(
                q.reshape(b, self.n_kv_heads, rep, self.head_dim).contiguous(), *cache.first(b), input_pos.reshape(-1),
                self.head_dim**-0.5, *cache.first_scales(b))  # [B, H_kv, rep, D]
            return add_linear(self.o_proj, y.reshape(b, 1, self.n_heads * self.head_dim), residual, self.tp_group)
        if cache is not None:  # [B, H_kv, max_seq or span, D] ([B, H_kv, S, D] for slots [B])
            k, v = cache.update(input_pos, k, v, slot, mask.shape[-1])
        if mask.shape[-1] < k.shape[2]:  # the caller cut the cache to the positions that matter (eager steps)
            k, v = k[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]]
        if rep > 1:
            # Grouped-query attention as more query rows per KV head: query head h uses KV head
            # h // rep (transformers' repeat_kv), rows are independent, so fold the group into the
            # sequence axis. No K/V copy, and SDPA's fused kernels accept the mask.
            q = q.reshape(b, self.n_kv_heads, rep * s, self.head_dim)  # [B, H_kv, rep*S, D]
            mask = mask.repeat(1, 1, rep, 1)  # [1 or B, 1, rep*S, max_seq]
        with sdpa_kernel(PREFILL_SDPA) if q.is_cuda else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H_kv, rep*S, D]
        y = y.reshape(b, self.n_heads, s, self.head_dim)  # SDPA may return it non-contiguous (fp32 GQA on CUDA)
        y = y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)  # [B, S, H * D]
        return add_linear(self.o_proj, y, residual, self.tp_group)

    def _ragged(self, q, k, v, cos, sin, residual, cache: PagedLayer, ragged: Ragged):
        # q/k/v: [1, T, heads * D] of several sequences packed (runtime.ragged), cos/sin: [1, T, D]
        t, d = q.shape[1], self.head_dim
        q, k = q.view(1, t, self.n_heads, d), k.view(1, t, self.n_kv_heads, d)
        if self.rope_kernel and t >= ROPE_KERNEL_TOKENS and q.dtype != torch.float32 and not torch.compiler.is_compiling():
            from llamactl.kernels.glue import rope

            q, k = rope(q, cos, sin), rope(k, cos, sin)  # [1, H, T, D], [1, H_kv, T, D]
        else:
            q, k = apply_rope(q.transpose(1, 2), cos[:, None], sin[:, None]), apply_rope(k.transpose(1, 2), cos[:, None],
                                                                                           sin[:, None])
        cache.write_at(ragged.where, k[0].transpose(0, 1), v.view(t, self.n_kv_heads, d))  # [T, H_kv, D]
        y = attend(q[0].transpose(0, 1), cache.k, cache.v, cache.owner.table, ragged, self.attn_min_chunk,
                   cache.k_scale, cache.v_scale)  # [T, H, D]
        return add_linear(self.o_proj, y.reshape(1, t, self.n_heads * d), residual, self.tp_group)


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections()
        self.tp_group = None  # tensor parallelism: down_proj's outputs are summed over this group (tp.py)

    def forward(self, x, residual):
        # x: [B, S, hidden] (normed), residual: [B, S, hidden] -> residual + mlp(x)
        if self.gate_up_proj is not None:
            if getattr(self.gate_up_proj, "glu_out", False):  # its kernel applies SwiGLU to its output
                # [B, S, intermediate] in
                return add_linear(self.down_proj, self.gate_up_proj(x), residual, self.tp_group)
            h = self.gate_up_proj(x)  # [B, S, 2 * intermediate]
            if getattr(self.down_proj, "glu", False):  # the kernel applies SwiGLU itself
                return add_linear(self.down_proj, h, residual, self.tp_group)
            return add_linear(self.down_proj, swiglu(h), residual, self.tp_group)
        return add_linear(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x), residual, self.tp_group)


def swiglu(h: torch.Tensor, kernel: bool = False, pdl: bool = False) -> torch.Tensor:
    """h: [..., 2 I], a fused [gate; up] output -> silu(gate) * up: [..., I]; kernel: one Triton
    kernel (kernels.glue) outside torch.compile, pdl: launched as a programmatic dependent launch."""
    if kernel and not torch.compiler.is_compiling():
        from llamactl.kernels.glue import silu_mul

        return silu_mul(h, pdl)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _layer_forward(layer: "DecoderLayer", x, cos, sin, mask, input_pos, cache, slot: int | None = None):
    x = layer.self_attn(layer.input_layernorm(x), cos, sin, mask, input_pos, x, cache, slot)
    return layer.mlp(layer.post_attention_layernorm(x), residual=x)


# torch.compile traces this once and reuses it for every layer of the same structure (regional
# compilation): compile time no longer grows with depth. Outside torch.compile it is a plain call.
_layer_region = torch.compiler.nested_compile_region(_layer_forward)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.compile_region = False  # set by decode.Decoder for torch.compile

    def forward(self, x, cos, sin, mask, input_pos, cache: LayerCache | None, slot: int | None = None):
        # x: [B, S, hidden] -> [B, S, hidden]
        if self.compile_region and slot is None:
            return _layer_region(self, x, cos, sin, mask, input_pos, cache)
        return _layer_forward(self, x, cos, sin, mask, input_pos, cache, slot)


def add_linear(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, group=None) -> torch.Tensor:
    """residual + linear(x), in one kernel where the layer fuses the add (layers.fused.GemvLinear).
    group: a tensor-parallel row-parallel layer: linear(x) is this rank's share of the sum, added
    up across the group (one all-reduce) before the residual."""
    if group is not None:
        import torch.distributed._functional_collectives as funcol

        return residual + funcol.all_reduce(linear(x), "sum", group)
    if getattr(linear, "fuses_residual", False):
        return linear(x, residual=residual)
    return residual + linear(x)


def _concat(mods: list[nn.Module]) -> nn.Module | None:
    """One module for several projections of the same input, or None where they cannot be fused."""
    kind = type(mods[0])
    if any(type(m) is not kind for m in mods):
        return None
    if kind is nn.Linear:
        return _concat_linears(mods)
    concat = getattr(kind, "concat", None)
    return concat(mods) if concat is not None else None


def _concat_linears(linears: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([l.weight for l in linears])  # [sum(out), in]
    fused = nn.Linear(w.shape[1], w.shape[0], bias=linears[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([l.bias for l in linears]), requires_grad=False)
    return fused


class Backbone(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaModel(nn.Module):
    """LLaMA decoder. Its RoPE tables and causal mask grow to the longest cache it is handed."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.max_seq = 0  # positions the RoPE tables and the mask cover

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Concatenate q/k/v and gate/up weights: 4 matmuls a layer instead of 7.

        One wide matrix-vector product reads the same bytes as three narrow ones but runs closer
        to memory bandwidth, which is what a batch-1 decode step is bound by. Plain linears are
        concatenated here; quantized layers through their class's `concat` where it has one.
        """
        for layer in self.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            if at.qkv_proj is None:
                at.qkv_proj = _concat([at.q_proj, at.k_proj, at.v_proj])
                if at.qkv_proj is not None:
                    at.q_proj = at.k_proj = at.v_proj = None
            if mlp.gate_up_proj is None:
                mlp.gate_up_proj = _concat([mlp.gate_proj, mlp.up_proj])
                if mlp.gate_up_proj is not None:
                    mlp.gate_proj = mlp.up_proj = None

    def tie_weights(self):
        if self.args.tie_word_embeddings:
            emb = self.model.embed_tokens
            if isinstance(emb, nn.Embedding):
                self.lm_head.weight = emb.weight
            else:  # a low-bit table (layers.embedding): the head is a GPTQ layer over the same tensors
                self.lm_head = emb.head()

    @property
    def device(self) -> torch.device:
        emb = self.model.embed_tokens
        return (emb.weight if isinstance(emb, nn.Embedding) else emb.qweight).device

    @property
    def dtype(self) -> torch.dtype:
        # the runtime's: the table's, or what a low-bit table looks rows up in (the final norm may
        # be folded into lm_head)
        emb = self.model.embed_tokens
        return emb.weight.dtype if isinstance(emb, nn.Embedding) else emb.dtype

    def setup_positions(self, max_seq: int) -> None:
        """RoPE tables and the causal mask for positions 0..max_seq-1 (grown, never shrunk: a
        captured step keeps reading the tensors it was captured with)."""
        if max_seq <= self.max_seq:
            return
        self.max_seq = max_seq
        device = self.device
        cos, sin = rope_cos_sin(self.args, max_seq, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_seq, D] float32
        self.register_buffer("rope_sin", sin, persistent=False)
        causal = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool, device=device))
        self.register_buffer("causal_mask", causal, persistent=False)  # [max_seq, max_seq]

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, cache: StaticCache | None = None,
                last_only: bool = False, slot: int | None = None, kv_len: int | None = None,
                last_at: int | None = None) -> torch.Tensor:
        """idx: [B, S] token ids at positions input_pos: [S] (every row), or [B, S] (each row at its
        own positions, reading its cache only up to them); cache: where K/V are written and read
        (runtime.kv_cache), or None: idx is whole sequences at positions 0..S-1, attending over
        themselves alone (scoring). slot: idx is one sequence ([1, S]) for
        cache row `slot` alone (it joins while the other rows keep theirs), or slot: [B] the cache
        rows of B whole prompts joining at once (input_pos [B, S], each row 0..S-1), or a
        runtime.ragged.Ragged: idx [1, T] is several sequences' new tokens packed end to end over a
        paged cache (their positions its own), and the logits are each one's last [n, 1, vocab].
        kv_len: SDPA reads only
        the first kv_len cache positions (more than every position of input_pos; a length known
        on the host, so for eager calls, not a captured step). last_at: with last_only, the logits
        of position last_at of idx instead of its last (a prompt padded to a common length).
        Returns logits [B, S or 1, vocab]."""
        span = cache.max_seq if cache is not None else idx.shape[1]  # the positions attention may read
        self.setup_positions(span)
        if isinstance(slot, Ragged):  # sequences packed in one row: no mask, each one's last token
            return self._ragged(idx, slot, cache)
        if input_pos.dim() == 1:
            mask = self.causal_mask[None, None, input_pos]  # [1, 1, S, max_seq]
        else:
            mask = self.causal_mask[input_pos][:, None]  # [B, 1, S, max_seq]
        span = span if kv_len is None else min(span, kv_len)
        if span < mask.shape[-1]:
            mask = mask[..., :span]  # [.., span]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [S, D] or [B, S, D]
        x = self.model.embed_tokens(idx)  # [B, S, hidden]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, input_pos, None if cache is None else cache.layers[i], slot)
        if last_only and isinstance(last_at, torch.Tensor):  # each row's own: [B]
            x = x[torch.arange(x.shape[0], device=x.device), last_at][:, None]  # [B, 1, hidden]
        elif last_only:
            x = x[:, -1:] if last_at is None else x[:, last_at : last_at + 1]
        return self.lm_head(self.model.norm(x))

    def _ragged(self, idx: torch.Tensor, ragged: Ragged, cache) -> torch.Tensor:
        # idx: [1, T] -> the logits of each sequence's last token [n, 1, vocab]
        pos = ragged.positions
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [1, T, D]
        x = self.model.embed_tokens(idx)  # [1, T, hidden]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None, pos, cache.layers[i], ragged)
        return self.lm_head(self.model.norm(x[0, ragged.last][:, None]))  # [n, 1, vocab]
