"""`llamactl serve`: real server processes on 127.0.0.1 through real sockets (the embedded trained
model, CPU float32), and the load-test client against one; the engine alone: tests/serve/test_engine.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from llamactl.runtime import generate as gen  # noqa: E402
from test_engine import PROMPTS, reference  # noqa: E402

# -- real server processes -------------------------------------------------------------------------

class Server:
    def __init__(self, args: list[str], env: dict | None = None):
        cmd = [sys.executable, "-m", "llamactl", "serve", "--port", "0", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if " on http://" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(300)
        line = next((l for l in self.lines if " on http://" in l), None)
        assert line, "".join(self.lines)
        self.url = line.split(" on ")[1].split()[0]
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def server():
    s = Server(["--max-batch", "4", "--max-queue", "8", "--max-seq", "256", "--dtype", "float32"])  # exact: as the reference
    yield s
    assert s.stop() == 0


def _stream(client, path: str, body: dict) -> tuple[list[dict], str]:
    """A streamed request -> (its event objects, the text they carry)."""
    events, text = [], ""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    events.append("[DONE]")
                    break
                ev = json.loads(line[6:])
                events.append(ev)
                for c in ev.get("choices", []):
                    text += c.get("text") or c.get("delta", {}).get("content") or ""
    return events, text


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
            events, text = _stream(c, "/v1/completions", body)
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


def test_a_request_joins_while_another_decodes(server, embedded):
    c = server.client
    first_text: list[str] = []

    def long():
        first_text.append(_stream(c, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 120, "temperature": 0,
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
    events, text = _stream(c, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
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


def test_n_choices_greedy_equal_sampled_each_its_own_seed_streamed_and_whole(server):
    """n: greedy choices are the same text; sampled ones (seed s) differ, and choice i is what a
    request of its own with seed s + i gives; the choices after the first find the prompt's KV
    blocks cached (prefix hits, not prefills); streamed, each choice's chunks carry its index and
    end with its finish reason; usage counts every choice's tokens."""
    c = server.client
    body = {"prompt": PROMPTS[1], "max_tokens": 8}
    r = c.post("/v1/completions", json=body | {"n": 4, "temperature": 0}).json()
    texts = [ch["text"] for ch in r["choices"]]
    assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3] and len(set(texts)) == 1
    assert r["usage"]["completion_tokens"] == 4 * 8
    r = c.post("/v1/completions", json=body | {"n": 3, "temperature": 1.0, "seed": 11, "best_of": 3}).json()
    texts = [ch["text"] for ch in r["choices"]]
    assert len(set(texts)) > 1, texts
    for i, t in enumerate(texts):
        alone = c.post("/v1/completions", json=body | {"temperature": 1.0, "seed": 11 + i}).json()
        assert alone["choices"][0]["text"] == t, i
    hits = lambda: float(next(line.split()[1] for line in c.get("/metrics").text.splitlines()  # noqa: E731
                              if line.startswith("llamactl_prefix_cache_hit_tokens ")))
    before, prompt = hits(), list(range(100, 164))  # 64 tokens: whole blocks
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": 3, "temperature": 0})
    assert r.status_code == 200 and hits() - before >= 2 * 48  # choices 1 and 2 found the prompt's blocks cached
    events, _ = _stream(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                    "n": 2, "temperature": 1.0, "seed": 3})
    chunks = [e for e in events if e != "[DONE]"]
    for i in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        assert mine[0]["delta"].get("role") == "assistant" and mine[-1]["finish_reason"] in ("length", "stop")


def test_logprobs_in_openais_shapes_streamed_and_whole(server):
    """Completions' logprobs (tokens, token_logprobs, top_logprobs, text_offset) and chats'
    (content: token, logprob, bytes, top_logprobs), whole and streamed alike; greedy tokens are
    their own likeliest alternative; none where none were asked for."""
    c = server.client
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}
    r = c.post("/v1/completions", json=body | {"logprobs": 3}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    for chosen, tops in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert len(tops) <= 3 and chosen <= 0 and abs(max(tops.values()) - chosen) < 1e-6
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    events, _ = _stream(c, "/v1/completions", body | {"logprobs": 3})
    streamed = [v for e in events if e != "[DONE]" and e["choices"][0]["logprobs"]
                for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    assert c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"] is None
    chat = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 4, "temperature": 0}
    r = c.post("/v1/chat/completions", json=chat | {"logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for e in content:
        assert e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    r = c.post("/v1/chat/completions", json=chat | {"top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_a_logit_bias_and_penalties_through_http(server):
    """logit_bias {id: 100} makes that token every token; penalties change a greedy text (the
    exact values: tests/serve/test_engine.py)."""
    c = server.client
    tid = _tok()(" the", add_special_tokens=False).input_ids[-1]
    body = {"prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = c.post("/v1/completions", json=body | {"logit_bias": {str(tid): 100}, "logprobs": 0}).json()
    assert r["choices"][0]["logprobs"]["tokens"] == [_tok().decode([tid])] * 5
    plain = c.post("/v1/completions", json=body | {"max_tokens": 24}).json()["choices"][0]["text"]
    tamed = c.post("/v1/completions", json=body | {"max_tokens": 24, "repetition_penalty": 1.8,
                                                   "frequency_penalty": 2.0}).json()
    assert tamed["choices"][0]["text"] != plain


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def _is_person(text: str) -> bool:
    v = json.loads(text)
    return (set(v) == {"name", "age", "pets"} and isinstance(v["name"], str) and len(v["name"]) <= 12
            and isinstance(v["age"], int) and 0 <= v["age"] <= 120 and len(v["pets"]) <= 3
            and all(p in ("cat", "dog") for p in v["pets"]))


def test_structured_output_follows_the_schema_streamed_and_whole(server):
    """response_format json_schema (greedy and sampled, whole and streamed), json_object, vLLM's
    guided_choice and guided_regex: the embedded model's output parses and validates each time;
    a schema that does not compile and two asks at once are 400s naming the field."""
    pytest.importorskip("xgrammar")
    c = server.client
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = {"messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 80, "response_format": fmt}
    for body in (chat | {"temperature": 0}, chat | {"temperature": 1.0, "seed": 5, "n": 2}):
        r = c.post("/v1/chat/completions", json=body).json()
        for choice in r["choices"]:
            assert choice["finish_reason"] == "stop" and _is_person(choice["message"]["content"]), choice
    _, text = _stream(c, "/v1/chat/completions", chat | {"temperature": 0.7, "seed": 2})
    assert _is_person(text)
    r = c.post("/v1/completions", json={"prompt": "Data:", "max_tokens": 60, "temperature": 0.9, "seed": 1,
                                        "response_format": {"type": "json_object"}}).json()
    assert isinstance(json.loads(r["choices"][0]["text"]), dict)
    for seed in range(3):
        r = c.post("/v1/completions", json={"prompt": "The answer is", "max_tokens": 8, "temperature": 1.0,
                                            "seed": seed, "guided_choice": ["yes", "no", "not sure"]}).json()
        assert r["choices"][0]["text"] in ("yes", "no", "not sure")
    r = c.post("/v1/completions", json={"prompt": "Code:", "max_tokens": 8, "temperature": 1.0, "seed": 4,
                                        "guided_regex": "[A-Z]{2}-[0-9]{3}"}).json()
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r["choices"][0]["text"])
    bad = c.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
    both = c.post("/v1/completions", json={"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]})
    assert both.status_code == 400


def test_echo_gives_the_prompt_first_with_its_log_probabilities(server):
    """echo: the prompt's text before the completion's; with logprobs, its tokens' too (the first
    without a value, as OpenAI's), computed by the prefill; streamed alike; not for chats."""
    c = server.client
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    plain = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert c.post("/v1/completions", json=body | {"echo": True}).json()["choices"][0]["text"] == PROMPTS[0] + plain
    r = c.post("/v1/completions", json=body | {"echo": True, "logprobs": 1}).json()
    lp, n = r["choices"][0]["logprobs"], len(gen.encode_prompt(_tok(), PROMPTS[0], False)[0])
    assert r["choices"][0]["text"] == PROMPTS[0] + plain and len(lp["tokens"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    events, text = _stream(c, "/v1/completions", body | {"echo": True, "logprobs": 1})
    streamed = [v for e in events if e != "[DONE]" and e["choices"][0]["logprobs"]
                for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert text == PROMPTS[0] + plain and streamed == lp["token_logprobs"]
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_stop_token_ids_end_a_choice_before_that_token(server):
    c = server.client
    ids = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}).json()
    full = ids["choices"][0]["text"]
    tok = _tok()
    first = tok(full, add_special_tokens=False).input_ids  # the greedy tokens, as text re-tokenized
    r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
                                        "stop_token_ids": [first[2]]}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and full.startswith(choice["text"]) and len(choice["text"]) < len(full)


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
                 "llamactl_time_to_first_token_seconds_bucket", "llamactl_inter_token_latency_seconds_count",
                 'llamactl_requests_finished_total{finish_reason="length"}', 'llamactl_requests_rejected_total{status="400"}'):
        assert name in text, name
    # the HTTP thread's CPU seconds: more after it has answered more requests
    cpu = lambda text: float(next(line.split()[1] for line in text.splitlines()  # noqa: E731
                                  if line.startswith("llamactl_http_thread_cpu_seconds ")))
    before = cpu(text)
    for _ in range(3):
        server.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert cpu(server.client.get("/metrics").text) > before > 0


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


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A tiny random model with a 4096-token context (requests that run for seconds) and a chat template."""
    from conftest import make_hf_model

    folder = make_hf_model(tmp_path_factory.mktemp("long") / "tiny-chat", kv_heads=2, max_pos=4096)
    cfg = folder / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    cfg.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def small_server(long_model):
    """One slot, one queue place, an API key from the environment, an 8-bit KV cache."""
    s = Server([str(long_model), "--max-batch", "1", "--max-queue", "1", "--kv-dtype", "int8"],
               env={"LLAMACTL_API_KEY": "k3y"})
    s.client.headers["Authorization"] = "Bearer k3y"
    yield s
    s.stop()


TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 8}},
                                               "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def test_tool_calls_required_named_and_auto_whole_and_streamed(small_server):
    """tools with tool_choice required or a named function: the output is a call, returned as
    OpenAI's tool_calls (finish_reason tool_calls; streamed as one delta), its arguments valid for
    the function's parameters; none renders no tools; a tools request to completions is a 400."""
    pytest.importorskip("xgrammar")
    c = small_server.client
    chat = {"messages": [{"role": "user", "content": "Add 2 and 3."}], "tools": TOOLS, "max_tokens": 120,
            "temperature": 0}
    for choice, names in (("required", {"weather", "add"}), ({"type": "function", "function": {"name": "add"}}, {"add"})):
        r = c.post("/v1/chat/completions", json=chat | {"tool_choice": choice}).json()
        ch = r["choices"][0]
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None, r
        (call,) = ch["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        assert set(args) == ({"a", "b"} if call["function"]["name"] == "add" else {"city"})
    events, text = _stream(c, "/v1/chat/completions", chat | {"tool_choice": "required"})
    deltas = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
    calls = [d["delta"]["tool_calls"] for d in deltas if d["delta"].get("tool_calls")]
    assert text == "" and len(calls) == 1 and calls[0][0]["index"] == 0 and deltas[-1]["finish_reason"] == "tool_calls"
    r = c.post("/v1/chat/completions", json=chat | {"tool_choice": "none", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    r = c.post("/v1/completions", json={"prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = c.post("/v1/chat/completions", json=chat | {"tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_a_langchain_client_calls_tools_and_gets_structured_output(small_server):
    """LangChain's ChatOpenAI (a second OpenAI client) against the server: a chat, a stream, a
    forced tool call parsed into its tool_calls, and with_structured_output's json_schema parsed
    into the pydantic model it asked for."""
    pytest.importorskip("xgrammar")
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Add(BaseModel):
        """Add two numbers."""
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    llm = lc.ChatOpenAI(base_url=small_server.url + "/v1", api_key="k3y", model="tiny-chat", temperature=0,
                        max_tokens=40)
    assert isinstance(llm.invoke("Hi").content, str) and len(list(llm.stream("Hi"))) > 1
    (call,) = llm.bind_tools([Add], tool_choice="Add").invoke("Add 2 and 3").tool_calls
    assert call["name"] == "Add" and set(call["args"]) == {"a", "b"}
    out = llm.with_structured_output(Add, method="json_schema").invoke("Add 2 and 3")
    assert isinstance(out, Add) and 0 <= out.a <= 99


def test_the_api_key_is_required(small_server):
    anon = httpx.Client(base_url=small_server.url, timeout=30)
    r = anon.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert anon.get("/health").status_code == 200  # health and metrics stay open, as in vLLM
    assert small_server.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_an_8bit_cache_is_on_the_start_line_and_in_the_metrics(small_server, server):
    line = next(l for l in small_server.lines if " on http://" in l)
    tokens = int(re.search(r"\((\d+) tokens", line).group(1))
    assert re.search(r"KV cache [\d.]+ \w+ int8, ", line), line
    text = small_server.client.get("/metrics").text
    assert f'llamactl_kv_cache_tokens{{dtype="int8"}} {float(tokens)}' in text
    assert 'llamactl_kv_cache_tokens{dtype="float32"}' in server.client.get("/metrics").text


def test_chat_completions_use_the_template(small_server):
    c = small_server.client
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                             "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] <= 4
    events, _ = _stream(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


def _running(c) -> int:
    return c.get("/health").json()["running"]


def test_a_full_queue_is_429_at_once_and_a_disconnect_frees_the_slot(small_server):
    c = small_server.client
    long = {"prompt": [5] * 8, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    holder = httpx.Client(base_url=small_server.url, timeout=60, headers=c.headers)
    with holder.stream("POST", "/v1/completions", json=long) as first:  # takes the one slot
        lines = first.iter_lines()  # (kept: a dropped iterator closes the stream)
        next(lines)
        waiter = threading.Thread(target=lambda: c.post("/v1/completions", json={**long, "stream": False,
                                                                                 "max_tokens": 3}))
        waiter.start()  # takes the one queue place
        deadline = time.time() + 30
        while c.get("/health").json()["waiting"] == 0 and time.time() < deadline:
            time.sleep(0.01)
        t0 = time.time()
        r = httpx.post(small_server.url + "/v1/completions", json={"prompt": "x"}, headers=c.headers, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error" and time.time() - t0 < 5
    holder.close()  # the client goes away mid-stream: its request is cancelled, the waiter runs
    waiter.join(60)
    assert not waiter.is_alive()
    deadline = time.time() + 30
    while _running(c) and time.time() < deadline:
        time.sleep(0.05)
    assert _running(c) == 0
    assert 'finish_reason="cancelled"' in c.get("/metrics").text


def _sigterm_mid_stream(args: list[str], max_tokens: int) -> tuple["Server", int, list]:
    """A server of args streaming one request of max_tokens, sent SIGTERM once it runs ->
    (the server, its exit code, the stream's events)."""
    s = Server(args)
    got: list = []

    def stream():
        got.append(_stream(s.client, "/v1/completions", {"prompt": [5] * 4, "max_tokens": max_tokens,
                                                         "ignore_eos": True}))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.time() + 30
    while _running(s.client) == 0 and time.time() < deadline:
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    t.join(120)
    return s, s.proc.wait(60), got[0][0]


def test_sigterm_ends_the_streams_in_flight_and_exits_0(long_model):
    s, code, events = _sigterm_mid_stream([str(long_model), "--max-batch", "2", "--max-seq", "1024"], 600)
    assert code == 0
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "stopped (SIGTERM)" in "".join(s.lines)
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health", timeout=5)


def test_sigterm_past_the_drain_time_ends_each_stream_with_an_error_and_exits_nonzero(long_model):
    s, code, events = _sigterm_mid_stream([str(long_model), "--max-batch", "2", "--max-seq", "4096",
                                           "--drain-timeout", "1"], 4000)
    log = "".join(s.lines)
    assert events[-1] == "[DONE]" and "the server is stopping" in events[-2]["error"]["message"], events[-3:]
    assert code not in (0, None) and "1 request(s) were still running when --drain-timeout 1 s ended" in log
    assert "Traceback" not in log and "CancelledError" not in log


def test_a_busy_port_is_one_line(server):
    port = server.url.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "llamactl", "serve", "--port", port, "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in r.stderr and "Traceback" not in r.stderr


def test_bench_serve_starts_and_stops_its_own_server(tmp_path):
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, "-m", "llamactl", "bench", "--serve", "embedded", "--device", "cpu",
                        "--concurrency", "2", "--requests", "2", "--prompt-len", "8", "--gen-len", "4",
                        "--format", "json", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--max-seq 20" in r.stderr  # the slots sized to the load: 2 x 8 prompt words + 4
    row = json.loads(out.read_text())["results"][0]
    assert row["model"] == "docs-llama-17m" and row["errors"] == 0 and row["output_tokens_mean"] == 4
    url = json.loads(out.read_text())["env"]["url"]
    with pytest.raises(httpx.ConnectError):  # stopped after the run
        httpx.get(url + "/health", timeout=5)


def test_a_failed_compile_of_the_step_is_one_line_naming_graphs():
    from llamactl.errors import InputError
    from llamactl.serve.run import _warm_up

    class Broken:
        mode = "compile"

        def warm_up(self):
            raise RuntimeError("InductorError: SubprocException: An exception occurred\nTraceback ...")

    with pytest.raises(InputError, match=r"torch.compile of the decode step failed \(RuntimeError: InductorError.*--mode graphs"):
        _warm_up(Broken())
    Broken.mode = "graphs"
    with pytest.raises(RuntimeError):
        _warm_up(Broken())


def test_hostile_bodies_are_4xx_and_a_client_gone_mid_body_is_one_line(long_model):
    """--max-request-bytes caps a body (413, by its header or by what arrives); a text that cannot
    fit the context however it tokenizes is a 400 before the tokenizer spends time on it; a client
    that goes away mid-body is one line in the log, no traceback; the server serves on."""
    import socket

    s = Server([str(long_model), "--max-batch", "1", "--max-seq", "64", "--max-request-bytes", "4096"])
    try:
        c = s.client
        r = c.post("/v1/completions", content=b"{" + b" " * 5000 + b"}", headers={"content-type": "application/json"})
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        t0 = time.time()
        r = c.post("/v1/completions", json={"prompt": "word " * 700, "max_tokens": 1})  # 3,500 bytes, 64 tokens
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "context of 64" in r.text
        assert time.time() - t0 < 5
        host, port = s.url.split("//")[1].split(":")
        with socket.create_connection((host, int(port))) as raw:  # says 3,000 bytes, sends 10, leaves
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 3000\r\n\r\n{\"prompt\":")
        deadline = time.time() + 10
        while not any("went away before its request body ended" in l for l in s.lines) and time.time() < deadline:
            time.sleep(0.05)
        log = "".join(s.lines)
        assert "went away before its request body ended" in log and "Traceback" not in log
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        assert s.stop() == 0


def test_a_body_that_does_not_arrive_in_time_is_a_408(monkeypatch):
    import asyncio

    from llamactl.serve import api
    from llamactl.serve.protocol import ApiError

    class Slow:
        headers, client = {"content-length": "10"}, None

        async def stream(self):
            yield b"{"
            await asyncio.sleep(5)
            yield b"}"

    monkeypatch.setattr(api, "BODY_TIMEOUT_S", 0.2)
    with pytest.raises(ApiError) as e:
        asyncio.run(api._read_body(Slow(), 1000))
    assert e.value.status == 408


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
