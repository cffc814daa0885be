"""OpenAI's Responses API (POST /v1/responses) over the chat completions the server already answers.

Responsible for: a Responses request as a chat completion's body (`as_chat`: `instructions` and `input` -- text, or
message / function_call / function_call_output items -- as messages, function tools and `tool_choice` in the chat
API's form, `text.format` as `response_format`, `max_output_tokens` as `max_tokens`, the chat path's extras passed
on); the chat answer as a Response object (`response_of`: reasoning, message and function_call output items, status
"incomplete" where it stopped at max_output_tokens, usage); a streamed chat answer as the Responses events
(`ResponseEvents`: response.created, the output items with their text / reasoning deltas and function calls,
response.completed / response.incomplete, or an error and response.failed); a chat error named as the Responses
request names its fields (`renamed`).
Not responsible for: sampling, tool calls and reasoning themselves (the chat path: requests.py, tool_parsers.py,
reasoning.py). Stateless, as vLLM serves it without a store: nothing is kept, so `previous_response_id` and
`conversation` are refused (send the conversation in `input`), and each response says `"store": false`.
Torch-free.
"""

from __future__ import annotations

import json
import re
import time
import uuid

from meshlm.infer.requests import API_SAMPLING_DEFAULTS, APIError, check_text, short

# a chat field -> the Responses field it came from (errors name what the client sent)
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
# Responses fields this server does not implement, and the values that ask for nothing
UNSUPPORTED = {"previous_response_id": (None,), "conversation": (None,), "background": (None, False),
               "include": (None, []), "prompt": (None,), "truncation": (None, "disabled"), "top_logprobs": (None, 0),
               "max_tool_calls": (None,)}
# the Responses fields mapped onto the chat's (the rest pass on as they are: the chat path takes vLLM's extras
# -- seed, stop, penalties, chat_template_kwargs, rag, ... --, refuses by name what it does not implement and
# ignores what it does not know)
MAPPED = ("input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning", "metadata")
TEXT_FORMATS = ("text", "json_object", "json_schema")
PART_TEXT = ("input_text", "output_text", "text")  # content parts that are text
# the chat API's own fields, which a Responses request names otherwise (or not at all)
CHAT_FIELDS = {"messages": "give input", "max_tokens": "give max_output_tokens",
               "max_completion_tokens": "give max_output_tokens", "response_format": "give text.format",
               "structured_outputs": "give text.format", "n": "a response has one output",
               "stream_options": "a streamed response ends with its usage", "add_generation_prompt": "leave it out",
               "continue_final_message": "leave it out"}


def as_chat(body: dict) -> dict:
    """The chat completion body a Responses request asks for (the model, and its stream with the usage last)."""
    for key, plain in UNSUPPORTED.items():
        if body.get(key) not in plain:
            why = "this server keeps no responses: send the whole conversation in input" \
                if key in ("previous_response_id", "conversation") else "leave it out"
            raise APIError(400, f"{key}={short(body[key])} is not supported by this server; {why}", param=key)
    for key, hint in CHAT_FIELDS.items():
        if body.get(key) is not None:
            raise APIError(400, f"{key} is the chat API's, not the Responses': {hint}", param=key)
    for key, kind in (("metadata", "an object of strings"), ("reasoning", "an object such as {\"effort\": \"low\"}"),
                      ("text", "an object such as {\"format\": {\"type\": \"text\"}}")):
        value = body.get(key)
        if value is not None and not (isinstance(value, dict) and (key != "metadata" or all(
                isinstance(v, str) for v in value.values()))):
            raise APIError(400, f"{key} must be {kind}", param=key)
    chat = {key: value for key, value in body.items() if key not in MAPPED and key not in UNSUPPORTED}
    chat["messages"] = input_messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"], [t["function"]["name"] for t in chat.get("tools", [])])
    if body.get("text") is not None:
        chat["response_format"] = _text_format(body["text"])
    if chat.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    return chat


def input_messages(body: dict) -> list[dict]:
    """`instructions` (a system message first) and `input` as chat messages: a text is the user's message; items
    are messages (text parts), the model's function calls (an assistant message's tool_calls, consecutive ones
    together) and their outputs (tool messages); an earlier reasoning item is left out, as chat templates drop
    earlier thinking."""
    messages = []
    instructions, given = body.get("instructions"), body.get("input")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError(400, "instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": check_text(instructions, "instructions")})
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise APIError(400, "'input' is required: a string or a non-empty list of items", param="input")
    for item in given:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if "role" not in item:
                raise APIError(400, "a message item needs its role", param="input")
            messages.append({"role": item["role"], "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
                raise APIError(400, "a function_call item needs call_id, name and arguments as strings", param="input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, "a function_call_output item needs its call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"))})
        elif kind != "reasoning":
            raise APIError(400, f"an input item of type {short(kind)}: this server takes message, function_call, "
                                "function_call_output and reasoning items (text only)", param="input")
    if len(messages) == (instructions is not None):  # the items were all earlier reasoning
        raise APIError(400, "input holds no message to answer (only earlier reasoning items)", param="input")
    return messages


def _text(content) -> str:
    """A message's content as text: a string, or its text parts joined (other parts refused by type)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for part in content:
            if part.get("type") not in PART_TEXT:
                raise APIError(400, f"a content part of type {short(part.get('type'))}: this model reads text "
                                    f"only; send {' / '.join(PART_TEXT[:2])} parts", param="input")
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"a {short(part['type'])} part needs its text as a string", param="input")
        return "".join(p["text"] for p in content)
    raise APIError(400, "an input message's content must be a string or a list of text parts", param="input")


def _text_format(text) -> dict:
    """`text` ({"format": {"type": "text" | "json_object" | "json_schema", ...}}) as the chat's response_format."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not (isinstance(fmt, dict) and fmt.get("type") in TEXT_FORMATS and set(text) == {"format"}):
        raise APIError(400, "text must be {\"format\": {\"type\": \"text\"}}, {\"format\": {\"type\": "
                            "\"json_object\"}} or {\"format\": {\"type\": \"json_schema\", \"name\": ..., \"schema\": "
                            "{...}}}", param="text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format of type json_schema needs its schema, an object", param="text")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def _tools(tools) -> list[dict]:
    """Function tools ({"type": "function", "name", "parameters", ...}) in the chat API's form."""
    shape = "tools must be a list of at most 128 {\"type\": \"function\", \"name\": ..., \"parameters\": {...}}"
    if not isinstance(tools, list) or len(tools) > 128 or not all(isinstance(t, dict) for t in tools):
        raise APIError(400, shape, param="tools")
    out = []
    for tool in tools:
        if tool.get("type") != "function":
            raise APIError(400, f"a tool of type {short(tool.get('type'))}: this server calls functions only",
                           param="tools")
        if not isinstance(tool.get("name"), str) or not tool["name"] or not isinstance(tool.get("parameters", {}),
                                                                                         dict):
            raise APIError(400, shape, param="tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if k in tool}})
    return out


def _tool_choice(choice, names: list[str]):
    """tool_choice in the chat API's form: "auto", "none", "required", or {"type": "function", "name": N} with N
    one of the tools' `names`."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name") in names:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                        f"\"name\": N}} with N one of the tools' names ({', '.join(map(repr, names)) or 'none given'})",
                   param="tool_choice")


def renamed(param: str | None, message: str) -> tuple[str | None, str]:
    """A chat path's error (its param and message) as the Responses request named its fields."""
    message = message.replace("response_format / structured_outputs", "text").replace(
        '{"type": "function", "function": {"name": ...}}', '{"type": "function", "name": ...}')
    for chat, field in PARAMS.items():
        if chat != "messages":  # "messages" is also a plain word of the messages
            message = re.sub(rf"\b{chat}\b", field, message)
    return PARAMS.get(param, param), message


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def head(body: dict, rid: str, model: str, defaults: dict) -> dict:
    """A Response object's fields besides its output, status and usage: what the request asked for, with the
    server's sampling `defaults` where it left them out."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            **{key: body.get(key, {**API_SAMPLING_DEFAULTS, **defaults}[key]) for key in ("temperature", "top_p")},
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": {"format": text.get("format") or {"type": "text"}}, "reasoning": body.get("reasoning"),
            "metadata": body.get("metadata") or {}, "previous_response_id": None, "store": False,
            "truncation": "disabled", "error": None, "incomplete_details": None}


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """A Response's status and incomplete_details for a chat choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def usage_of(usage: dict | None) -> dict | None:
    """The chat usage as the Responses API's (reasoning tokens are not counted apart: 0)."""
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict, item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def response_of(answer: dict, body: dict, model: str, defaults: dict | None = None) -> dict:
    """The Response object of a whole chat completion `answer` to the Responses request `body`: its reasoning, its
    message (where it has text, or nothing else), its function calls."""
    choice = answer["choices"][0]
    message, output = choice["message"], []
    if message.get("reasoning"):
        output.append(reasoning_item(message["reasoning"]))
    status, incomplete = status_of(choice["finish_reason"])
    if message.get("content") or not (message.get("tool_calls") or message.get("reasoning")):
        output.append(message_item(message.get("content") or "", status=status))
    output += [call_item(c) for c in message.get("tool_calls") or []]
    return {**head(body, _id("resp"), model, defaults or {}), "status": status, "incomplete_details": incomplete,
            "output": output, "usage": usage_of(answer["usage"])}


class ResponseEvents:
    """A streamed chat completion's chunks as the Responses API's events, each with its `sequence_number`: the
    response created and in progress, then per output item (reasoning, the message, each function call) its
    added / delta / done events, then response.completed (or response.incomplete) with the whole response; a
    request that fails mid-way ends with an error event and response.failed."""

    def __init__(self, body: dict, model: str, defaults: dict | None = None):
        self.response = {**head(body, _id("resp"), model, defaults or {}), "status": "in_progress", "output": [],
                         "usage": None}
        self.sequence = 0
        self.open: dict | None = None  # the output item being streamed (reasoning or message)
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.sequence - 1, **fields})}\n\n"

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def chunk(self, data: dict) -> list[str]:
        """The events of one chat chunk (or its usage, or its error)."""
        if "error" in data:  # the request failed mid-way: the error, then the response failed with it
            error = data["error"]
            param, message = renamed(error.get("param"), error.get("message") or "")
            self.response.update(status="failed", error={"code": error.get("code") or error.get("type"),
                                                         "message": message})
            return [self.event("error", code=error.get("code"), message=message, param=param),
                    self.event("response.failed", response=self.response)]
        if data.get("usage") is not None:
            self.response["usage"] = usage_of(data["usage"])
        events = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self.text("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self.text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self.close()
                item, index = call_item(call), len(self.response["output"])
                self.response["output"].append(item)
                events += [self.event("response.output_item.added", output_index=index,
                                      item={**item, "arguments": "", "status": "in_progress"}),
                           self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=item["arguments"]),
                           self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]),
                           self.event("response.output_item.done", output_index=index, item=item)]
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def text(self, kind: str, delta: str) -> list[str]:
        """A reasoning or message text delta, opening its item (and closing the other) where it starts."""
        events = self.open_item(kind) if self.open is None or self.open["type"] != kind else []
        item, index = self.open, len(self.response["output"]) - 1
        item["content"][0]["text"] += delta
        if kind == "reasoning":
            return [*events, self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                        content_index=0, delta=delta)]
        return [*events, self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                    content_index=0, delta=delta, logprobs=[])]

    def open_item(self, kind: str) -> list[str]:
        """A reasoning or message item's added events (the item open before, if any, done first)."""
        events = self.close()
        item = reasoning_item("") if kind == "reasoning" else message_item("", status="in_progress")
        self.open = item
        self.response["output"].append(item)
        index = len(self.response["output"]) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=item["content"][0]))
        return events

    def close(self) -> list[str]:
        """The done events of the item being streamed, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.response["output"].index(item)
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            done = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text)]
        else:
            item["status"] = "incomplete" if item["status"] == "incomplete" else "completed"
            done = [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=item["content"][0])]
        return [*done, self.event("response.output_item.done", output_index=index, item=item)]

    def finish(self) -> list[str]:
        """The last events: the open item's done (an empty message if the reply had nothing, as the whole
        Response has), then the whole response, completed or incomplete."""
        status, incomplete = status_of(self.finish_reason)
        events = [] if self.response["output"] else self.open_item("message")
        if self.open is not None and self.open["type"] == "message" and status == "incomplete":
            self.open["status"] = status  # close() marks it completed otherwise
        events += self.close()
        self.response.update(status=status, incomplete_details=incomplete)
        return [*events, self.event(f"response.{status}", response=self.response)]
