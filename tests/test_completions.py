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
