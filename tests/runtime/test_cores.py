"""The cores a process may use: affinity capped by a cgroup quota (v2 and v1 files)."""

from __future__ import annotations

import os

from llamactl.runtime import cores


def test_a_v2_quota_caps_the_affinity(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cores.quota(tmp_path) == 1.5
    assert cores.usable(tmp_path) == min(len(os.sched_getaffinity(0)), 2)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cores.quota(tmp_path) is None and cores.usable(tmp_path) == len(os.sched_getaffinity(0))


def test_a_v1_quota_and_none(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cores.usable(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cores.quota(tmp_path) is None
    assert cores.quota(tmp_path / "absent") is None


def test_omp_num_threads_is_left_alone(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert cores.set_torch_threads() == before
    finally:
        torch.set_num_threads(before)


def test_the_cli_starts_without_torch_and_torch_then_takes_the_usable_cores():
    """`llamactl --help` imports no torch; a command that imports it later gets usable() threads
    (OMP_NUM_THREADS set before, unless the user set it)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = ("import sys\nfrom llamactl.cli.app import main\nsys.argv = ['llamactl', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch at start'\n"
            "import torch\nfrom llamactl.runtime.cores import usable\n"
            "assert torch.get_num_threads() == usable(), (torch.get_num_threads(), usable())\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-500:]
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", code.replace("usable()", "1")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-500:]
