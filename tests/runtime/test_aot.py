"""The greedy CPU decode step compiled ahead of time (llamactl.runtime.aot, Decoder mode "aot")."""

from __future__ import annotations

import pytest
import torch

from llamactl.errors import InputError
from llamactl.runtime.settings import Sampling


@pytest.mark.parametrize("fixture", ["tiny_gqa", "tiny_mha"])
@pytest.mark.slow
def test_aot_steps_give_the_eager_tokens_and_share_the_cache(fixture, request):
    """Two rows of a GQA model (and of a tied-embedding MHA one) whose decoder layers run llamactl's CPU int4 layers (when they load
    here) and its head torch's: the prefill (PyTorch) writes the cache the compiled steps read, and
    the steps give the eager steps' tokens (float32)."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.layers.cpu import quant_fast
    from llamactl.runtime.load import load_model
    from llamactl.layers.rtn import quantize_linears_planes

    model = load_model(open_artifact(request.getfixturevalue(fixture)), torch.device("cpu"), torch.float32)
    quantize_linears_planes(model, 4, 32, False, cpu=quant_fast())
    prompt = torch.tensor([[10, 11, 12, 13, 14, 15, 16], [3, 9, 27, 81, 243, 729, 2187]])

    def run(mode: str) -> list[list[int]]:
        dec = Decoder(model, 2, 24, mode)
        tok = dec.prefill(prompt)
        out = [tok.tolist()]
        for i in range(5):
            tok = dec.step(tok, prompt.shape[1] + i)
            out.append(tok.tolist())
        return out

    with torch.inference_mode():
        assert run("aot") == run("eager")


def test_aot_is_for_greedy_cpu_steps_of_one_batch(tiny_gqa):
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.runtime.load import load_model
    from llamactl.runtime.sampling import RowSampling

    model = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    with pytest.raises(InputError, match="greedy decoding on the CPU"):
        Decoder(model, 1, 24, "aot", sample=lambda logits: logits.argmax(-1))
    with pytest.raises(InputError, match="greedy decoding on the CPU"):
        Decoder(model, 2, 24, "aot", rows=RowSampling.make([Sampling(temperature=0)] * 2, "cpu"))


@pytest.mark.slow
def test_generate_aot_writes_the_eager_text(tiny_gqa):
    """`generate --aot` (greedy, CPU) writes the text of plain `generate`; with sampling it is one
    line and exit 1."""
    from typer.testing import CliRunner

    from llamactl.cli.app import app

    runner = CliRunner()
    args = ["generate", str(tiny_gqa), "-p", "The kernel", "-n", "8", "--temperature", "0", "--device", "cpu",
            "--dtype", "float32"]
    plain = runner.invoke(app, args)
    aot = runner.invoke(app, [*args, "--aot"])
    assert plain.exit_code == 0 and aot.exit_code == 0, aot.output
    assert aot.stdout == plain.stdout and ("(built)" in aot.stderr or "(loaded)" in aot.stderr)
    sampled = runner.invoke(app, [*args[:-4], "--temperature", "0.8", "--device", "cpu", "--aot"])
    assert sampled.exit_code == 1 and "greedy decoding on the CPU" in sampled.output and "Traceback" not in sampled.output


@pytest.mark.slow
def test_the_built_step_is_cached_and_signed(tiny_gqa, tmp_path, monkeypatch):
    """A second step of the same structure (another process would be the same) loads the library
    from the user's cache and gives the same tokens; a library whose signature does not match is
    not loaded."""
    from llamactl.runtime import aot
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.runtime.load import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    prompt = torch.tensor([[5, 6, 7, 8]])

    def run():
        dec = Decoder(model, 1, 16, "aot")
        tok = dec.prefill(prompt)
        out = [int(tok)]
        for i in range(3):
            tok = dec.step(tok, prompt.shape[1] + i)
            out.append(int(tok))
        return out, dec.aot_cached

    with torch.inference_mode():
        first, cached_first = run()
        second, cached_second = run()
    assert (cached_first, cached_second) == (False, True) and first == second
    (lib,) = (tmp_path / "llamactl" / "aot").glob("step-*.pt2")
    assert aot._verified(lib)
    lib.with_suffix(".json").write_text('{"signature": "0000"}')
    assert not aot._verified(lib)
