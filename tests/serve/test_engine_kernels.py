"""The serving engine's decode steps through llamactl's Triton kernels (the paged split-KV decode
attention with its folded RoPE and cache write, the GEMVs), run on the CPU by Triton's
interpreter: the path a GPU server takes, which the other engine tests (torch's ops) do not."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # the interpreter runs every kernel launch in Python: 30-40 s in all

from llamactl.runtime.settings import Sampling  # noqa: E402


@pytest.fixture
def kernels_on_the_cpu(monkeypatch):
    """plan.prepare routes through llamactl's kernels on the CPU (Triton's interpreter), and packed
    prefills and mixed steps through the Triton prefill kernel (runtime.ragged.kernels) when it does."""
    from llamactl.layers import plan
    from llamactl.runtime import model, ragged

    run = plan.kernels_run
    monkeypatch.setattr(plan, "kernels_run", lambda device, options, interpreter=False: run(device, options, True))
    def attend(q, *a, **kw):
        PACKED[0] += KERNELS[0]
        return (ragged.kernels if KERNELS[0] else ragged.attend)(q, *a, **kw)

    monkeypatch.setattr(model, "attend", attend)


KERNELS = [False]  # whether the running engine's model runs the kernels
PACKED = [0]  # packed forwards' layers through the Triton prefill kernel


def _tokens(model, requests, kernels: bool, kv_dtype: str, speculate=(0, 0)) -> tuple[list[list[int]], str]:
    """requests: [(prompt ids, new tokens)] submitted together -> (each one's greedy tokens, the
    attention the decode steps ran). speculate: the engine's (proposals, rows)."""
    from llamactl.options import RuntimeOptions
    from llamactl.serve.engine import Engine, Params

    KERNELS[0] = kernels
    # the GPU's ways: decode rows in the prefill forwards, each step launched before the last is read
    eng = Engine(model, {2}, max_batch=2, max_queue=8, max_seq=64, prefill_chunk=8, mix=True, overlap=True,
                 speculate=speculate, options=RuntimeOptions(kernels=kernels, kv_dtype=kv_dtype))
    eng.scheduler.batch_prefill = True  # (a GPU's: prompt chunks packed in one forward)
    eng.start()
    out: list[list[int]] = [[] for _ in requests]
    reqs = [eng.submit(ids, Params(n, Sampling(temperature=0.0), ignore_eos=True),
                       lambda ev, i=i: ev.kind == "token" and out[i].append(ev.token))
            for i, (ids, n) in enumerate(requests)]
    try:
        deadline = time.time() + 300
        while not all(r.finished for r in reqs) and time.time() < deadline:
            time.sleep(0.01)
        assert eng.failure is None, eng.failure
        assert all(r.finished for r in reqs), "the engine did not finish"
        assert (eng.times.spec_proposed > 0) == (speculate != (0, 0))
    finally:
        eng.stop()
    return out, model.model.layers[0].self_attn.decode_kernel


@pytest.fixture(scope="module")
def tiny_fp8(tiny_gqa, tmp_path_factory):
    """tiny_gqa quantized to FP8 (quantize --method fp8)."""
    from typer.testing import CliRunner

    from llamactl.cli.app import app

    out = tmp_path_factory.mktemp("fp8") / "child"
    r = CliRunner().invoke(app, ["quantize", str(tiny_gqa), "-o", str(out), "--method", "fp8", "--eval-tokens", "0"])
    assert r.exit_code == 0, r.output
    return out


# a prompt that repeats itself, so that prompt lookup proposes tokens where a case speculates
REQUESTS = [([5, 6, 7, 8, 9], 6), ([10, 11, 12], 9), ([13, 14, 15, 16, 13, 14, 15, 16, 13, 14], 7)]


@pytest.mark.parametrize("case", ["16-bit cache", "int8 cache", "fp8 weights", "speculating"])
def test_the_engine_decodes_through_the_kernels_as_through_torch(tiny_gqa, tiny_fp8, kernels_on_the_cpu, case,
                                                                 monkeypatch):
    """Three requests over two rows (one waits and joins later; rows at their own positions) give
    the same greedy tokens through the kernels as through torch's ops (float32 random weights):
    the cache in the model's dtype or in int8, FP8 weights (one row on the FP8 GEMV), and steps
    that check prompt-lookup proposals (against torch's steps without them)."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.load import load_model

    folder = tiny_fp8 if case == "fp8 weights" else tiny_gqa
    model = load_model(open_artifact(folder), torch.device("cpu"), torch.float32)
    kv_dtype = "int8" if case == "int8 cache" else "auto"
    monkeypatch.setattr("llamactl.serve.scheduler.SPEC_REST", 1)  # a row proposes again a token after it found none
    PACKED[0] = 0
    got, attention = _tokens(model, REQUESTS, True, kv_dtype, (3, 2) if case == "speculating" else (0, 0))
    assert attention == "rope" and PACKED[0] > 0
    ref, attention = _tokens(model, REQUESTS, False, kv_dtype)
    assert attention != "rope"
    assert [len(t) for t in got] == [n for _, n in REQUESTS]
    assert got == ref
