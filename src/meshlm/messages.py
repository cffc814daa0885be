"""Chat messages as a chat template takes them, from the OpenAI chat API's form: one definition for the server's
requests (`infer/requests.py`, which answers its errors as 400s) and the conversations training reads
(`data/chat.py`, which names file:line), so that a conversation trained on is rendered exactly as the same messages
are when served.

Responsible for: the roles a message may have; its content as one text (a list of text parts joined; an assistant's
null, when it only called tools, as ""); text that is valid Unicode (JSON lets a lone surrogate such as \\ud800
through); an assistant's `tool_calls` with their `arguments` (JSON text in the API) as the objects templates
iterate or dump with `tojson`, as vLLM hands them over; an earlier reply's `reasoning` as `reasoning_content` (what
Qwen3's template reads); a tool reply's `tool_call_id` and `name`; and `short`, a user's value as an error message
may quote it. Errors are ValueErrors whose text names the problem. Torch-free.
Not responsible for: rendering (meshlm.tokenizer), the rest of a request (infer/requests.py).
"""

from __future__ import annotations

import json

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # the chat API's roles (function: deprecated)


def short(value) -> str:
    """A user value for an error message: bounded length, ASCII only (safe whatever the client sent)."""
    text = ascii(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def checked_text(text: str, name: str) -> str:
    """`text`, refused (ValueError naming `name`) when it is not valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds text that is not valid Unicode ({e.reason} at character {e.start}); "
                         "send UTF-8 text") from None
    return text


def template_messages(messages: list) -> list[dict]:
    """A non-empty list of the API's messages as the chat template takes them (ValueError for one it cannot)."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or (m.get("content") is None and m["role"] != "assistant"):
            raise ValueError("each message needs a 'role' and a 'content' (only an assistant's may be null)")
        if m["role"] not in ROLES:
            raise ValueError(f"message role {short(m['role'])} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is None:  # an assistant turn that only called tools
            content = ""
        if isinstance(content, list):  # content parts: text ones only, joined
            parts = []
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise ValueError("each content part must be an object with a 'type'")
                if part["type"] != "text":
                    raise ValueError(f"a content part of type {short(part['type'])}: this model reads text only; "
                                     "send text parts")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"a text content part needs 'text' as a string, not {short(part.get('text'))}")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ValueError("message content must be a string or a list of text parts")
        entry = {"role": checked_text(m["role"], "messages"), "content": checked_text(content, "messages")}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list) or not all(isinstance(c, dict) for c in m["tool_calls"]):
                raise ValueError("an assistant message's tool_calls must be a list of objects")
            try:
                checked_text(json.dumps(m["tool_calls"], ensure_ascii=False), "messages")
            except RecursionError:
                raise ValueError("an assistant message's tool_calls nest too deeply") from None
            entry["tool_calls"] = [_arguments_as_object(c) for c in m["tool_calls"]]
        reasoning = m.get("reasoning_content", m.get("reasoning"))  # an earlier reply's thinking, for templates
        if m["role"] == "assistant" and isinstance(reasoning, str):  # that show it (Qwen3's reads reasoning_content)
            entry["reasoning_content"] = checked_text(reasoning, "messages")
        for key in ("tool_call_id", "name"):  # a tool's reply: which call it answers
            if isinstance(m.get(key), str):
                entry[key] = checked_text(m[key], "messages")
        out.append(entry)
    return out


def _arguments_as_object(call: dict) -> dict:
    """A tool call of a chat's history for the template: its `arguments` (JSON text in the API) as the object they
    encode, which templates iterate or dump with `tojson` (vLLM hands them over so); left as sent otherwise."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):  # not JSON, or nested beyond what Python's parser takes: left as text
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call
