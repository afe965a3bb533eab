"""`llamactl serve`'s API: real server processes on 127.0.0.1 through real sockets (the embedded trained
model, CPU float32), the official OpenAI SDK and the load-test client against one; limits, keys and
shutdown: tests/serve/test_server_lifecycle.py; the engine alone: tests/serve/test_engine.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from llamactl.runtime import generate as gen  # noqa: E402
from servers import Server, server, stream_events  # noqa: E402, F401 (a fixture)
from test_engine import PROMPTS, reference  # noqa: E402

def test_health_models_and_a_completion(server):
    c = server.client
    assert c.get("/health").json()["status"] == "ok"
    models = c.get("/v1/models").json()
    name = models["data"][0]["id"]
    assert name == "docs-llama-17m" and models["data"][0]["max_model_len"] == 256
    r = c.post("/v1/completions", json={"model": name, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(gen.encode_prompt(_tok(), PROMPTS[0], False)[0])


def test_the_server_says_what_its_warm_up_runs_and_how_long_it_took(server):
    """Before the warm-up (minutes on a GPU's first start) the server says what it runs; the
    serving line says how long it took."""
    warm = next(i for i, line in enumerate(server.lines) if line.startswith("warming up: "))
    serving = next(i for i, line in enumerate(server.lines) if " on http://" in line)
    assert warm < serving and "6 decode steps (1, 2, 4 rows, greedy and sampled)" in server.lines[warm]
    assert re.search(r"warmed up in \d+ s", server.lines[serving]), server.lines[serving]


def _tok():
    from llamactl.folder.artifact import open_artifact, resolve_model_path
    from llamactl.folder.checkpoint import load_tokenizer

    return load_tokenizer(open_artifact(resolve_model_path(None)))


def test_eight_concurrent_requests_streamed_and_whole_equal_generate(server, embedded):
    """Eight at once into 4 slots (some wait), of different lengths; streamed and whole; greedy ones
    equal `llamactl generate`'s text, seeded sampled ones repeat themselves."""
    c = server.client

    def one(i):
        body = {"prompt": PROMPTS[i], "max_tokens": 4 + 3 * i, "temperature": 0 if i < 6 else 0.8, "seed": 7}
        if i % 2:
            events, text = stream_events(c, "/v1/completions", body)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
            return text
        return c.post("/v1/completions", json=body).json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    for i in range(6):
        assert texts[i] == reference(embedded, PROMPTS[i], 4 + 3 * i), i
    with ThreadPoolExecutor(2) as pool:
        again = list(pool.map(one, [6, 7]))
    assert again == texts[6:]


@pytest.mark.slow
def test_a_request_joins_while_another_decodes(server, embedded):
    c = server.client
    first_text: list[str] = []

    def long():
        first_text.append(stream_events(c, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 120, "temperature": 0,
                                                         "ignore_eos": True})[1])

    t = threading.Thread(target=long)
    t.start()
    deadline = time.time() + 60
    while c.get("/health").json()["running"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    r = c.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0}).json()
    joined_while_running = t.is_alive()
    t.join()
    assert joined_while_running
    assert r["choices"][0]["text"] == reference(embedded, PROMPTS[2], 8)
    events = gen.generate(embedded[1], embedded[2], embedded[2](PROMPTS[1]).input_ids, 120, gen.Sampling(temperature=0),
                          set(), True)
    assert first_text[0] == next(e for e in events if isinstance(e, gen.Result)).text


def test_stop_strings_usage_chunk_and_the_embedded_models_chat(server, embedded):
    c = server.client
    full = reference(embedded, PROMPTS[0], 12)
    stop = full[3:6]
    r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == full[: full.index(stop)] and r["choices"][0]["finish_reason"] == "stop"
    events, text = stream_events(c, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                                  "stop": stop, "stream_options": {"include_usage": True}})
    assert text == full[: full.index(stop)]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] <= 12
    # the embedded model has no template of its own: the server gives it the built-in "plain" one
    chat = {"messages": [{"role": "user", "content": "The capital of France is"}], "max_tokens": 8, "temperature": 0}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    _, tok = embedded[0], embedded[2]
    from llamactl.runtime.chat import BUILTIN

    tok.chat_template = BUILTIN["plain"]
    text = tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    assert text == "User: The capital of France is\nAssistant:"
    assert r.json()["usage"]["prompt_tokens"] >= len(tok(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": 3}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"prompt": "word " * 300}, 400, "prompt"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "temperature": True}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "stop_token_ids": [1, "2"]}, 400, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, 400, "response_format"),
    ({"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"prompt": [5, 99999]}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
])
def test_bad_requests_get_a_4xx_json_error_naming_the_field(server, body, status, param):
    c = server.client
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = c.post("/v1/completions", **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert c.get("/health").json()["status"] == "ok"  # and the server keeps serving


def test_unknown_routes_and_methods_are_json_errors(server):
    assert server.client.get("/v2/nothing").json()["error"]["type"] == "not_found_error"
    r = server.client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_metrics_are_prometheus_text(server):
    server.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert server.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -1}).status_code == 400
    text = server.client.get("/metrics").text
    for name in ("llamactl_requests_running", "llamactl_requests_waiting", "llamactl_generation_tokens_total",
                 "llamactl_engine_decode_seconds", "llamactl_engine_prefill_max_seconds",
                 "llamactl_engine_read_wait_seconds", "llamactl_engine_masked_host_seconds",
                 "llamactl_time_to_first_token_seconds_bucket", "llamactl_inter_token_latency_seconds_count",
                 'llamactl_requests_finished_total{finish_reason="length"}', 'llamactl_requests_rejected_total{status="400"}'):
        assert name in text, name
    # the HTTP thread's and the engine thread's CPU seconds: more after they have served more requests
    cpu = lambda text, name: float(next(line.split()[1] for line in text.splitlines()  # noqa: E731
                                        if line.startswith(name + " ")))
    names = ("llamactl_http_thread_cpu_seconds", "llamactl_engine_thread_cpu_seconds")
    before = [cpu(text, n) for n in names]
    for _ in range(3):
        server.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    after = server.client.get("/metrics").text
    assert all(cpu(after, n) > b > 0 for n, b in zip(names, before)), (before, after)
    assert 'llamactl_kv_cache_tokens{dtype="float32"}' in text  # the cache's tokens by what it stores


@pytest.mark.slow
def test_the_load_test_client_against_the_server(server, tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, "-m", "llamactl", "bench", "--url", server.url, "--concurrency", "1,3",
                        "--requests", "3", "--prompt-len", "12", "--gen-len", "6", "--format", "json", "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["env"]["kind"] == "load test" and result["env"]["url"] == server.url
    rows = result["results"]
    assert [row["concurrency"] for row in rows] == [1, 3]
    for row in rows:
        assert row["errors"] == 0 and row["requests"] == 3
        assert row["output_tokens_mean"] == 6 and row["output_tok_s"] > 0 and row["decode_tok_s"] == row["output_tok_s"]
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p95"] <= row["ttft_ms_p99"]
        assert row["itl_ms_p50"] > 0 and row["e2e_s_p50"] > 0 and row["prompt_tokens_mean"] >= 12
        eng = row["engine"]  # the level's share of the step loop's time, from the server's /metrics
        assert eng["decode_rows"] == 3 * 5 and eng["decode_steps"] >= 5 and eng["prefill_tokens"] == 3 * row["prompt_tokens_mean"]
        assert 0 < eng["prefill_seconds"] and 0 < eng["decode_seconds"] < row["duration_s"]
        side = row["server"]  # its mean time to first token (from submit: under the client's), its HTTP thread's CPU
        assert 0 < side["ttft_ms_mean"] <= row["ttft_ms_p95"] and 0 < side["http_cpu_ms_per_request"]
    from llamactl.bench.report import compare, load_report

    diffs, _ = compare(load_report(out), load_report(out), 0.05)  # --compare gates load tests too
    assert len(diffs) == 2
    if find_spec("xgrammar") is not None:  # --request-json: every request constrained (ignore_eos: still ends)
        r = subprocess.run([sys.executable, "-m", "llamactl", "bench", "--url", server.url, "--concurrency", "2",
                            "--requests", "2", "--prompt-len", "8", "--gen-len", "40", "--format", "json", "-o",
                            str(out), "--request-json", '{"guided_choice": ["yes", "no"]}'],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        (row,) = json.loads(out.read_text())["results"]
        assert row["errors"] == 0 and row["output_tokens_mean"] < 40


@pytest.mark.slow
def test_a_load_test_of_traffic_like_requests(server, tmp_path):
    """Length ranges, a shared prefix the server's prefix cache reuses, goodput under targets and
    the cost a million tokens; then a dataset of prompts and chats."""
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, "-m", "llamactl", "bench", "--url", server.url, "--concurrency", "2",
                        "--requests", "6", "--prompt-len", "4:12", "--gen-len", "2:6", "--shared-prefix", "60",
                        "--slo-ttft-ms", "60000", "--slo-itl-ms", "0.001", "--gpu-hourly-cost", "2.5",
                        "--format", "json", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())["results"]
    assert row["prompt_len"] == "4:12" and row["gen_len"] == "2:6" and row["errors"] == 0
    assert 2 <= row["output_tokens_mean"] <= 6 and row["prompt_tokens_mean"] >= 64
    assert row["server"]["prefix_hit_rate"] > 0.5  # the 60 words after the first request: cached blocks
    assert row["goodput_requests_s"] == 0 and row["slo"] == {"ttft_ms": 60000, "itl_ms": 0.001}
    assert row["usd_per_million_output_tokens"] == pytest.approx(2.5 / 3600 * row["duration_s"] / (
        row["output_tokens_mean"] * 6) * 1e6, rel=1e-6)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "The capital of France is"}\n"Hello there"\n'
                    '{"messages": [{"role": "user", "content": "Name a fruit."}]}\n')
    r = subprocess.run([sys.executable, "-m", "llamactl", "bench", "--url", server.url, "--requests", "3",
                        "--concurrency", "3", "--ramp-up", "1.5", "--gen-len", "3", "--dataset", str(data),
                        "--format", "json", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())["results"]
    # the chat went to /v1/chat/completions (the embedded model's built-in template)
    assert row["errors"] == 0 and row["output_tokens_mean"] == 3 and row["dataset"] == str(data)
    assert row["stage"] == "server closed loop, 1.5 s ramp-up" and row["duration_s"] >= 1.0  # the third client at 1 s
    data.write_text('{"text": 1}\n')
    r = subprocess.run([sys.executable, "-m", "llamactl", "bench", "--url", server.url, "--dataset", str(data)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "line 1: no prompt" in r.stderr and "Traceback" not in r.stderr


def test_the_official_openai_sdk_against_the_server(server):
    """The README's requests through OpenAI's own Python SDK: a chat on the embedded model (its
    built-in template), a completion, both streamed too, and a bad request as the SDK's error."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a fruit."}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 8 and chat.choices[0].finish_reason in ("stop", "length")
    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert done.choices[0].text and done.usage.prompt_tokens > 0
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content  # streamed: the same greedy text
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert text == done.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
    assert "temperature" in str(e.value)
    several = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a fruit."}],
                                             max_tokens=8, temperature=0, n=2)
    assert [c.message.content for c in several.choices] == [chat.choices[0].message.content] * 2
    streamed = {}
    for c in client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
                                       n=2, stream=True):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {0: done.choices[0].text, 1: done.choices[0].text}
    scored = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       logprobs=2)
    assert len(scored.choices[0].logprobs.token_logprobs) == 4 and len(scored.choices[0].logprobs.top_logprobs[0]) <= 2
    rated = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a fruit."}],
                                           max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    first = rated.choices[0].logprobs.content[0]
    assert first.logprob <= 0 and len(first.top_logprobs) == 2 and first.top_logprobs[0].logprob == first.logprob


def test_a_server_drafting_with_its_own_int8_copy_answers_as_plain_decoding(server):
    """serve --draft self-int8: the model's round-to-nearest copy made at start drafts for it; the
    greedy completions streamed and whole are the plain server's, and /metrics counts the kept
    proposals. Random weights have no folder to copy: one line."""
    s = Server(["--max-batch", "4", "--max-seq", "256", "--dtype", "float32", "--draft", "self-int8", "--speculate", "3"])
    try:
        assert any("quantizing a round-to-nearest copy" in line for line in s.lines)
        for prompt in PROMPTS[:3]:
            body = {"model": "docs-llama-17m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            want = server.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            assert s.client.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
            assert stream_events(s.client, "/v1/completions", body)[1] == want
        metrics = s.client.get("/metrics").text
        proposed = float(re.search(r"^llamactl_engine_spec_proposed (\S+)", metrics, re.M).group(1))
        accepted = float(re.search(r"^llamactl_engine_spec_accepted (\S+)", metrics, re.M).group(1))
        assert proposed > 0 and accepted >= proposed / 2, metrics
    finally:
        assert s.stop() == 0
    r = subprocess.run([sys.executable, "-m", "llamactl", "serve", "--synthetic", "tiny", "--device", "cpu", "--port", "0",
                        "--draft", "self-int4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "random weights have none" in r.stderr and "Traceback" not in r.stderr
