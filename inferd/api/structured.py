"""Structured outputs and tool calling for OpenAI's chat completions (and
``response_format`` for completions): what a request asks for, as the replica's
constrained decoding takes it, and the model's text back as OpenAI's ``tool_calls``.

What is asked becomes a *guide* in the sampling parameters, which both engines honour
with a token mask (so the output parses):

- ``response_format: {"type": "json_object"}`` -> ``{"json_object": true}``, any JSON
  object; ``{"type": "json_schema", "json_schema": {"schema": …, "strict": …}}`` ->
  ``{"json": schema}``. The schema is checked as JSON Schema here (400 naming where it
  is wrong); a construct the grammar backend cannot compile is a 400 from the replica.
- ``tool_choice: "required"`` -> the output is a JSON array of one or more calls
  ``{"name": <one of the tools>, "arguments": <its parameters>}`` (one object when
  ``parallel_tool_calls`` is false); a named function -> one call of that function.
- ``tool_choice: "auto"`` (the default with tools): nothing is forced; the tools are
  given to the chat template, and calls the model writes the way templates ask
  (``<tool_call>{"name": …, "arguments": …}</tool_call>``, the Hermes convention of
  Qwen, Hermes and Llama-3 templates) are parsed out of its text.
- ``tool_choice: "none"``: the tools are not shown to the model.

``max_tokens`` can cut a constrained output before it is complete: the finish reason is
then ``length`` and the text is what was generated (it does not parse), as with OpenAI.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from inferd.errors import InvalidInput

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class Plan:
    """What a chat request asks of the output."""

    guide: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    """Tools shown to the chat template."""
    forced: bool = False
    """The output is a forced tool call (JSON), to turn into ``tool_calls``."""
    parse_calls: bool = False
    """``auto``: look for ``<tool_call>`` blocks in the text."""
    names: frozenset[str] = frozenset()


def _bad(message: str, param: str) -> InvalidInput:
    return InvalidInput(message, param=param)


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """``schema`` if it is a valid JSON Schema (an object), else a 400 naming where."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON Schema object", param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        at = "".join(f"[{p!r}]" for p in exc.path) or "(root)"
        raise _bad(f"{param} is not a valid JSON Schema at {at}: {exc.message}", param) from None
    return schema


def response_guide(value: Any) -> dict[str, Any] | None:
    """The guide of ``response_format`` (None for text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _bad("response_format.json_schema must be an object with a 'name' and a "
                       "'schema'", "response_format.json_schema")  # fmt: skip
        schema = check_schema(spec.get("schema", {}), "response_format.json_schema.schema")
        return {"json": schema}
    raise _bad("response_format.type must be text, json_object or json_schema",
               "response_format.type")  # fmt: skip


def plan(body: dict[str, Any]) -> Plan:
    """The guide, the tools to show and how to read the output, from a chat body."""
    guide = response_guide(body.get("response_format"))
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice", "auto" if tools else "none")
    if not tools:
        if choice not in ("none", "auto"):
            raise _bad("tool_choice needs 'tools'", "tool_choice")
        return Plan(guide=guide)
    names = frozenset(t["function"]["name"] for t in tools)
    if choice == "none":
        return Plan(guide=guide)
    if guide is not None:
        raise _bad("give response_format or tools that may be called, not both "
                   "(or tool_choice none)", "response_format")  # fmt: skip
    if choice == "auto":
        return Plan(tools=tools, parse_calls=True, names=names)
    if choice == "required":
        calls = [_call_schema(t) for t in tools]
        one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if body.get("parallel_tool_calls") is False:
            return Plan(guide={"json": one}, tools=tools, forced=True, names=names)
        array = {"type": "array", "items": one, "minItems": 1}
        return Plan(guide={"json": array}, tools=tools, forced=True, names=names)
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise _bad(f"tool_choice names {name!r}, which is not among the tools",
                       "tool_choice.function.name")  # fmt: skip
        return Plan(guide={"json": _call_schema(chosen[0])}, tools=chosen, forced=True,
                    names=frozenset([name]))  # fmt: skip
    raise _bad("tool_choice must be none, auto, required or {'type': 'function', "
               "'function': {'name': ...}}", "tool_choice")  # fmt: skip


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    tools = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        at = f"tools.[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise _bad(f"{at} must be {{'type': 'function', 'function': {{...}}}}", at)
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise _bad(f"{at}.function: unknown field {unknown[0]!r}", f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{at}.function.name must be 1-64 letters, digits, _ or -",
                       f"{at}.function.name")  # fmt: skip
        if name in seen:
            raise _bad(f"{at}: two tools are named {name!r}", f"{at}.function.name")
        seen.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        check_schema(parameters, f"{at}.function.parameters")
        described = {"name": name, "parameters": parameters}
        if isinstance(function.get("description"), str):
            described["description"] = function["description"]
        tools.append({"type": "function", "function": described})
    return tools


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def forced_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls of a forced output (a call object or an array of them); None when the
    text does not parse (a cut output)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(_call(item["name"], item.get("arguments", {})))
    return calls


def parse_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """``auto``: the text before the first ``<tool_call>`` and the calls written after
    it (blocks that are not JSON naming one of the tools stay in the content)."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _TOOL_CALL.finditer(text, start):
        try:
            value = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(value, dict) or value.get("name") not in names:
            return text, []
        calls.append(_call(value["name"], value.get("arguments", {})))
    content = text[:start].strip()
    return content or None, calls


def answer(
    text: str, reason: str | None, plan: Plan
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """The message content, tool calls and finish reason of a whole chat answer."""
    if plan.forced and reason == "stop":
        calls = forced_calls(text)
        if calls:
            return None, calls, "tool_calls"
    if plan.parse_calls:
        content, calls = parse_calls(text, plan.names)
        if calls:
            return content, calls, "tool_calls"
    return text, [], reason


class StreamedCalls:
    """A streamed chat answer's text, split into content to send now and text held
    back: all of a forced call; for ``auto``, everything from a ``<tool_call>`` on, and
    a tail that may be the start of one (until the next chunk tells)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.held = ""
        self._calling = plan.forced

    def feed(self, text: str) -> str:
        """The part of ``text`` that can be sent as content now."""
        if not (self._calling or self.plan.parse_calls):
            return text
        self.held += text
        if self._calling:
            return ""
        at = self.held.find(TOOL_CALL_OPEN)
        if at >= 0:
            ready, self.held, self._calling = self.held[:at], self.held[at:], True
            return ready
        keep = _partial_open(self.held)
        ready, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return ready

    def finish(self, reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """At the end: held text to send as content, the calls, the finish reason."""
        if not self.held:
            return "", [], reason
        _, calls, reason = answer(self.held, reason, self.plan)
        return ("" if calls else self.held), calls, reason


def _partial_open(text: str) -> int:
    """How many characters at the end of ``text`` may start ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
