"""Tool calls for chats (`tools`, `tool_choice`): the tools rendered through the model's chat
template (or, where the template has no place for them, a system message that lists them), the
calls parsed from the output into OpenAI's `tool_calls`, and `required` or a named function
enforced with a grammar (serve.grammar) so the output is a call.

A call is written as a JSON object {"name": ..., "arguments": {...}} (Llama 3.1's
{"name": ..., "parameters": {...}} too, a list of them, and Hermes' <tool_call>...</tool_call>
wrapping are read); streamed, an output that may be a call is held back until it ends, then sent
as one tool_calls delta.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from llamactl.serve.errors import ApiError

MAX_TOOLS = 64
_WRAPPERS = re.compile(r"</?tool_call>|<\|python_tag\|>|<\|eom_id\|>")


def check(body: dict) -> tuple[list[dict], str | dict] | None:
    """A chat's tools and tool_choice ("none", "auto", "required" or {"type": "function",
    "function": {"name": N}}), checked, or None without tools; ApiError (400) naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of up to {MAX_TOOLS} functions", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two functions have the same name", "tools")
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ApiError(400, "tool_choice names no function of tools", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, "tool_choice must be none, auto, required or a named function", "tool_choice")
    return tools, choice


def forced_schema(tools: list[dict], choice: str | dict) -> str | None:
    """The JSON schema a `required` or named tool_choice holds the output to (one call), or None."""
    if choice in ("none", "auto"):
        return None
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for f in (t["function"] for t in tools) if named in (None, f["name"])]
    return json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})


def system_message(tools: list[dict]) -> dict:
    """The tools as a system message, for a chat template that has no place for them."""
    listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    return {"role": "system", "content": "You can call these functions. To call one, answer with only a JSON object "
            "{\"name\": function name, \"arguments\": {...}}.\nFunctions: " + listed}


def parse(text: str, tools: list[dict]) -> list[dict] | None:
    """OpenAI tool_calls read from a model's output, or None where it is not (only) calls to tools."""
    body = _WRAPPERS.sub("", text).strip()
    if not body or body[0] not in "[{":
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    names = {t["function"]["name"] for t in tools}
    calls = []
    for c in value if isinstance(value, list) else [value]:
        args = c.get("arguments", c.get("parameters")) if isinstance(c, dict) else None
        if not isinstance(c, dict) or c.get("name") not in names or not isinstance(args, (dict, str)):
            return None
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": c["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return calls or None


class ToolStream:
    """One choice's text on its way out where tools may be called: pieces pass through until the
    output shows it may be a call (it begins with "{", "[" or "<"), then are held back to the end."""

    def __init__(self, tools: list[dict], forced: bool):
        self.tools, self.held, self.holding = tools, "", forced
        self.decided = forced

    def feed(self, piece: str) -> str:
        """A piece of text -> what to send now."""
        if self.holding:
            self.held += piece
            return ""
        if not self.decided:
            self.held += piece
            start = self.held.lstrip()
            if not start:
                return ""
            self.decided = True
            self.holding = start[0] in "[{<"
            if self.holding:
                return ""
            out, self.held = self.held, ""
            return out
        return piece

    def end(self) -> tuple[str, list[dict] | None]:
        """(the text still to send, the tool calls) once the output has ended."""
        calls = parse(self.held, self.tools) if self.held else None
        return ("", calls) if calls else (self.held, None)
