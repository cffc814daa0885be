"""What a chat reply's text holds beside its answer: tool calls (infer/tool_parsers.py: the model families' formats
that tool_choice "auto" needs, a forced choice's JSON) and reasoning (infer/reasoning.py: `<think>` blocks); a
streamed reply holds back the text that may be a call or may close the thinking -- streamed in any pieces, a choice
ends as its whole answer does."""

import json
import random
from types import SimpleNamespace

import pytest

from meshlm.infer.reasoning import PARSERS as REASONING
from meshlm.infer.requests import ToolChoice
from meshlm.infer.responses import Replies
from meshlm.infer.tool_parsers import PARSERS, Auto, Forced

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
    assert HERMES.parse('<tool_call>{"name": "now", "arguments": {}}</tool_call> bye') == (None, [("now", {})])
    for text in ("no call here", "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1",  # cut short
                 "<tool_call>[1, 2]</tool_call>", '<tool_call>{"name": "", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
                 '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
                 '<tool_call>{"name": "now"}</tool_call>'):  # no arguments: not a call (a review)
        assert HERMES.parse(text) is None, text  # answered as text
    # streamed: held from where the marker begins or may begin
    assert HERMES.hold("Hi <tool_call>{") == 3 and HERMES.hold("Hi <tool") == 3 and HERMES.hold("Hi <") == 3
    assert HERMES.hold("Hi <b>") == 6 and HERMES.hold("") == 0


def test_llama3_json_reads_a_reply_that_is_only_calls():
    assert LLAMA.parse('{"name": "add", "parameters": {"a": 1}}; {"name": "now", "arguments": {}}') == \
        (None, [("add", {"a": 1}), ("now", {})])
    assert LLAMA.parse('<|python_tag|>{"name": "now", "parameters": {}}') == (None, [("now", {})])
    for text in ("The answer is 3.", '{"a": 1}', '{"name": "add", "parameters": {"a": 1}} and text', "", "{",
                 '{"name": "Alice", "age": 30}'):  # an answer in JSON with a name is not a call (a review)
        assert LLAMA.parse(text) is None, text
    assert LLAMA.hold("  ") == 0 and LLAMA.hold(' {"na') == 0 and LLAMA.hold("<|py") == 0
    assert LLAMA.hold("Sure") == 4


def test_auto_takes_calls_of_the_requests_tools_and_one_without_parallel_calls():
    two = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "now", "arguments": {}}' \
          '</tool_call>'
    auto = Auto(HERMES, ToolChoice.of({"tools": TOOLS}, "hermes"))
    assert auto.parse(two) == (None, [("add", {"a": 1}), ("now", {})]) and auto.hold("x<tool") == 1
    one = Auto(HERMES, ToolChoice.of({"tools": TOOLS, "parallel_tool_calls": False}, "hermes"))
    assert one.parse(two) == (None, [("add", {"a": 1})])  # parallel_tool_calls false: at most one call
    only_now = Auto(HERMES, ToolChoice.of({"tools": TOOLS[1:]}, "hermes"))
    assert only_now.parse(two) is None  # a call of a function the request did not list: text


def test_a_forced_choice_is_its_json():
    required = Forced(ToolChoice.of({"tools": TOOLS, "tool_choice": "required"}))
    assert required.parse('[{"name":"add","parameters":{"a":1}},{"name":"now","parameters":{}}]') == \
        (None, [("add", {"a": 1}), ("now", {})])
    for text in ('[{"name":"add","parameters":{"a":1', "[]", '[{"name":"add"}]', '{"name":"add","parameters":{}}'):
        assert required.parse(text) is None, text
    named = Forced(ToolChoice.of({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}))
    assert named.parse('{"a": 1}') == (None, [("add", {"a": 1})]) and named.parse("[1]") is None
    assert required.hold("anything") == 0


def test_reasoning_is_the_think_block_before_the_answer():
    r1, qwen = REASONING["deepseek_r1"], REASONING["qwen3"]
    # deepseek_r1: thinks from the first token (its template opened <think>); a leading <think> is dropped
    assert r1.split("plan</think>\n\nAnswer", r1.opens(""), final=True) == ("plan", "\n\nAnswer")
    assert r1.split("<think>plan</think>A", False, final=True) == ("plan", "A")
    assert r1.split("still thinking", True, final=True) == ("still thinking", None)  # cut short while thinking
    assert r1.split("plan</th", True, final=False) == ("plan", None)  # may be </think>: held back
    assert r1.split("<th", True, final=False) == (None, None)  # may be <think>
    # qwen3: thinks if the reply opens <think> or the prompt left one open; else it is all answer
    assert qwen.opens("<|im_start|>assistant\n") is False and qwen.opens("assistant\n<think>\n") is True
    assert qwen.opens("assistant\n<think>\n\n</think>\n\n") is False  # enable_thinking false
    # a prefill that closed the thinking already: no reply thinks after it, deepseek_r1's either (a review: its
    # grammar then waited for a </think> that was in the prompt)
    assert r1.opens("<think>plan</think>\n") is False and r1.opens("") is True and r1.opens("<think>\n") is True
    assert qwen.split("Hello", False, final=True) == (None, "Hello")
    assert qwen.split("<think>r</think>a", False, final=True) == ("r", "a")
    assert qwen.split("<th", False, final=False) == (None, None) and qwen.split("<th", False, final=True) == \
        (None, "<th")
    assert qwen.split("<think></think>a", False, final=True) == (None, "a")
    assert qwen.split("r</think>", True, final=True) == ("r", None)


def _out(text: str, finish_reason: str = "stop") -> SimpleNamespace:
    """A finished choice's output, as the engine gives it (what the answers read of it)."""
    return SimpleNamespace(text=text, finish_reason=finish_reason, token_ids=[1], num_cached_tokens=0)


def _replies(calls, reasoning=None, opened=False) -> Replies:
    return Replies(chat=True, rid="chatcmpl-1", model="m", dec=str, logprobs=False, retrieved=None, n=1, calls=calls,
                   reasoning=reasoning, thinking=opened)


def _streamed(replies: Replies, text: str, pieces: list[str], finish_reason: str) -> dict:
    """What a client gathers from the chunks of a choice streamed in `pieces` (OpenAI's SDK's accumulation)."""
    events = [replies.event(0, None, None, first=True)]
    events += [replies.event(0, p, None) for p in pieces]
    events += replies.finish_events(0, _out(text, finish_reason))
    content, reasoning, tool_calls, reason = "", "", {}, None
    for event in filter(None, events):
        choice = json.loads(event.removeprefix("data: "))["choices"][0]
        content += choice["delta"].get("content") or ""
        reasoning += choice["delta"].get("reasoning") or ""
        assert choice["delta"].get("reasoning") == choice["delta"].get("reasoning_content")
        for call in choice["delta"].get("tool_calls", []):
            tool_calls[call["index"]] = call
        reason = choice["finish_reason"] or reason
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [tool_calls[k] for k in sorted(tool_calls)], "reason": reason}


CASES = {  # texts of each (tool-call format, reasoning format, reply starts thinking)
    ("hermes", None, False): ['Sure <b>.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
                              "plain <tool text, no call", '<tool_call>{"name": "add", "arg'],
    ("llama3_json", None, False): ['{"name": "add", "parameters": {"a": 1}}', "  plain {text}", '{"x": 1}'],
    ("required", None, False): ['[{"name":"now","parameters":{}}]', '[{"name":"now","par'],
    (None, "deepseek_r1", True): ["I think</think>\n\nIt is 4.", "<think>hm</think>ok", "cut while thinking </thi",
                                  "</think>", "<think>"],
    (None, "qwen3", False): ["<think>\nr</think>\n\nA <think> in text", "no thinking at all", "<thin", ""],
    (None, "qwen3", True): ["r</think>a", "r only"],
    ("hermes", "qwen3", False): ['<think>call now</think>\n\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
                                 '<think>x <tool_call> in thought</think>no call'],
}


@pytest.mark.parametrize("calls, reasoning, opened", list(CASES))
def test_a_streamed_reply_ends_as_its_whole_answer(calls, reasoning, opened):
    """Split anywhere, a streamed reply's reasoning, content and calls equal the whole answer's (each only grows: no
    piece of a call's text or of </think> went out as content or reasoning)."""
    texts = CASES[calls, reasoning, opened]
    calls = Forced(ToolChoice.of({"tools": TOOLS, "tool_choice": "required"})) if calls == "required" \
        else None if calls is None else Auto(PARSERS[calls], ToolChoice.of({"tools": TOOLS}, calls))
    reasoning = REASONING.get(reasoning)
    rng = random.Random(0)
    for text in texts:
        whole = _replies(calls, reasoning, opened).response([_out(text)], 1)
        message = whole["choices"][0]["message"]
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1)))) if text else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            got = _streamed(_replies(calls, reasoning, opened), text, pieces, "stop")
            assert got["content"] == (message["content"] or None), (text, pieces)  # a stream's "" is no content
            assert got["reasoning"] == message.get("reasoning") == message.get("reasoning_content"), (text, pieces)
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["calls"]] == \
                [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in message.get("tool_calls", [])], (text, pieces)
            assert got["reason"] == whole["choices"][0]["finish_reason"], (text, pieces)
        if "tool_calls" in message:
            assert whole["choices"][0]["finish_reason"] == "tool_calls"
            assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
        elif reasoning is None:
            assert message["content"] == text and whole["choices"][0]["finish_reason"] == "stop"
    # what the whole answers are, spelled out for a few
    hermes = Auto(PARSERS["hermes"], ToolChoice.of({"tools": TOOLS}, "hermes"))
    answer = _replies(hermes, REASONING["qwen3"]).response([_out(CASES["hermes", "qwen3", False][0])], 1)
    assert answer["choices"][0]["message"]["reasoning"] == "call now" and answer["choices"][0]["message"][
        "content"] == "\n\n" and answer["choices"][0]["finish_reason"] == "tool_calls"
    answer = _replies(None, REASONING["deepseek_r1"], True).response([_out("I think</think>\n\nIt is 4.")], 1)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "\n\nIt is 4.",
                                               "reasoning": "I think", "reasoning_content": "I think"}


def test_a_streamed_chat_becomes_the_responses_events_of_its_whole_response():
    """The Responses API's events of a chat stream that thinks, answers and calls a function: each item added,
    its deltas, its done; the completed response holds what the whole answer's Response holds."""
    from meshlm.infer.openai_responses import ResponseEvents, response_of

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"reasoning": "hm", "reasoning_content": "hm"},
                            "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"reasoning": "m", "reasoning_content": "m"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "Let me"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": " check."}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}]
    events = ResponseEvents({"model": "m", "input": "x"}, "m")
    lines = events.start() + [e for c in chunks for e in events.chunk(c)] + events.finish()
    parsed = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert all(line.startswith(f"event: {p['type']}\n") for line, p in zip(lines, parsed))
    assert [p["type"] for p in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    final = parsed[-1]["response"]
    whole = response_of({"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me check.", "reasoning": "hmm", "tool_calls": [call]}}],
        "usage": chunks[-1]["usage"]}, {"model": "m", "input": "x"}, "m")
    strip = [{k: v for k, v in item.items() if k != "id"} for item in whole["output"]]
    assert [{k: v for k, v in item.items() if k != "id"} for item in final["output"]] == strip
    assert final["status"] == whole["status"] == "completed" and final["usage"] == whole["usage"]
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message", "function_call"]


@pytest.mark.parametrize("deltas, finish_reason, kinds", [
    ([{"reasoning": "hm"}], "length", ["reasoning"]),  # cut while thinking: no message, whole or streamed
    ([], "stop", ["message"]),  # nothing at all: an empty message, as the whole Response has
    ([{"content": "hi"}], "length", ["message"]),
])
def test_a_streamed_response_has_the_items_of_the_whole_one(deltas, finish_reason, kinds):
    """The items a stream ends with are the whole Response's, whatever the reply held (a review: a reply cut while
    thinking had a message only when whole)."""
    from meshlm.infer.openai_responses import ResponseEvents, response_of

    events = ResponseEvents({"model": "m", "input": "x"}, "m")
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]})
    lines = events.start() + [e for c in chunks for e in events.chunk(c)] + events.finish()
    parsed = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    message = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas) or None,
               "reasoning": "".join(d.get("reasoning", "") for d in deltas) or None}
    whole = response_of({"choices": [{"finish_reason": finish_reason, "message": message}], "usage": None},
                        {"model": "m", "input": "x"}, "m")
    final = parsed[-1]["response"]
    assert [o["type"] for o in final["output"]] == [o["type"] for o in whole["output"]] == kinds
    assert [{k: v for k, v in o.items() if k != "id"} for o in final["output"]] == \
        [{k: v for k, v in o.items() if k != "id"} for o in whole["output"]]
    assert final["status"] == whole["status"] == ("incomplete" if finish_reason == "length" else "completed")


def test_a_chat_error_is_named_as_the_responses_request_names_its_fields():
    from meshlm.infer.openai_responses import renamed

    assert renamed("max_tokens", "max_tokens=0 must be an integer >= 1") == (
        "max_output_tokens", "max_output_tokens=0 must be an integer >= 1")
    assert renamed("tool_choice", 'give tool_choice "required", {"type": "function", "function": {"name": ...}} or '
                                  '"none"') == ("tool_choice", 'give tool_choice "required", {"type": "function", '
                                                               '"name": ...} or "none"')
    assert renamed("tool_choice", "a tool call is JSON of its own: leave out response_format / structured_outputs") \
        == ("tool_choice", "a tool call is JSON of its own: leave out text")
    assert renamed("messages", "each message needs a 'role'")[0] == "input"
