"""convert-heads: multi-head (or grouped-query) attention -> grouped-query attention with fewer KV heads.

Units: a *unit* is one KV head of the input together with the query heads that read it (one query
head per unit in an MHA model). Conversion partitions the units into G equal groups; each group
becomes one KV head.

grouping
  contiguous   units [0..r-1], [r..2r-1], ... (what transformers' repeat_kv expects)
  similarity   units are grouped greedily to minimise what the fit merge cannot represent
               (the residual of its key and value fits, measured on calibration statistics, as a
               fraction of each term's energy); whole heads are then permuted (q_proj rows, o_proj columns, K and V) so each
               group is contiguous. Permuting whole heads leaves the model's function unchanged;
               RoPE only mixes dimensions inside a head.

merge
  mean   the GQA paper's initialization: average K and V weights over the group.
  fit    fitted to calibration statistics; q_proj and o_proj change too:

  Keys. RoPE rotates each pair (i, i + d/2) of a head by the same angle, position times the pair's
  frequency. Write that pair of a key as one complex channel k_f = c_f^T x (c_f = W[i] + 1j W[i+d/2])
  and likewise q_f. The attention logit is Re sum_f q_f conj(k_f) e^{1j theta_f (m - n)}. If every
  unit's channel is replaced by a multiple of one shared channel, k_{j,f} ~ alpha_{j,f} k~_f, and
  each query pair of unit j is multiplied by conj(alpha_{j,f}), then
      q'_f conj(k~_f) = q_f conj(alpha_{j,f} k~_f) ~ q_f conj(k_{j,f})
  for every relative position m - n, because complex multiplication commutes with the rotation:
  the construction is exact with respect to RoPE, and only the rank-1 approximation errs. Per
  frequency we minimise  sum_j w_{j,f} E|k_{j,f} - alpha_{j,f} k~_f|^2,  where w_{j,f} is the
  energy E|q_f|^2 of unit j's query heads at that frequency (an error in k is seen through q) and
  the expectation over inputs x with covariance S turns it into a whitened problem
      sum_j || sqrt(w_j) S^{1/2} c_j - beta_j S^{1/2} c~ ||^2,   beta_j = sqrt(w_j) alpha_j,
  solved by the top singular pair of the complex matrix [sqrt(w_j) S^{1/2} c_j]_j.

  Values. Head h adds o_h v_h z_h to the output, where z_h is the input mixed by head h's
  attention (z_h = sum_n a_h(m, n) x_n) and o_h, v_h its o_proj slice and v_proj rows. A shared
  v~ (d rows) must serve every head h in the group: the best rank-d approximation of the stacked
  products [o_h v_h]_h under the covariance C of the attention-mixed inputs gives
  v~ = (top-d right singular vectors of [o_h v_h C^{1/2}]_h)^T C^{-1/2}; each head's o_proj slice is
  then refit by least squares, o'_h = o_h v_h C_h v~^T (v~ C_h v~^T)^{-1}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from llamactl.runtime.model import apply_rope

GROUPINGS = ("contiguous", "similarity")
MERGES = ("mean", "fit")


@dataclass
class LayerStats:
    """Calibration statistics of one layer's attention input (float64 accumulators)."""

    cov: torch.Tensor  # S: [hid, hid], sum of x x^T over tokens
    q_energy: torch.Tensor  # [H, d/2], sum over tokens of |q_{h,f}|^2
    mixed_cov: torch.Tensor  # [H, hid, hid], sum over tokens of z_h z_h^T
    tokens: int = 0


def _accumulate(st: LayerStats, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Add one sample's statistics; x: [1, T, hid] is the normalized input of the attention block."""
    h, kvh, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    b, t, hid = x.shape
    x = x.float()
    flat = x.reshape(-1, hid).double()
    st.cov += flat.T @ flat
    st.tokens += b * t
    q = attn.q_proj(x).view(b, t, h, d).transpose(1, 2)  # [B, H, T, d]
    k = attn.k_proj(x).view(b, t, kvh, d).transpose(1, 2)  # [B, H_kv, T, d]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    st.q_energy += (q[..., : d // 2] ** 2 + q[..., d // 2 :] ** 2).sum(dim=(0, 2)).double()
    k = k.repeat_interleave(h // kvh, dim=1)  # [B, H, T, d]
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    attn_w = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~causal, float("-inf")).softmax(-1)  # [B, H, T, T]
    z = attn_w @ x.unsqueeze(1)  # [B, H, T, hid]: the input as each head's attention mixes it
    st.mixed_cov += torch.einsum("bhti,bhtj->hij", z, z).to(st.mixed_cov.dtype)


@torch.no_grad()
def layer_stats(model, samples: torch.Tensor, progress: Callable[[int], None] = lambda n: None):
    """Yield LayerStats of each layer in turn, propagating the parent's hidden states layer by layer.

    Memory holds the hidden states of all samples ([n, T, hid]) and one layer's statistics, so
    large models convert on one machine (as GPTQ does it).
    """
    a = model.args
    t = samples.shape[1]
    model.setup_positions(t)
    dev = model.device
    pos = torch.arange(t, device=dev)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    mask = model.causal_mask[None, None, pos][..., :t]  # [1, 1, t, t]
    xs = [model.model.embed_tokens(samples[i : i + 1].to(dev)) for i in range(samples.shape[0])]
    hid, h, d = a.hidden_size, a.num_attention_heads, a.head_dim
    for layer in model.model.layers:
        st = LayerStats(torch.zeros(hid, hid, dtype=torch.float64, device=dev),
                        torch.zeros(h, d // 2, dtype=torch.float64, device=dev),
                        torch.zeros(h, hid, hid, dtype=torch.float32 if hid > 1024 else torch.float64, device=dev))
        for x in xs:
            _accumulate(st, layer.self_attn, layer.input_layernorm(x), cos, sin)
        yield LayerStats(st.cov.cpu(), st.q_energy.cpu(), st.mixed_cov.double().cpu(), st.tokens)
        xs = [layer(x, cos, sin, mask, pos, None) for x in xs]
        progress(1)


def _sym_pow(m: torch.Tensor, power: float, damp: float = 1e-6) -> torch.Tensor:
    """m^power for a symmetric PSD matrix, with eigenvalues floored at damp * mean eigenvalue."""
    vals, vecs = torch.linalg.eigh(m)
    vals = vals.clamp(min=damp * vals.mean().clamp(min=1e-30))
    return (vecs * vals**power) @ vecs.T


def group_cost(members: list[int], wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, st: LayerStats,
               s_half: torch.Tensor, energy: torch.Tensor, rep: int, d: int) -> float:
    """What the fit merge cannot represent when `members` share one KV head, as fractions of the
    group's whitened key energy and of its value-path energy (the two terms the fit minimises)."""
    half, hid = d // 2, wk.shape[1]
    kblk = wk.view(-1, d, hid)[members]  # [r, d, hid]
    c = torch.complex(kblk[:, :half], kblk[:, half:])  # [r, d/2, hid]
    u = torch.einsum("ij,rfj->fri", s_half.to(c.dtype), c) * energy[members].clamp(min=1e-12).sqrt().T[:, :, None]
    sv2 = torch.linalg.svdvals(u) ** 2  # [d/2, r]
    key = (sv2[:, 1:].sum() / sv2.sum().clamp(min=1e-30)).item()
    heads = [hq for unit in members for hq in range(unit * rep, (unit + 1) * rep)]
    cmix = st.mixed_cov[heads].sum(0) / max(st.tokens, 1)  # [hid, hid]
    vs = torch.cat([wv.view(-1, d, hid)[hq // rep] for hq in heads])  # [n*d, hid]
    kmat = vs @ cmix @ vs.T  # [n*d, n*d]
    gs = [wo[:, hq * d : (hq + 1) * d].T @ wo[:, hq * d : (hq + 1) * d] for hq in heads]  # o_h^T o_h: [d, d]
    g_half = torch.block_diag(*[_sym_pow(g, 0.5) for g in gs])
    ev = torch.linalg.eigvalsh(g_half @ kmat @ g_half).clamp(min=0)  # the spectrum of the stacked o_h v_h
    value = (ev[:-d].sum() / ev.sum().clamp(min=1e-30)).item()
    return key + value


def similarity_groups_by_cost(cost: Callable[[list[int]], float], units: int, groups: int) -> list[list[int]]:
    """Equal-size groups, greedily: seed with the cheapest pair, grow by the cheapest addition."""
    size = units // groups
    left, out = list(range(units)), []
    while left:
        if len(left) == size:
            out.append(sorted(left))
            break
        group = list(min(((i, j) for i in left for j in left if i < j), key=lambda p: cost(list(p))))
        while len(group) < size:
            group.append(min((u for u in left if u not in group), key=lambda u: cost(group + [u])))
        out.append(sorted(group))
        left = [u for u in left if u not in group]
    return sorted(out)


def permute_units(state: dict[str, torch.Tensor], prefix: str, order: list[int], units: int, rep: int, d: int) -> None:
    """Reorder whole units (a KV head and its query heads) in q/k/v rows and o_proj columns, in place."""
    qidx = torch.tensor([u * rep * d + i for u in order for i in range(rep * d)])
    kidx = torch.tensor([u * d + i for u in order for i in range(d)])
    for name, idx in (("q_proj", qidx), ("k_proj", kidx), ("v_proj", kidx)):
        for suffix in (".weight", ".bias"):
            key = f"{prefix}.self_attn.{name}{suffix}"
            if key in state:
                state[key] = state[key][idx].contiguous()
    key = f"{prefix}.self_attn.o_proj.weight"
    state[key] = state[key][:, qidx].contiguous()


def merge_layer(state: dict[str, torch.Tensor], prefix: str, st: LayerStats | None, merge: str, units: int,
                groups: int, rep: int, d: int) -> None:
    """Merge contiguous groups of units into one KV head each, in place (weights in float32)."""
    size = units // groups
    p = f"{prefix}.self_attn"
    wq, wk, wv, wo = (state[f"{p}.{n}_proj.weight"].float() for n in ("q", "k", "v", "o"))
    hid = wk.shape[1]
    if merge == "mean":
        state[f"{p}.k_proj.weight"] = wk.view(groups, size, d, hid).mean(1).reshape(groups * d, hid)
        state[f"{p}.v_proj.weight"] = wv.view(groups, size, d, hid).mean(1).reshape(groups * d, hid)
        for b in ("k_proj", "v_proj"):
            if f"{p}.{b}.bias" in state:
                state[f"{p}.{b}.bias"] = state[f"{p}.{b}.bias"].float().view(groups, size, d).mean(1).reshape(-1)
        return
    n = max(st.tokens, 1)
    cov = st.cov / n
    s_half, s_ihalf = _sym_pow(cov, 0.5), _sym_pow(cov, -0.5)
    energy = (st.q_energy / n).view(units, rep, d // 2).sum(1)  # [U, d/2]
    half = d // 2
    new_k, new_v = torch.zeros(groups * d, hid, dtype=torch.float64), torch.zeros(groups * d, hid, dtype=torch.float64)
    wq64, wo64 = wq.double().clone(), wo.double().clone()
    wk64, wv64 = wk.double(), wv.double()  # converted once, not per group and per head
    for g in range(groups):
        members = list(range(g * size, (g + 1) * size))
        # keys: one complex rank-1 fit per RoPE frequency
        kblk = wk64.view(units, d, hid)[members]  # [r, d, hid]
        c = torch.complex(kblk[:, :half], kblk[:, half:])  # [r, d/2, hid]
        sw = energy[members].clamp(min=1e-12).sqrt()  # [r, d/2]
        u = torch.einsum("ij,rfj->fri", s_half.to(c.dtype), c) * sw.T[:, :, None]  # [d/2, r, hid]
        uu, ss, vh = torch.linalg.svd(u, full_matrices=False)  # per frequency
        beta = uu[:, :, 0] * ss[:, :1]  # [d/2, r]
        shared = torch.einsum("ij,fj->fi", s_ihalf.to(c.dtype), vh[:, 0, :])  # c~ = S^{-1/2} u~: [d/2, hid]
        alpha = beta / sw.T  # [d/2, r]
        new_k[g * d : g * d + half] = shared.real
        new_k[g * d + half : (g + 1) * d] = shared.imag
        for m_i, unit in enumerate(members):
            for hq in range(unit * rep, (unit + 1) * rep):
                rows = wq64[hq * d : (hq + 1) * d]
                qc = torch.complex(rows[:half], rows[half:]) * alpha[:, m_i].conj()[:, None]  # [d/2, hid]
                wq64[hq * d : hq * d + half] = qc.real
                wq64[hq * d + half : (hq + 1) * d] = qc.imag
        # values: rank-d fit of the stacked o_h v_h under the mixed-input covariance, then refit o_h
        heads = [hq for unit in members for hq in range(unit * rep, (unit + 1) * rep)]
        mixed = st.mixed_cov[heads] / n  # [r*rep, hid, hid]
        c_all = mixed.sum(0)
        c_half, c_ihalf = _sym_pow(c_all, 0.5), _sym_pow(c_all, -0.5)
        prods = [wo64[:, hq * d : (hq + 1) * d] @ wv64[(hq // rep) * d : (hq // rep + 1) * d] for hq in heads]
        gram = sum((pm @ c_half).T @ (pm @ c_half) for pm in prods)  # [hid, hid]
        vals, vecs = torch.linalg.eigh(gram)
        vt = vecs[:, -d:].T @ c_ihalf  # v~: [d, hid]
        new_v[g * d : (g + 1) * d] = vt
        for hq, pm, ch in zip(heads, prods, mixed):
            a_mat = vt @ ch @ vt.T  # [d, d]
            ridge = 1e-8 * a_mat.diagonal().mean() * torch.eye(d, dtype=a_mat.dtype)
            wo64[:, hq * d : (hq + 1) * d] = pm @ ch @ vt.T @ torch.linalg.inv(a_mat + ridge)
    state[f"{p}.k_proj.weight"] = new_k.float()
    state[f"{p}.v_proj.weight"] = new_v.float()
    state[f"{p}.q_proj.weight"] = wq64.float()
    state[f"{p}.o_proj.weight"] = wo64.float()


def convert_state(state: dict[str, torch.Tensor], args, groups: int, grouping: str, merge: str,
                  stats: Iterator[LayerStats] | None) -> dict[str, Any]:
    """Convert every layer of a float state dict in place; `stats` yields each layer's LayerStats
    in order (needed for similarity grouping and fit merging). Returns the groups chosen."""
    units, d = args.num_key_value_heads, args.head_dim
    rep = args.num_attention_heads // units
    size = units // groups
    report = []
    for i in range(args.num_hidden_layers):
        prefix = f"model.layers.{i}"
        st = next(stats) if stats is not None else None
        order = list(range(units))
        if grouping == "similarity":
            w = {n: state[f"{prefix}.self_attn.{n}_proj.weight"].double() for n in ("k", "v", "o")}
            energy = (st.q_energy / max(st.tokens, 1)).view(units, rep, d // 2).sum(1)
            s_half = _sym_pow(st.cov / max(st.tokens, 1), 0.5)

            def cost(members: list[int]) -> float:
                return group_cost(members, w["k"], w["v"], w["o"], st, s_half, energy, rep, d)

            order = [u for grp in similarity_groups_by_cost(cost, units, groups) for u in grp]
            permute_units(state, prefix, order, units, rep, d)
            _permute_stats(st, order, rep)
        merge_layer(state, prefix, st, merge, units, groups, rep, d)
        report.append([order[g * size : (g + 1) * size] for g in range(groups)])
    return {"groups_per_layer": report}


def _permute_stats(st: LayerStats, order: list[int], rep: int) -> None:
    qorder = torch.tensor([u * rep + r for u in order for r in range(rep)])
    st.q_energy = st.q_energy[qorder]
    st.mixed_cov = st.mixed_cov[qorder]
