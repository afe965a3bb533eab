"""The quantize stage's options and the layers it quantizes (shared by the writers)."""

from __future__ import annotations

from dataclasses import dataclass

from llamactl.folder.artifact import Artifact
from llamactl.folder.schemes import EMBED, embedding_scheme_of, module_scheme, scheme_label  # noqa: F401

GPTQ_VARIANTS = ("gptq", "gptaq", "foem")
BITS = {"gptq": (3, 4, 5, 6, 8), "rtn": (3, 4, 5, 6, 8), "nf4": (4,), "int8": (8,), "fp8": (8,)}
DEFAULT_BITS = {"gptq": 4, "rtn": 4, "nf4": 4, "int8": 8, "fp8": 8}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class QuantOptions:
    method: str = "gptq"
    bits: int = 4
    group_size: int = 128  # -1: one group per output channel (the whole input row)
    sym: bool = True
    desc_act: bool = False
    damp: float = 0.01
    clip_search: bool = False
    gptq_variant: str = "gptq"  # gptq, gptaq (asymmetric calibration) or foem, from GPTQModel
    lm_head: bool = False
    head_bits: int | None = None  # lm_head's bits when it differs from the layers' (8: per row, symmetric)
    embed_bits: int = 16  # the token embedding table: 16 (as it is), 8 (per row) or 4 (groups of group_size)
    calib: str = "docs"
    n_samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    target_bpw: float | None = None  # a whole-file budget: bits per tensor chosen by quantize.budget
    calib_stats: str | None = None  # a `llamactl calibrate` file (else the stage measures them)
    widths: tuple[int, ...] = (3, 4, 5, 6, 8)  # the bits --target-bpw may give a tensor (16, kept, always)
    schemes: dict | None = None  # module -> scheme (None: kept), the stage's allocation under target_bpw


def target_linears(art: Artifact, lm_head: bool) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of every linear layer the stage quantizes."""
    a = art.args
    shapes = {
        "self_attn.q_proj": (a.hidden_size, a.num_attention_heads * a.head_dim),
        "self_attn.k_proj": (a.hidden_size, a.num_key_value_heads * a.head_dim),
        "self_attn.v_proj": (a.hidden_size, a.num_key_value_heads * a.head_dim),
        "self_attn.o_proj": (a.num_attention_heads * a.head_dim, a.hidden_size),
        "mlp.gate_proj": (a.hidden_size, a.intermediate_size),
        "mlp.up_proj": (a.hidden_size, a.intermediate_size),
        "mlp.down_proj": (a.intermediate_size, a.hidden_size),
    }
    out = {f"model.layers.{i}.{n}": s for i in range(a.num_hidden_layers) for n, s in shapes.items()}
    if lm_head:
        out["lm_head"] = (a.hidden_size, a.vocab_size)
    return out


def own_scheme(opts: QuantOptions, bits: int) -> dict:
    """{"bits", "group_size", "sym"} of a tensor given bits of its own (--head-bits, --embed-bits):
    8 bits per row and symmetric (the int8 kernels' layout), 4 in the layers' groups."""
    if bits == 8:
        return {"bits": 8, "group_size": -1, "sym": True}
    return {"bits": bits, "group_size": opts.group_size, "sym": opts.sym}


def head_scheme(opts: QuantOptions) -> dict | None:
    """lm_head's scheme (None: kept 16-bit): the layers' own, or own_scheme of --head-bits."""
    if not opts.lm_head:
        return None
    if opts.head_bits is None or opts.head_bits == opts.bits:
        return {"bits": opts.bits, "group_size": opts.group_size, "sym": opts.sym}
    return own_scheme(opts, opts.head_bits)


def module_schemes(art: Artifact, opts: QuantOptions) -> dict[str, dict | None]:
    """module -> {"bits", "group_size", "sym"} of every tensor the stage may quantize (the linears,
    lm_head, the embedding table); None keeps it as it is. Under --target-bpw: the allocation."""
    if opts.schemes is not None:
        return dict(opts.schemes)
    layers = {"bits": opts.bits, "group_size": opts.group_size, "sym": opts.sym}
    out: dict[str, dict | None] = {name: layers for name in target_linears(art, False)}
    if opts.lm_head or not art.args.tie_word_embeddings:  # tied: the head is the table, unless quantized apart
        out["lm_head"] = head_scheme(opts)
    out[EMBED] = None if opts.embed_bits == 16 else own_scheme(opts, opts.embed_bits)
    return out


def dynamic_overrides(schemes: dict[str, dict | None], opts: QuantOptions) -> dict[str, dict]:
    """GPTQModel's per-module `dynamic` entries for the linears whose scheme is not the default:
    "+:^name$" with the override, "-:^name$" to leave a module unquantized (lm_head by its bare
    name, as transformers' configs write it)."""
    default = {"bits": opts.bits, "group_size": opts.group_size, "sym": opts.sym}
    out: dict[str, dict] = {}
    for name, scheme in sorted(schemes.items()):
        if name == EMBED or scheme == default or (name == "lm_head" and scheme is None):
            continue
        key = "lm_head" if name == "lm_head" else "^" + name.replace(".", r"\.") + "$"
        out[f"-:{key}" if scheme is None else (key if name == "lm_head" else f"+:{key}")] = scheme or {}
    return out


# the options each method uses: the manifest records these and nothing else
USED = {
    "rtn": ("method", "bits", "group_size", "sym", "clip_search", "lm_head", "head_bits", "embed_bits", "target_bpw",
            "calib_stats", "widths"),
    "gptq": ("method", "bits", "group_size", "sym", "desc_act", "damp", "clip_search", "gptq_variant", "lm_head",
             "head_bits", "embed_bits", "calib", "n_samples", "seq_len", "seed", "target_bpw", "calib_stats", "widths"),
    "nf4": ("method", "bits"),
    "int8": ("method", "bits"),
    "fp8": ("method", "bits", "lm_head"),
}


def used_params(opts: QuantOptions) -> dict:
    """The options `opts.method` uses, by name."""
    return {name: getattr(opts, name) for name in USED[opts.method]}
