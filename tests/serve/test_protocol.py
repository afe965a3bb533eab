"""Request parsing alone (serve.protocol): what an OpenAI client sends, and what is refused."""

from __future__ import annotations

import pytest

from llamactl.serve.protocol import ApiError, parse


@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
                                         ("top_p", "-Infinity")])
def test_non_finite_sampling_numbers_are_a_400(field, value):
    raw = f'{{"prompt": "hi", "max_tokens": 4, "{field}": {value}}}'.encode()  # Python's json reads these
    with pytest.raises(ApiError, match=f"{field} -?(nan|inf) is out of range") as e:
        parse(raw, False, "m")
    assert e.value.status == 400


def test_finite_settings_pass():
    ask = parse(b'{"prompt": "hi", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9}', False, "m")
    assert (ask.temperature, ask.top_p) == (0.5, 0.9)


def test_a_request_may_keep_out_of_speculation():
    assert parse(b'{"prompt": "hi"}', False, "m").speculate is True
    assert parse(b'{"prompt": "hi", "speculate": false}', False, "m").speculate is False
    with pytest.raises(ApiError, match="speculate must be true or false"):
        parse(b'{"prompt": "hi", "speculate": "no"}', False, "m")


def test_a_body_nested_deeper_than_python_recurses_is_a_400():
    raw = b'{"prompt": "hi", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with pytest.raises(ApiError, match="nests too deep") as e:
        parse(raw, False, "m")
    assert e.value.status == 400


def test_tool_calls_are_read_from_the_forms_models_write_them_in():
    """serve.tools.parse: {"name", "arguments"}, Llama 3.1's "parameters", a list, Hermes'
    <tool_call> wrapping; text, unknown names and broken JSON are not calls; ToolStream passes text
    through and holds a call back to the end."""
    from llamactl.serve.tools import ToolStream, parse

    tools = [{"type": "function", "function": {"name": "add"}}, {"type": "function", "function": {"name": "weather"}}]
    one = parse('{"name": "add", "arguments": {"a": 1}}', tools)
    assert one[0]["function"] == {"name": "add", "arguments": '{"a": 1}'} and one[0]["type"] == "function"
    assert parse(' <tool_call>{"name": "weather", "parameters": {"city": "Oslo"}}</tool_call>', tools)[0]["function"][
        "arguments"] == '{"city": "Oslo"}'
    assert [c["function"]["name"] for c in parse('[{"name": "add", "arguments": {}}, {"name": "weather", '
                                                '"arguments": {}}]', tools)] == ["add", "weather"]
    for text in ("The answer is 5.", '{"name": "mul", "arguments": {}}', '{"name": "add", "arguments": {', "{}"):
        assert parse(text, tools) is None, text
    plain = ToolStream(tools, forced=False)
    assert [plain.feed(p) for p in (" ", "The", " answer")] == ["", " The", " answer"] and plain.end() == ("", None)
    call = ToolStream(tools, forced=False)
    assert [call.feed(p) for p in ('{"name": "add", ', '"arguments": {}}')] == ["", ""]
    text, calls = call.end()
    assert text == "" and calls[0]["function"]["name"] == "add"
