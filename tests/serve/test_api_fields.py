"""The OpenAI API's fields beyond the basics through a real server on 127.0.0.1 (the embedded
trained model, CPU float32; a random tiny chat model for tools): n, logprobs and echo, penalties
and logit_bias, stop_token_ids, structured output and tool calls, with the official and LangChain
clients where they take them. This module runs servers of its own (tests/serve/servers.py's fixtures)."""

from __future__ import annotations

import json
import re

import pytest

from llamactl.runtime import generate as gen
from test_engine import PROMPTS
from servers import long_model, server, small_server, stream_events  # noqa: F401, F811 (fixtures: servers of this module)
from test_serve import _tok


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
    events, _ = stream_events(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
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
    events, _ = stream_events(c, "/v1/completions", body | {"logprobs": 3})
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


@pytest.mark.slow
def test_structured_output_follows_the_schema_streamed_and_whole(server):
    """response_format json_schema (greedy and sampled, whole and streamed), json_object, vLLM's
    guided_choice and guided_regex: the embedded model's output parses and validates each time;
    a schema that does not compile and two asks at once are 400s naming the field."""
    pytest.importorskip("xgrammar")
    c = server.client
    grammar_s = lambda: float(next(line.split()[1] for line in c.get("/metrics").text.splitlines()  # noqa: E731
                                   if line.startswith("llamactl_engine_grammar_seconds ")))
    before = grammar_s()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = {"messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 80, "response_format": fmt}
    for body in (chat | {"temperature": 0}, chat | {"temperature": 1.0, "seed": 5, "n": 2}):
        r = c.post("/v1/chat/completions", json=body).json()
        for choice in r["choices"]:
            assert choice["finish_reason"] == "stop" and _is_person(choice["message"]["content"]), choice
    _, text = stream_events(c, "/v1/chat/completions", chat | {"temperature": 0.7, "seed": 2})
    assert _is_person(text)
    assert grammar_s() > before  # the matchers' time on the engine's thread (/metrics)
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
    events, text = stream_events(c, "/v1/completions", body | {"echo": True, "logprobs": 1})
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
    events, text = stream_events(c, "/v1/chat/completions", chat | {"tool_choice": "required"})
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
