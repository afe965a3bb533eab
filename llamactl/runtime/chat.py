"""Chat templates: the tokenizer's own, a named built-in, or a Jinja file given by the user
(`--chat-template`), for models that carry none (many base models; the embedded model's
tokenizer_config.json carries "plain", so its children do too). The templates are rendered by
transformers' sandboxed Jinja environment, as a folder's own are."""

from __future__ import annotations

from llamactl.errors import InputError
from llamactl.folder.artifact import user_path

BUILTIN = {
    # "Role: content" lines, then "Assistant:": what a base model continues sensibly
    "plain": ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}Assistant:{% endif %}"),
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
}
MAX_BYTES = 1 << 20


def resolve(spec: str) -> str:
    """A built-in's name, or a Jinja file's path -> the template text; one clear error otherwise."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = user_path(spec)
    if not path.is_file():
        raise InputError(f"--chat-template {spec}: neither a built-in ({', '.join(BUILTIN)}) nor a file",
                         "name a built-in or a Jinja template file")
    if path.stat().st_size > MAX_BYTES:
        raise InputError(f"--chat-template {spec} is over {MAX_BYTES // 1024} KiB", "give a chat template file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--chat-template {spec} cannot be read ({type(e).__name__})", "give a UTF-8 Jinja file") from None


def apply(tokenizer, spec: str | None) -> str | None:
    """Give the tokenizer the chat template `spec` (resolve) where given. Returns what it uses:
    "the model's", a built-in's name, the file's path, or None (no template)."""
    if spec is not None:
        tokenizer.chat_template = resolve(spec)
        return spec
    return "the model's" if getattr(tokenizer, "chat_template", None) else None
