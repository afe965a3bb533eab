"""What a quantized folder's config says of its modules (quantization_config): each module's bits
and group, the embedding table's scheme, labels for people. Read by the loader, `inspect` and the
quantize stage."""

from __future__ import annotations

EMBED = "model.embed_tokens"


def scheme_label(scheme: dict | None) -> str:
    """"4-bit g128", "8-bit per row", "16-bit" (None: kept as it is)."""
    if scheme is None:
        return "16-bit"
    g = scheme["group_size"]
    return f"{scheme['bits']}-bit " + ("per row" if g == -1 else f"g{g}")


def module_scheme(q: dict, name: str, bits: int, group: int) -> tuple[int, int]:
    """(bits, group size) of one module: GPTQModel's per-module overrides (quantization_config's
    `dynamic`: regular expressions, "+:" or bare to override, first match wins) over the defaults."""
    import re

    for pattern, override in (q.get("dynamic") or {}).items():
        if pattern.startswith("-:"):
            continue  # modules left unquantized carry no .qweight, so they are not named here
        if re.match(pattern.removeprefix("+:"), name) and isinstance(override, dict):
            return int(override.get("bits", bits)), int(override.get("group_size", group))
    return bits, group


def embedding_scheme_of(q: dict) -> dict | None:
    """quantization_config's scheme of a low-bit embedding table (quantize --embed-bits), or None."""
    return (q.get("meta") or {}).get("embed_tokens")
