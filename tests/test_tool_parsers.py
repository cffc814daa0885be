"""Tool calls read from a reply's text (infer/tool_parsers.py): the model families' formats that tool_choice "auto"
needs, a forced choice's JSON, and a streamed reply holding back the text that may be a call -- streamed in any
pieces, a choice ends as its whole answer does."""

import json
import random
from types import SimpleNamespace

import pytest

from meshlm.infer.requests import ToolChoice
from meshlm.infer.responses import Replies
from meshlm.infer.tool_parsers import PARSERS, Forced

HERMES, LLAMA = PARSERS["hermes"], PARSERS["llama3_json"]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "now"}}]


def test_hermes_reads_the_calls_after_the_text():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>'
    assert HERMES.parse(text) == ("Let me add.\n", [("add", {"a": 1, "b": 2}), ("now", {})])
    # the last call without its closing tag (the reply ended there); no text before: content None
    assert HERMES.parse('<tool_call>{"name": "now", "arguments": {}}') == (None, [("now", {})])
    # text after the calls is dropped (vLLM's hermes parser too)
    assert HERMES.parse('<tool_call>{"name": "now"}</tool_call> bye') == (None, [("now", {})])
    for text in ("no call here", "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1",  # cut short
                 "<tool_call>[1, 2]</tool_call>", '<tool_call>{"name": "", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
                 '<tool_call>{"name": "now"}</tool_call><tool_call>oops</tool_call>'):
        assert HERMES.parse(text) is None, text  # answered as text
    # streamed: held from where the marker begins or may begin
    assert HERMES.hold("Hi <tool_call>{") == 3 and HERMES.hold("Hi <tool") == 3 and HERMES.hold("Hi <") == 3
    assert HERMES.hold("Hi <b>") == 6 and HERMES.hold("") == 0


def test_llama3_json_reads_a_reply_that_is_only_calls():
    assert LLAMA.parse('{"name": "add", "parameters": {"a": 1}}; {"name": "now", "arguments": {}}') == \
        (None, [("add", {"a": 1}), ("now", {})])
    assert LLAMA.parse('<|python_tag|>{"name": "now", "parameters": {}}') == (None, [("now", {})])
    for text in ("The answer is 3.", '{"a": 1}', '{"name": "add", "parameters": {"a": 1}} and text', "", "{"):
        assert LLAMA.parse(text) is None, text
    assert LLAMA.hold("  ") == 0 and LLAMA.hold(' {"na') == 0 and LLAMA.hold("<|py") == 0
    assert LLAMA.hold("Sure") == 4


def test_a_forced_choice_is_its_json():
    required = Forced(ToolChoice.of({"tools": TOOLS, "tool_choice": "required"}))
    assert required.parse('[{"name":"add","parameters":{"a":1}},{"name":"now","parameters":{}}]') == \
        (None, [("add", {"a": 1}), ("now", {})])
    for text in ('[{"name":"add","parameters":{"a":1', "[]", '[{"name":"add"}]', '{"name":"add","parameters":{}}'):
        assert required.parse(text) is None, text
    named = Forced(ToolChoice.of({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}))
    assert named.parse('{"a": 1}') == (None, [("add", {"a": 1})]) and named.parse("[1]") is None
    assert required.hold("anything") == 0


def _replies(calls) -> Replies:
    return Replies(chat=True, rid="chatcmpl-1", model="m", dec=str, logprobs=False, retrieved=None, n=1, calls=calls)


def _streamed(calls, text: str, pieces: list[str], finish_reason: str) -> dict:
    """What a client gathers from the chunks of a choice streamed in `pieces` (OpenAI's SDK's accumulation)."""
    replies = _replies(calls)
    events = [replies.event(0, None, None, first=True)]
    events += [replies.event(0, p, None) for p in pieces]
    events += replies.finish_events(0, SimpleNamespace(text=text, finish_reason=finish_reason))
    content, tool_calls, reason = "", {}, None
    for event in events:
        choice = json.loads(event.removeprefix("data: "))["choices"][0]
        content += choice["delta"].get("content") or ""
        for call in choice["delta"].get("tool_calls", []):
            tool_calls[call["index"]] = call
        reason = choice["finish_reason"] or reason
    return {"content": content or None, "calls": [tool_calls[k] for k in sorted(tool_calls)], "reason": reason}


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "required"])
def test_a_streamed_reply_ends_as_its_whole_answer(name):
    """Split anywhere, a streamed reply's content and calls equal the whole answer's (content only grows: no piece
    of a call's text went out as content)."""
    calls = Forced(ToolChoice.of({"tools": TOOLS, "tool_choice": "required"})) if name == "required" \
        else PARSERS[name]
    texts = {"hermes": ['Sure <b>.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
                        "plain <tool text, no call", '<tool_call>{"name": "add", "arg'],
             "llama3_json": ['{"name": "add", "parameters": {"a": 1}}', "  plain {text}", '{"x": 1}'],
             "required": ['[{"name":"now","parameters":{}}]', '[{"name":"now","par']}[name]
    rng = random.Random(0)
    for text in texts:
        whole = _replies(calls).response([SimpleNamespace(text=text, finish_reason="stop", token_ids=[1])], 1)
        message = whole["choices"][0]["message"]
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            got = _streamed(calls, text, pieces, "stop")
            assert got["content"] == message["content"], (text, pieces)
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["calls"]] == \
                [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in message.get("tool_calls", [])], (text, pieces)
            assert got["reason"] == whole["choices"][0]["finish_reason"], (text, pieces)
        if "tool_calls" in message:
            assert whole["choices"][0]["finish_reason"] == "tool_calls"
            assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
        else:
            assert message["content"] == text and whole["choices"][0]["finish_reason"] == "stop"
