"""quantize --target-bpw: the bits of each tensor, chosen under a whole-file budget.

Every quantizable tensor (the decoder's linears, lm_head, the embedding table) has the choices
the runtime reads packed (GROUPED: 3 to 6 bits in groups of 32 to 128; 8 bits per row; kept).
Each choice costs its exact bytes in the written file (packed codes, zero points, fp16 scales,
g_idx, the safetensors header entry) and adds, to second order, 0.5 * sum F * (w - q(w))^2 to the
mean per-token KL against the parent (F: the tensor's diagonal Fisher, quantize.sensitivity; q:
the rounding the stage uses, importance-weighted by the calibration inputs). A knapsack over the
bytes then picks the choice per tensor with the least total KL that fits the budget.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from llamactl.errors import InputError
from llamactl.folder.checkpoint import iter_checkpoint
from llamactl.folder.describe import params_from_config
from llamactl.layers.gptq import gptq_buffers
from llamactl.quantize.options import EMBED, scheme_label
from llamactl.quantize.rtn import rtn_quantize
from llamactl.quantize.sensitivity import Stats


@dataclass(frozen=True)
class Option:
    scheme: dict | None  # {"bits", "group_size", "sym"}; None: the tensor kept as it is
    bytes: int
    kl: float  # predicted KL it adds, nats a token


# (bits, group sizes) besides 8 bits per row and the tensor kept: the widths the runtime reads
# packed (4: kernels.gemv; 3, 5, 6: kernels.planes, which need whole 32-row blocks both ways)
GROUPED = ((3, (128, 64, 32)), (4, (128, 64, 32)), (5, (128, 64)), (6, (128,)))
TABLE_BITS = (4,)  # of these, what the embedding table's lookup reads (and 8 bits per row)


def choices(name: str, out_f: int, in_f: int, sym: bool, widths=(3, 4, 5, 6, 8)) -> list[dict | None]:
    """Every scheme tensor `name` [out_f, in_f] may take, of the bit widths `widths`."""
    planes = out_f % 32 == 0 and in_f % 32 == 0
    grouped = [{"bits": b, "group_size": g, "sym": sym} for b, groups in GROUPED for g in groups
               if b in widths and (b in TABLE_BITS if name == EMBED else (b == 4 or planes))]
    return [None] + ([{"bits": 8, "group_size": -1, "sym": True}] if 8 in widths else []) + grouped


def packed_bytes(name: str, out_f: int, in_f: int, scheme: dict | None, elem: int) -> int:
    """Bytes the written file spends on one tensor under `scheme` (elem: the parent's bytes an element)."""
    if scheme is None:
        return out_f * in_f * elem + _header(f"{name}.weight", 2)
    with torch.device("meta"):
        holder = torch.nn.Module()
        gptq_buffers(holder, in_f, out_f, scheme["bits"], scheme["group_size"])
    return sum(b.numel() * b.element_size() + _header(f"{name}.{k}", b.dim()) for k, b in holder.named_buffers())


def _header(name: str, dims: int) -> int:
    """A generous size of a tensor's entry in the safetensors JSON header."""
    entry = {name: {"dtype": "BF16", "shape": [10**9] * dims, "data_offsets": [10**12, 10**12]}}
    return len(json.dumps(entry, separators=(",", ":")))


def options_for(name: str, weight: torch.Tensor, fisher: torch.Tensor, act2: torch.Tensor | None, sym: bool,
                clip_search: bool, elem: int, widths=(3, 4, 5, 6, 8)) -> list[Option]:
    """weight, fisher: [out, in] -> every choice for this tensor with its bytes and predicted KL."""
    w = weight.float()
    out_f, in_f = w.shape
    opts, seen = [], set()
    for scheme in choices(name, out_f, in_f, sym, widths):
        if scheme is not None and scheme["group_size"] >= in_f:
            scheme = scheme | {"group_size": -1}
        key = json.dumps(scheme, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        kl = 0.0
        if scheme is not None:
            codes, zeros, scales, g_idx = rtn_quantize(w, scheme["bits"], scheme["group_size"], scheme["sym"],
                                                       clip_search, act2)
            g = g_idx.long()
            w_hat = (codes - zeros.t()[:, g]) * scales.t()[:, g]  # [out, in]
            kl = 0.5 * float((fisher * (w_hat - w) ** 2).sum())
        opts.append(Option(scheme, packed_bytes(name, out_f, in_f, scheme, elem), kl))
    return opts


@dataclass
class Allocation:
    schemes: dict[str, dict | None]  # tensor (module path) -> its scheme
    predicted_kl: float
    bytes: int  # of the whole weight file, predicted
    budget_bytes: int
    table: dict[str, list[Option]]

    def summary(self) -> dict[str, int]:
        """label -> how many tensors took it."""
        out: dict[str, int] = {}
        for s in self.schemes.values():
            out[scheme_label(s)] = out.get(scheme_label(s), 0) + 1
        return dict(sorted(out.items()))


UNITS = 100_000  # the knapsack's resolution: the room above the smallest file, in this many steps


def allocate(table: dict[str, list[Option]], fixed_bytes: int, budget_bytes: int) -> Allocation:
    """The choice per tensor that minimises the predicted KL with the file within budget_bytes:
    a knapsack over the bytes above each tensor's smallest choice, counted in steps of 1/UNITS of
    that room (each choice's bytes rounded up, so the file never exceeds the budget), then what is
    left of the rounding spent on the upgrades that save the most KL a byte."""
    import numpy as np

    names = list(table)
    base = {n: min(o.bytes for o in table[n]) for n in names}
    extra = budget_bytes - fixed_bytes - sum(base.values())
    if extra < 0:
        raise InputError(f"the budget is {8 * budget_bytes:,} bits but the smallest file these choices make needs "
                         f"{8 * (fixed_bytes + sum(base.values())):,}", "raise --target-bpw")
    unit = max(1, -(-extra // UNITS))
    cap = extra // unit
    steps = {n: [-(-(o.bytes - base[n]) // unit) for o in table[n]] for n in names}
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0  # best[u]: the least KL of the tensors so far with u steps spent
    picks = np.zeros((len(names), cap + 1), dtype=np.int8)
    for t, n in enumerate(names):
        nxt = np.full(cap + 1, np.inf)
        for k, (o, u) in enumerate(zip(table[n], steps[n])):
            if u > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[u:] = best[: cap + 1 - u] + o.kl
            better = cand < nxt
            nxt[better], picks[t][better] = cand[better], k
        best = nxt
    u = int(np.argmin(best))
    chosen: dict[str, Option] = {}
    for t in range(len(names) - 1, -1, -1):
        k = int(picks[t][u])
        chosen[names[t]] = table[names[t]][k]
        u -= steps[names[t]][k]
    left = budget_bytes - fixed_bytes - sum(o.bytes for o in chosen.values())
    while True:  # the rounding's leftovers: the upgrades that save the most KL a byte
        best_up = None
        for n, opts in table.items():
            for o in opts:
                more, saved = o.bytes - chosen[n].bytes, chosen[n].kl - o.kl
                if 0 < more <= left and saved > 0 and (best_up is None or saved / more > best_up[0]):
                    best_up = (saved / more, n, o)
        if best_up is None:
            break
        left -= best_up[2].bytes - chosen[best_up[1]].bytes
        chosen[best_up[1]] = best_up[2]
    chosen = {n: chosen[n] for n in names}
    return Allocation({n: o.scheme for n, o in chosen.items()}, sum(o.kl for o in chosen.values()),
                      fixed_bytes + sum(o.bytes for o in chosen.values()), budget_bytes, table)


def plan(art, stats: Stats, target_bpw: float, sym: bool, clip_search: bool, progress,
         widths=(3, 4, 5, 6, 8), device: torch.device | None = None) -> Allocation:
    """The allocation for `art` under target_bpw bits per parent parameter (each choice's
    rounding tried on `device`)."""
    tensors = dict(iter_checkpoint(art))
    tied = art.args.tie_word_embeddings
    names = set(stats.fisher)
    missing = {n for n in names if f"{n}.weight" not in tensors}
    if missing:
        raise InputError(f"the calibration stats name tensors this model lacks ({', '.join(sorted(missing)[:3])})",
                         "calibrate this model with `llamactl calibrate`")
    fixed = 0
    for k, t in tensors.items():
        module = k.rsplit(".", 1)[0]
        if module in names and k.endswith(".weight"):
            continue
        if tied and k == "lm_head.weight":
            continue  # a tied copy: the writers drop it
        fixed += t.numel() * t.element_size() + _header(k, t.dim())
    fixed += 8 + 512  # the header's length field, its metadata and braces
    table: dict[str, list[Option]] = {}
    with progress("bit choices", len(names)) as advance:
        for n in sorted(names):
            w = tensors[f"{n}.weight"]
            act2 = stats.act2.get(n)
            table[n] = options_for(n, w.to(device), stats.fisher[n].to(device), None if act2 is None else act2.to(device),
                                   sym, clip_search, w.element_size(), widths)
            advance(1)
    budget = int(target_bpw * params_from_config(art.args) / 8)
    return allocate(table, fixed, budget)

