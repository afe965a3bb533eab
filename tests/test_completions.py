"""The committed completion scripts are what the current Typer app generates, and bash's works."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from llamactl.completions import SHELLS, render

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_completion_scripts_are_fresh(shell):
    committed = (ROOT / "completions" / SHELLS[shell]).read_text()
    assert committed == render(shell), f"completions/{SHELLS[shell]} is stale: run python -m llamactl.completions completions"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completion_offers_commands_and_options():
    script = ROOT / "completions" / "llamactl.bash"
    run = lambda words: subprocess.run(  # noqa: E731
        ["bash", "-c", f'source {script}; COMP_WORDS=({words}); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); '
                       '_llamactl; echo "${COMPREPLY[@]}"'], capture_output=True, text=True, check=True).stdout.split()
    assert {"generate", "inspect"} <= set(run("llamactl ''"))
    assert "--max-new-tokens" in run("llamactl generate --max")
    assert run("llamactl quantize m --method ''") == ["rtn", "gptq", "nf4", "int8", "fp8"]  # option values too
    assert run("llamactl bench --mode c") == ["compile"] and run("llamactl compile --mode d") == ["default"]
    assert run("llamactl generate --device c") == ["cpu", "cuda"]


def test_zsh_and_fish_scripts_complete_option_values():
    zsh, fish = render("zsh"), render("fish")
    assert ":value:(fit mean)'" in zsh and "-x -a 'rtn gptq nf4 int8 fp8'" in fish


def test_every_completed_value_is_accepted_by_the_cli():
    """A value the scripts offer must be one the command takes (no drift between the two)."""
    from llamactl.cli.options import check_device, check_dtype, check_quant_inputs
    from llamactl.quantize.options import BITS, GPTQ_VARIANTS

    from llamactl.completions import VALUES

    assert set(VALUES["--method"].split()) == set(BITS) and set(VALUES["--gptq-variant"].split()) == set(GPTQ_VARIANTS)
    for v in VALUES["--quant-inputs"].split():
        assert check_quant_inputs(v) == v
    for v in VALUES["--dtype"].split():
        assert check_dtype(v) == v
    for v in VALUES["--device"].split():
        assert check_device(v) == v
