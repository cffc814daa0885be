"""Tool calls in a reply's text: the calls a chat's reply makes, read from the text the model wrote.

Responsible for: the model families' own tool-call formats that tool_choice "auto" needs (`PARSERS`, chosen with
`meshlm serve --tool-call-parser`, as vLLM's and SGLang's flag of that name): `hermes` (`<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks after any text: Qwen2.5, Qwen3, Hermes 2 Pro / 3) and `llama3_json` (a
reply that is one or more `{"name": ..., "parameters": {...}}` objects separated by ";": Llama 3.1 / 3.2's JSON
tool calling), of the request's tools only (`Auto`); the calls a forced tool_choice's grammar held the text to
(`Forced`); and, for a streamed reply, from where on the text may be a call (`hold`), which the stream keeps back
until the reply ends.
Not responsible for: the grammar of a forced choice (requests.ToolChoice.schema), the answer's layout
(responses.py). Torch-free.

A reply whose calls do not parse (cut short, not JSON, a call without a name or arguments) is answered as text, as
vLLM does: the client sees what the model wrote; so is one calling a function the request did not list.
"""

from __future__ import annotations

import json

Call = tuple[str, dict]  # a function's name and its arguments
Parsed = tuple["str | None", list[Call]]  # the reply's text before its calls (None: none), the calls


def _call(value, arguments_keys: tuple[str, ...]) -> Call | None:
    """One call object as (name, arguments): a non-empty "name" and an object under one of `arguments_keys`
    (its JSON text is taken too, which some models write); None if it is not one (an answer in JSON with a
    "name" is not a call)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in arguments_keys if k in value), None)
    if key is None:
        return None
    arguments = value[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def partial_marker_at(text: str, marker: str) -> int:
    """Where a proper prefix of `marker` ends `text` (the longest), else len(text)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


class Hermes:
    """`<tool_call>` JSON `</tool_call>` blocks after the reply's text (the last may lack its closing tag: the
    reply ended there). The text after the calls is dropped."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def hold(self, text: str) -> int:
        at = text.find(self.start)
        return at if at >= 0 else partial_marker_at(text, self.start)

    def parse(self, text: str) -> Parsed | None:
        at = text.find(self.start)
        if at < 0:
            return None
        calls, rest = [], text[at:]
        while rest.startswith(self.start):
            body, closed, rest = rest[len(self.start):].partition(self.end)
            call = _call(_json(body), ("arguments", "parameters"))
            if call is None:
                return None
            calls.append(call)
            rest = rest.lstrip() if closed else ""
        return (text[:at] or None), calls


class Llama3Json:
    """A reply that is only calls: JSON objects with "name" and "parameters" (or "arguments"), separated by ";",
    after Llama's `<|python_tag|>` where the text shows it."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def hold(self, text: str) -> int:
        head = text.lstrip()
        maybe = not head or head.startswith(("{", self.tag)) or self.tag.startswith(head)
        return 0 if maybe else len(text)

    def parse(self, text: str) -> Parsed | None:
        rest, calls, decoder = text.strip().removeprefix(self.tag).lstrip(), [], json.JSONDecoder()
        while rest:
            try:
                value, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            call = _call(value, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = rest[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
        return (None, calls) if calls else None


class Forced:
    """The calls of a forced tool_choice (requests.ToolChoice with `calls`), whose grammar held the whole text to
    them: the named function's arguments, or a list of {"name", "parameters"}. The whole text is the calls."""

    def __init__(self, tools):
        self.tools = tools

    def hold(self, text: str) -> int:
        return 0

    def parse(self, text: str) -> Parsed | None:
        value = _json(text)
        if self.tools.name is not None:
            return (None, [(self.tools.name, value)]) if isinstance(value, dict) else None
        calls = [_call(c, ("parameters",)) if isinstance(c, dict) and set(c) == {"name", "parameters"} else None
                 for c in value] if isinstance(value, list) else [None]
        return None if not calls or None in calls else (None, calls)


def _json(text: str):
    """The JSON value `text` holds (blanks around it allowed), else None."""
    try:
        return json.loads(text)
    except ValueError:
        return None


class Auto:
    """tool_choice "auto": the calls `parser` (a model family's format) reads from a reply, if they call the
    request's tools (`tools`, a requests.ToolChoice) -- a reply calling anything else is answered as text -- and
    only the first where parallel_tool_calls is false."""

    def __init__(self, parser, tools):
        self.parser, self.tools = parser, tools
        self.names = {t["function"]["name"] for t in tools.tools}

    def hold(self, text: str) -> int:
        return self.parser.hold(text)

    def parse(self, text: str) -> Parsed | None:
        parsed = self.parser.parse(text)
        if parsed is None or any(name not in self.names for name, _ in parsed[1]):
            return None
        content, calls = parsed
        return content, calls if self.tools.parallel else calls[:1]


PARSERS = {p.name: p for p in (Hermes(), Llama3Json())}  # --tool-call-parser's choices
