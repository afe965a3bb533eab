"""The Typer app: each command parses options, calls one core function and hands the result to ui."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from llamactl import __version__, ui
from llamactl.errors import InputError, LlamactlError


class ErrorBoundary(TyperGroup):
    """The one error boundary: known errors become one line and exit 1; usage errors exit 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LlamactlError as e:
            if os.environ.get("LLAMACTL_DEBUG"):
                traceback.print_exc()
            ui.error(e.message, e.hint)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            ui.error("interrupted; nothing was written")
            raise typer.Exit(130)


app = typer.Typer(
    cls=ErrorBoundary,
    name="llamactl",
    help="Quantize, convert, compile, run and measure LLaMA checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _check_device(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise typer.BadParameter(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N")


def _check_dtype(value: str) -> str:
    if value in ("auto", "float32", "bfloat16", "float16"):
        return value
    raise typer.BadParameter(f"{value!r} is not a dtype; use auto, float32, bfloat16 or float16")


# Shared option types.
ModelArg = Annotated[Optional[str], typer.Argument(
    help="Model folder (Hugging Face format, with or without a llamactl manifest). Default: the embedded model.",
    show_default=False)]
ModelReq = Annotated[str, typer.Argument(help="Model folder (Hugging Face format).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.", callback=_check_device)]
DtypeOpt = Annotated[str, typer.Option("--dtype", callback=_check_dtype,
    help="auto, float32, bfloat16 or float16; auto = the checkpoint's on a GPU, float32 on the CPU for small models.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow .bin/.pth weights (loaded with weights_only=True).")]


def _version(value: bool):
    if value:
        typer.echo(f"llamactl {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or timing on stderr.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")] = False,
):
    ui.set_quiet(quiet)


@app.command()
def generate(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text; read from stdin when omitted.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0 = greedy.")] = 0.8,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[Optional[int], typer.Option("--top-k", min=1, help="Sample from the k likeliest tokens.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Random seed; the same seed gives the same text.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    chat: Annotated[bool, typer.Option("--chat", help="Apply the tokenizer's chat template when it has one.")] = False,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the end-of-sequence token.")] = False,
    json_out: JsonOpt = False,
    allow_pickle: PickleOpt = False,
):
    """Generate text, streamed to stdout; timing goes to stderr."""
    from llamactl import generate as gen
    from llamactl.load import load

    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise InputError("no prompt given", "pass --prompt TEXT or pipe the prompt on stdin")
        prompt = sys.stdin.read().rstrip("\n")
        if not prompt:
            raise InputError("no prompt given: stdin was empty", "pass --prompt TEXT or pipe the prompt on stdin")
    art, m, tok, _ = load(model, device, dtype, allow_pickle)
    ids, templated = gen.encode_prompt(tok, prompt, chat)
    if chat and not templated:
        ui.warn(f"{art.path} has no chat template; using the prompt as plain text")
    sampling = gen.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    result = None
    for ev in gen.generate(m, tok, ids, max_new_tokens, sampling, gen.eos_ids(m, tok, art), ignore_eos):
        if isinstance(ev, gen.Result):
            result = ev
        elif not json_out:
            ui.emit_text(ev.text)
    if json_out:
        ui.emit_json({"model": str(art.path), **vars(result)})
        return
    ui.emit_text("\n")
    ui.log(f"[dim]{result.prompt_tokens} prompt tokens, {len(result.token_ids)} generated ({result.stop_reason}) | "
           f"ttft {result.ttft_s * 1000:.1f} ms | prefill {result.prefill_tok_s:.1f} tok/s | "
           f"decode {result.decode_tok_s:.1f} tok/s | peak mem {ui.human_bytes(result.peak_mem_bytes)} "
           f"| {result.device} {result.dtype}[/dim]")


@app.command()
def inspect(model: ModelArg = None, json_out: JsonOpt = False, allow_pickle: PickleOpt = False):
    """Architecture, sizes, KV-cache cost, quantization and lineage of a model folder."""
    from llamactl.artifact import open_artifact
    from llamactl.info import describe
    from llamactl.load import resolve_model_path

    info = describe(open_artifact(resolve_model_path(model), allow_pickle=allow_pickle))
    if json_out:
        ui.emit_json(info)
        return
    q = info["quantization"]
    ui.kv_table(f"{info['path']}", [
        ("architecture", f"{info['architecture']} ({info['attention']})"),
        ("parameters", f"{info['params']:,}"),
        ("layers / hidden / ffn", f"{info['num_hidden_layers']} / {info['hidden_size']} / {info['intermediate_size']}"),
        ("heads / KV heads / head dim", f"{info['num_attention_heads']} / {info['num_key_value_heads']} / {info['head_dim']}"),
        ("vocab / context", f"{info['vocab_size']} / {info['context_length']}"),
        ("rope", f"{info['rope_type']}, theta {info['rope_theta']:g}"),
        ("weights on disk", f"{ui.human_bytes(info['disk_bytes'])} in {info['weight_files']} {info['weight_format']} file(s)"),
        ("weights in memory", ui.human_bytes(info["memory_bytes"])),
        ("KV cache (16-bit)", f"{ui.human_bytes(info['kv_bytes_per_token'])}/token, "
                              f"{ui.human_bytes(info['kv_bytes_at_4k'])} at 4K, {ui.human_bytes(info['kv_bytes_at_32k'])} at 32K"),
        ("quantization", "none" if not q else ", ".join(f"{k}={v}" for k, v in q.items() if not isinstance(v, (dict, list)))),
        ("lineage", " <- ".join(f"{e['stage']} ({e['path']})" for e in info["lineage"]) or "none (plain Hugging Face folder)"),
    ])


def main() -> None:
    app(prog_name="llamactl")
