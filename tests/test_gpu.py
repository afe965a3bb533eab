"""GPU-only checks (run on the GPU machine): decode modes agree with the eager step; the kernels, 8-bit
caches, FP8 layers and tensor parallelism on the GPU; the serving engine's: tests/serve/test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch

from llamactl.folder.artifact import open_artifact
from llamactl.runtime.step import Decoder
from llamactl.runtime.load import load_model
from llamactl.runtime.kv_cache import StaticCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    """The GEMVs at their fixed block sizes, as in the self-check: these tests check what runs, not
    how fast. On a fresh GPU machine the autotuner compiles every candidate of each new shape: 12
    of these tests took over 150 s, and the int8-input generate test after them had not finished
    in 2 more minutes (runs 27-30). Each candidate's product is checked on its own
    (test_kernels.test_every_*_autotune_config_*) and the benches run the tuned launches. (Imported
    by tests/serve/test_engine_gpu.py.)"""
    from llamactl.kernels import gemv

    monkeypatch.setattr(gemv, "FIXED_BLOCKS", True)


def greedy(model, mode: str, n: int = 32, kernels: bool = True, pdl: bool = True) -> list[int]:
    from llamactl.options import RuntimeOptions

    ids = torch.arange(10, 60, device="cuda").view(1, -1)
    dec = Decoder(model, 1, ids.shape[1] + n, mode, options=RuntimeOptions(kernels=kernels, pdl=pdl))
    assert dec.plan.kernels == kernels, dec.plan  # on a GPU they pass their self-check
    tok = dec.prefill(ids)
    out = [int(tok)]
    for i in range(n - 1):
        tok = dec.step(tok, ids.shape[1] + i)
        out.append(int(tok))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_and_compile_match_eager(trained_model, dtype):
    model = load_model(open_artifact(trained_model), torch.device("cuda"), dtype)
    eager = greedy(model, "eager")
    assert greedy(model, "graphs") == eager  # the same kernels, replayed
    compiled = greedy(model, "compile")
    assert compiled[:16] == eager[:16]  # fused kernels round differently; early tokens must agree


@pytest.mark.parametrize("mode,pdl", [("eager", "0"), ("graphs", "0"), ("compile", "0"), ("graphs", "1"), ("compile", "1")])
def test_triton_kernels_decode_like_cublas_and_sdpa(trained_model, mode, pdl):
    """pdl: programmatic dependent launch (RuntimeOptions.pdl), which graphs must keep and which must
    not let a kernel read its input before the kernel writing it has finished."""
    model = load_model(open_artifact(trained_model), torch.device("cuda"), torch.bfloat16)
    plain = greedy(model, "eager", 48, kernels=False)
    fast = greedy(model, mode, 48, kernels=True, pdl=pdl == "1")
    assert fast[:16] == plain[:16]  # different summation order in bf16: early tokens must agree
    assert sum(a == b for a, b in zip(fast, plain)) >= 40


def test_int4_checkpoint_decodes_through_the_triton_kernel(trained_model, tmp_path):
    from typer.testing import CliRunner

    from llamactl.cli.app import app
    from llamactl.layers.int4 import TritonInt4Linear

    out = tmp_path / "rtn4"
    res = CliRunner().invoke(app, ["quantize", str(trained_model), "--method", "rtn", "--bits", "4", "--group-size", "128",
                                   "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    model = load_model(open_artifact(out), torch.device("cuda"), torch.bfloat16)
    assert isinstance(model.model.layers[0].mlp.down_proj, TritonInt4Linear)
    ref = load_model(open_artifact(out), torch.device("cuda"), torch.float32)  # the dequantizing path
    assert not isinstance(ref.model.layers[0].mlp.down_proj, TritonInt4Linear)
    ids = torch.randint(0, 8192, (1, 80), device="cuda")
    caches = [StaticCache.for_model(m, 1, 128) for m in (model, ref)]
    a = model(ids, torch.arange(80, device="cuda"), caches[0])[:, -1].float()  # prefill: dequantize + cuBLAS
    b = ref(ids, torch.arange(80, device="cuda"), caches[1])[:, -1]
    assert ((a - b).norm() / b.norm()) < 3e-2
    nxt = a.argmax(-1, keepdim=True)
    a1 = model(nxt, torch.tensor([80], device="cuda"), caches[0])[:, -1].float()  # decode: the int4 GEMV
    b1 = ref(nxt, torch.tensor([80], device="cuda"), caches[1])[:, -1]
    assert ((a1 - b1).norm() / b1.norm()) < 3e-2


def test_runtime_matches_transformers_on_cuda(trained_model):
    from transformers import AutoModelForCausalLM

    ours = load_model(open_artifact(trained_model), torch.device("cuda"), torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(trained_model), dtype=torch.float32).cuda().eval()
    ids = torch.randint(0, 8192, (2, 100), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(100, device="cuda")), ref(ids).logits, atol=2e-3, rtol=0)


def test_sampling_inside_cuda_graphs_draws_fresh_tokens_each_replay(trained_model):
    from llamactl.runtime.generate import Sampling, generate
    from llamactl.runtime.load import load_tokenizer

    art = open_artifact(trained_model)
    model = load_model(art, torch.device("cuda"), torch.bfloat16)
    tok = load_tokenizer(art)
    prompt = tok("The kernel").input_ids
    runs = []
    for seed in (1, 1, 2):
        events = list(generate(model, tok, prompt, 24, Sampling(temperature=1.0, top_p=0.95, seed=seed), set(),
                               ignore_eos=True, mode="graphs"))
        runs.append(events[-1].token_ids)
    assert runs[0] == runs[1] and runs[0] != runs[2]  # seeded, and the graph's RNG advances
    assert len(set(runs[0])) > 5


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_pipelined_streaming_gives_the_decoders_tokens(trained_model, mode):
    """generate reads token n while the step for token n+1 runs: the tokens must be the Decoder's."""
    from llamactl.runtime.generate import Sampling, generate
    from llamactl.runtime.load import load_tokenizer

    art = open_artifact(trained_model)
    model = load_model(art, torch.device("cuda"), torch.bfloat16)
    tok = load_tokenizer(art)
    prompt = list(range(10, 60))
    events = list(generate(model, tok, prompt, 32, Sampling(temperature=0.0), set(), ignore_eos=True, mode=mode))
    assert events[-1].token_ids == greedy(model, mode)


@pytest.fixture
def rtn4(trained_model, tmp_path):
    """docs-llama-17m quantized to int4 (RTN) through the CLI, on the CPU."""
    from typer.testing import CliRunner

    from llamactl.cli.app import app

    out = tmp_path / "rtn4"
    assert CliRunner().invoke(app, ["quantize", str(trained_model), "--method", "rtn", "--bits", "4", "-o", str(out),
                                    "--device", "cpu", "--eval-tokens", "0"]).exit_code == 0
    return out


def test_generate_with_int8_inputs_on_an_int4_model(rtn4):
    """generate --quant-inputs int8 runs the int4 GEMVs with rounded inputs and reports it; its
    greedy text starts as the float-input one does (docs-llama-17m: KL +0.0004 nats, quant-inputs-kl.txt);
    without the option the int4 GEMVs take int16 inputs (the default), and say so."""
    import json

    from typer.testing import CliRunner

    from llamactl.cli.app import app

    out, run = rtn4, CliRunner().invoke
    res = {}
    for inputs in ("float", "int8", None):
        r = run(app, ["generate", str(out), "-p", "The kernel", "-n", "24", "--temperature", "0", "--device", "cuda",
                      "--dtype", "bfloat16", "--json"] + (["--quant-inputs", inputs] if inputs else []))
        assert r.exit_code == 0, r.output
        res[inputs] = json.loads(r.stdout)
    assert "int8 inputs" in res["int8"]["extra"]["gemv"] and "int8 inputs" not in res["float"]["extra"]["gemv"]
    assert "int16 inputs" in res[None]["extra"]["gemv"] and "int16 inputs" not in res["float"]["extra"]["gemv"]
    assert res["int8"]["token_ids"][:8] == res["float"]["token_ids"][:8]
    assert res[None]["token_ids"][:16] == res["float"]["token_ids"][:16]


def test_bench_scores_int8_fp16_and_int16_input_rows_through_the_decode_step(rtn4):
    """bench --quality --quant-inputs float,int8,fp16,int16: the float row is scored by prefill,
    the others through the decode step's GEMVs; rounding the inputs to int8 costs a little KL, not
    much; packed fp16 arithmetic (x exact) and int16 inputs next to nothing."""
    import json

    from typer.testing import CliRunner

    from llamactl.cli.app import app

    r = CliRunner().invoke(app, ["bench", str(rtn4), "--device", "cuda", "--dtype", "bfloat16", "--quality",
                                 "--eval-tokens", "2048", "--quant-inputs", "float,int8,fp16,int16", "--prompt-len", "16",
                                 "--gen-len", "8", "--warmup", "0", "--repeat", "1", "--format", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["results"]
    labels = ("int8 inputs", "fp16 arithmetic", "int16 inputs")
    ends = [[label for label in labels if x["stage"].endswith(label)] for x in rows]
    assert ends == [[], ["int8 inputs"], ["fp16 arithmetic"], ["int16 inputs"]]
    qf, q8, q16, qi16 = (x["quality"] for x in rows)
    print({x["stage"]: {k: x["quality"][k] for k in ("kl_mean", "ppl", "top1_agreement", "tokens")} for x in rows})
    assert (qf["scored"], q8["scored"], q16["scored"], qi16["scored"]) == (
        "prefill", "decode steps, int8 inputs", "decode steps, fp16 arithmetic", "decode steps, int16 inputs")
    assert q8["tokens"] == q16["tokens"] == qi16["tokens"] == qf["tokens"]
    assert 0 < qf["kl_mean"] and q8["kl_mean"] < qf["kl_mean"] * 1.5 + 0.01
    assert abs(q16["kl_mean"] - qf["kl_mean"]) < 0.05 * qf["kl_mean"] + 1e-3
    assert abs(qi16["kl_mean"] - qf["kl_mean"]) < 0.05 * qf["kl_mean"] + 1e-3

@pytest.mark.parametrize("weights", ["bf16", "int4"])
@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_rows_at_their_own_positions_on_the_gpu(trained_model, mode, weights, request):
    """Each row of a batch at its own position (SDPA and cuBLAS or the int4 split-K kernel for
    B > 1) against each alone (llamactl's batch-1 kernels): greedy tokens agree within bf16's
    rounding."""
    folder = trained_model if weights == "bf16" else request.getfixturevalue("rtn4")
    model = load_model(open_artifact(folder), torch.device("cuda"), torch.bfloat16)
    prompts = [torch.arange(10, 15, device="cuda"), torch.arange(100, 109, device="cuda"),
               torch.arange(300, 313, device="cuda")]
    n = 8

    from conftest import greedy_alone

    want = [greedy_alone(model, p, n, mode) for p in prompts]
    with torch.inference_mode():
        dec = Decoder(model, 3, 40, mode)
        toks = torch.cat([dec.prefill(p.view(1, -1), slot=r) for r, p in enumerate(prompts)])
        pos = torch.tensor([p.numel() for p in prompts], device="cuda")
        got = []
        for _ in range(n):
            got.append(toks.tolist())
            toks = dec.step(toks, pos).clone()
            pos = pos + 1
    got = [list(col) for col in zip(*got)]
    for g, w in zip(got, want):
        assert g[:3] == w[:3] and sum(a == b for a, b in zip(g, w)) >= n - 2, (g, w)


def test_graphs_sharing_a_pool_reuse_what_each_capture_freed():
    """runtime.graphs.capture: graphs captured into one pool (on one stream) hold about one
    capture's temporaries between them, not one each; and each replays its own result."""
    from llamactl.runtime.graphs import capture

    pool = torch.cuda.graph_pool_handle()
    x = torch.ones(64 << 20, device="cuda")  # 256 MiB of float32

    def fn(scale):
        tmp = x * scale  # a 256 MiB temporary, freed at the end of the capture
        return tmp.sum()

    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    graphs = [capture(fn, (float(i + 1),), pool) for i in range(4)]
    torch.cuda.synchronize()
    grew = torch.cuda.memory_reserved() - before
    # one capture's temporary in the pool and one eager run's in the stream's cache (a stream and
    # a pool each per capture held eight)
    assert grew < 3 * (256 << 20), grew
    for i, (graph, out) in enumerate(graphs):
        graph.replay()
        assert out.item() == (i + 1) * x.numel()


def test_int4_layers_with_a_short_last_group_run_the_triton_kernels(tmp_path):
    """192-wide layers in groups of 128 (a short last group, issue 26): the Triton int4 layers pad
    it, at one row (GEMV), a few (multirow) and a prefill (dequantize + cuBLAS)."""
    from typer.testing import CliRunner

    from conftest import make_hf_model
    from llamactl.cli.app import app
    from llamactl.layers.int4 import TritonInt4Linear

    src = make_hf_model(tmp_path / "w192", hidden=192, heads=4, kv_heads=2, seed=3)
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(src), "--method", "rtn", "--group-size", "128", "-o", str(out),
                                   "--device", "cpu", "--eval-tokens", "0"])
    assert res.exit_code == 0, res.output
    fast = load_model(open_artifact(out), torch.device("cuda"), torch.bfloat16)
    ref = load_model(open_artifact(out), torch.device("cuda"), torch.float32)
    assert any(isinstance(m, TritonInt4Linear) and m.pad for m in fast.modules())
    for rows in (1, 4, 40, 100):
        x = torch.randn(rows, 192, device="cuda")
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            a = fast.model.layers[0].get_submodule(name)
            b = ref.model.layers[0].get_submodule(name)
            if a.in_features != 192:
                continue
            y, want = a(x.to(torch.bfloat16)).float(), b(x)
            assert ((y - want).norm() / want.norm()) < 2e-2, (name, rows)


def test_an_nccl_all_reduce_is_captured_in_the_decode_graph(trained_model, monkeypatch):
    """Tensor parallelism's decode step stays one CUDA graph with its all-reduces inside (issue 22):
    a one-process NCCL group (the only one a one-GPU machine has) on every row-parallel layer; the
    graph replays give the eager step's greedy tokens, and the all-reduces are called as often for
    32 tokens as for 8 (prefill, warm-up and capture): the replays call none of them."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        model = load_model(open_artifact(trained_model), torch.device("cuda"), torch.bfloat16)
        ref = greedy(model, "eager")
        for layer in model.model.layers:
            layer.self_attn.tp_group = layer.mlp.tp_group = dist.group.WORLD
        calls = []
        for n in (8, 32):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                got = greedy(model, "graphs", n=n)
            assert got == ref[:n]
            calls.append(sum("all_reduce" in e.name for e in prof.events()))
        assert calls[0] == calls[1] > 0, calls
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_give_the_greedy_tokens_of_one(trained_model):
    """--tp 2 over NCCL (issue 23): `generate` on two GPUs against one, bf16, greedy. The
    all-reduce sums the two halves of each row-parallel product in another order than one GPU's
    product does, so tokens may part after a near tie: the first 16 must agree, and the agreement
    of all 48 is printed for the record."""
    import json
    import subprocess
    import sys

    def run(*extra: str) -> list[int]:
        argv = [sys.executable, "-m", "llamactl", "generate", str(trained_model), "-p", "The kernel schedules",
                "-n", "48", "--temperature", "0", "--device", "cuda", "--dtype", "bfloat16", "--json", *extra]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)["token_ids"]

    one, two = run(), run("--tp", "2")
    agree = sum(a == b for a, b in zip(one, two))
    print(f"--tp 2 against --tp 1: {agree} of {len(one)} greedy tokens agree")
    assert two[:16] == one[:16] and len(two) == len(one)


def test_fp8_layers_on_the_gpu_match_their_dequantized_products():
    """FP8 weights on the GPU: one row through the GEMV (the weights as they are), rows through
    torch._scaled_mm with per-token scales where the GPU has FP8, against float64 products of the
    dequantized weights and (rows) the per-token-rounded activations."""
    from llamactl.layers.fp8 import FP8Linear, fp8_matmul, quantize_rows, use_fp8_kernels
    from llamactl.layers.fp8 import quantize_fp8

    torch.manual_seed(0)
    with torch.device("meta"):
        lin = FP8Linear(4096, 1024, False)
    lin.weight, lin.weight_scale = quantize_fp8(torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16))
    use_fp8_kernels(lin)
    lin.gemv = True
    assert lin.scaled_mm == fp8_matmul(torch.cuda.current_device())
    w = lin.weight.double() * lin.weight_scale.double()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    one = lin(x[:1]).double()
    ref = x[:1].double() @ w.t()
    assert ((one - ref).norm() / ref.norm()) < 1e-2
    xq, xs = quantize_rows(x)
    ref = (xq.double() * xs.double()) @ w.t()
    assert ((lin(x).double() - ref).norm() / ref.norm()) < 1e-2
    assert lin.product(64) == ("fp8 scaled_mm (cuBLASLt)" if lin.scaled_mm else "fp8 dequantized per call")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_an_8bit_kv_cache_decodes_on_the_gpu_through_graphs(trained_model, kv_dtype):
    """The trained model in bf16 with an 8-bit cache: the CUDA-graph steps (the kernels' quantizing
    write and 8-bit reads) give the eager steps' greedy tokens, and mostly the 16-bit cache's."""
    from llamactl.options import RuntimeOptions

    model = load_model(open_artifact(trained_model), torch.device("cuda"), torch.bfloat16)

    def run(mode: str, kv: str) -> list[int]:
        ids = torch.arange(10, 60, device="cuda").view(1, -1)
        dec = Decoder(model, 1, ids.shape[1] + 32, mode, options=RuntimeOptions(kv_dtype=kv))
        assert dec.cache.fmt.name == ("bfloat16" if kv == "auto" else kv)
        tok = dec.prefill(ids)
        out = [int(tok)]
        for i in range(31):
            tok = dec.step(tok, ids.shape[1] + i)
            out.append(int(tok))
        return out

    graphs, eager, sixteen = run("graphs", kv_dtype), run("eager", kv_dtype), run("graphs", "auto")
    assert graphs == eager
    assert sum(a == b for a, b in zip(graphs, sixteen)) >= 24, (graphs, sixteen)


@pytest.mark.parametrize("fold", ["norm", "glu"])
def test_fp8_layers_fold_the_rmsnorm_and_swiglu_on_the_gpu(fold):
    """An FP8 layer with the RMSNorm before it or SwiGLU on its input folded in (FusedIO's norm,
    glu), one row through the GEMV and 64 through the quantizing kernel and scaled_mm, against the
    same layer with the step applied by PyTorch first, plus a residual."""
    from llamactl.layers.fp8 import FP8Linear, quantize_fp8, use_fp8_kernels
    from llamactl.runtime.model import RMSNorm

    torch.manual_seed(1)
    with torch.device("meta"):
        lin, plain = FP8Linear(4096, 1024, False), FP8Linear(4096, 1024, False)
    lin.weight, lin.weight_scale = quantize_fp8(torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16))
    plain.weight, plain.weight_scale = lin.weight, lin.weight_scale
    for m in (lin, plain):
        use_fp8_kernels(m)
        m.gemv = True
    norm = RMSNorm(4096, 1e-5).to("cuda", torch.bfloat16)
    norm.weight.data = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    if fold == "norm":
        lin.norm = norm
    else:
        lin.glu = True
    x = torch.randn(64, 8192 if fold == "glu" else 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    step = norm(x) if fold == "norm" else torch.nn.functional.silu(x[:, :4096]) * x[:, 4096:]
    with torch.no_grad():
        for rows in (1, 64):
            got, want = lin(x[:rows], residual[:rows]).float(), plain(step[:rows], residual[:rows]).float()
            assert ((got - want).norm() / (want - residual[:rows].float()).norm()) < 3e-2, rows


