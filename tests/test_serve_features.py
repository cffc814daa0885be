"""The OpenAI API's features beyond plain text over real HTTP, against a served tiny Llama: logit_bias, the
penalties, min_p and min_tokens reaching the sampler; structured outputs (response_format, structured_outputs) and
tool calls holding the text to them; echo with prompt logprobs, as lm-evaluation-harness asks, whole, streamed and
with max_tokens 0. The server is test_serve_robust's (`serving`: one of this module's own)."""

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from test_serve_robust import CHAT, COMPLETION, HEADERS, _post, _stream, serving  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serving(tmp_path_factory, tool_call_parser="hermes", reasoning_parser="qwen3")


def test_logit_bias_penalties_min_p_and_min_tokens_reach_the_sampler(served):
    """A bias of 100 on one token makes greedy pick it every time; a repetition penalty then makes it pick it
    once (the engine's own greedy with the same parameters: tests/test_engine.py checks those against a
    reference)."""
    from meshlm.infer.sequence import SamplingParams

    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"7": 100}}
    tok = served.engine.engine.tokenizer
    assert _post(served, "/v1/completions", body)["choices"][0]["text"] == tok.decode([7] * 4)
    # a special token (<s>, id 0) is named in the logprobs but adds nothing to the text: its offsets stay put,
    # whole and streamed (found by a fuzz pass: they ran past the text)
    special = {**body, "logit_bias": {"0": 100}, "logprobs": 0}
    whole = _post(served, "/v1/completions", special)["choices"][0]
    assert whole["text"] == "" and whole["logprobs"]["tokens"] == ["<s>"] * 4
    assert whole["logprobs"]["text_offset"] == [0] * 4
    assert [x for e in _stream(served, "/v1/completions", special) if e["choices"] and e["choices"][0].get("logprobs")
            for x in e["choices"][0]["logprobs"]["text_offset"]] == [0] * 4
    penalized = {**body, "logit_bias": {"7": 5}, "repetition_penalty": 1e9, "frequency_penalty": 2}
    text = _post(served, "/v1/completions", penalized)["choices"][0]["text"]
    with served.engine._cv:
        want = served.engine.engine.generate([[5, 6]], SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True, logit_bias={7: 5}, repetition_penalty=1e9,
            frequency_penalty=2))[0]
    assert text == want.text and want.token_ids.count(7) <= 1
    # min_p 1 keeps only the most likely token: a draw at temperature 1 is greedy
    plain = {k: v for k, v in body.items() if k != "logit_bias"}
    drawn = _post(served, "/v1/completions", {**plain, "temperature": 1.0, "min_p": 1.0, "seed": 5})
    assert drawn["choices"][0]["text"] == _post(served, "/v1/completions", plain)["choices"][0]["text"]
    # min_tokens: no stop string is looked for before it (the text's first characters would stop it at once)
    text = _post(served, "/v1/completions", {**plain, "max_tokens": 8})["choices"][0]["text"]
    stopped = {**plain, "max_tokens": 8, "stop": text[:2]}
    assert _post(served, "/v1/completions", stopped)["choices"][0]["text"] == ""
    assert _post(served, "/v1/completions", {**stopped, "min_tokens": 8})["choices"][0]["text"] == text


def test_response_format_and_structured_outputs_hold_the_text_to_them(served):
    """OpenAI's response_format (json_schema) on a chat and vLLM's structured_outputs (choice) on a completion:
    a tiny random model's text follows them (tests/test_structured.py checks every kind in the engine)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    body = {**CHAT, "max_tokens": 30, "temperature": 0.8, "seed": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    out = _post(served, "/v1/chat/completions", body)["choices"][0]
    assert set(json.loads(out["message"]["content"])) == {"n"} and out["finish_reason"] == "stop", out
    body = {**COMPLETION, "max_tokens": 10, "n": 4, "temperature": 1.0, "seed": 3,
            "structured_outputs": {"choice": ["red", "green", "blue"]}}
    assert {c["text"] for c in _post(served, "/v1/completions", body)["choices"]} <= {"red", "green", "blue"}
    # a grammar the sampler cannot follow (llguidance's 2,000 items a row, reached at the first token) is the
    # request's own error: a 400 naming the field as sent, whole or streamed (a 500 before a review)
    many = {**COMPLETION, "temperature": 0, "structured_outputs": {"choice": [f"c{i}" for i in range(2500)]}}
    r = httpx.post(f"{served.url}/v1/completions", headers=HEADERS, json=many, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "structured_outputs failed at token 1" in r.json()["error"]["message"]
    events = _stream(served, "/v1/completions", many)
    assert events[-1]["error"]["param"] == "structured_outputs" and events[-1]["error"]["code"] is None, events


def test_a_server_without_llguidance_answers_a_grammar_with_501(served, monkeypatch):
    """Structured outputs on a server that lacks llguidance: the server's own lack (501, a server error naming the
    install), not the request's mistake (a 400 before)."""
    import sys

    grammars = served.engine.engine.grammars
    monkeypatch.setattr(grammars, "_ll", None)  # compiled again, and the import fails
    monkeypatch.setattr(grammars, "_last", None)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    r = httpx.post(f"{served.url}/v1/completions", headers=HEADERS, timeout=30,
                   json={**COMPLETION, "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 501 and r.json()["error"]["type"] == "server_error", r.text
    assert r.json()["error"]["param"] == "structured_outputs" and "pip install llguidance" in r.text


TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "now"}}]  # no parameters: an empty object


def test_a_required_tool_choice_may_answer_several_calls():
    """The grammar of "required": a list of calls of any tool (parallel_tool_calls false: one); its text as
    OpenAI's tool_calls."""
    from meshlm.infer.requests import APIError, ToolChoice
    from meshlm.infer.responses import tool_calls
    from meshlm.infer.tool_parsers import Forced

    tools = ToolChoice.of({"tools": TOOLS, "tool_choice": "required"})
    schema = tools.schema()
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "add"}, {"const": "now"}]
    assert ToolChoice.of({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).schema()[
        "maxItems"] == 1
    _, calls = Forced(tools).parse('[{"name":"add","parameters":{"a":1,"b":2}},{"name":"now","parameters":{}}]')
    calls = tool_calls(calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("add", {"a": 1, "b": 2}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2
    assert Forced(tools).parse('[{"name":"add","parameters":{"a":1') is None  # cut short: left as text
    # a tool whose parameters refer to their own definitions ($defs, as pydantic writes them): hoisted to the root
    # of the calls' schema, where "#/$defs/..." points (found by a review: refused as a missing pointer)
    point = {"type": "function", "function": {"name": "move", "parameters": {
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/P"}}}}}
    schema = ToolChoice.of({"tools": [*TOOLS, point], "tool_choice": "required"}).schema()
    assert set(schema["$defs"]) == {"P"} and "$defs" not in schema["items"]["anyOf"][2]["properties"]["parameters"]
    clash = {"type": "function", "function": {"name": "other", "parameters": {"$defs": {"P": {"type": "string"}}}}}
    with pytest.raises(APIError, match=r"tools define \$defs 'P' differently"):
        ToolChoice.of({"tools": [point, clash], "tool_choice": "required"}).schema()


def test_tool_choice_required_or_named_answers_tool_calls(served):
    """tool_choice "required" (one call of any tool here, parallel_tool_calls false: the context is short; the
    several-call grammar is checked above) and a named function: the reply is held to the calls' JSON, and
    answered as OpenAI's tool_calls (arguments as JSON text); a history with calls and a tool's reply is taken."""
    history = [{"role": "user", "content": "add 2"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"},
               {"role": "user", "content": "now?"}]
    for choice, seed in (("required", 1), ("required", 2), ({"type": "function", "function": {"name": "add"}}, 3)):
        body = {"model": "tiny", "messages": history, "tools": TOOLS, "tool_choice": choice, "max_tokens": 50,
                "temperature": 1.0, "seed": seed, "parallel_tool_calls": False}  # one call: the context is short
        out = _post(served, "/v1/chat/completions", body)["choices"][0]
        assert len(out["message"].get("tool_calls", [])) == 1, out
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None, out
        for call in out["message"]["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_")
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "add":
                assert set(arguments) == {"a", "b"} and all(isinstance(v, int) for v in arguments.values())
            else:
                assert call["function"]["name"] == "now" and choice == "required" and isinstance(arguments, dict)
        if choice != "required":
            assert [c["function"]["name"] for c in out["message"]["tool_calls"]] == ["add"]
    # "none": plain text, the tools only listed
    body = {"model": "tiny", "messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3}
    assert "tool_calls" not in _post(served, "/v1/chat/completions", body)["choices"][0]["message"]
    # streamed: the calls come whole in one chunk once the reply ends, as the whole answer's (refused before)
    body = {"model": "tiny", "messages": history[-1:], "tools": TOOLS, "tool_choice": "required", "max_tokens": 50,
            "temperature": 0, "parallel_tool_calls": False}
    whole = _post(served, "/v1/chat/completions", body)["choices"][0]
    events = [e["choices"][0] for e in _stream(served, "/v1/chat/completions", body)]
    assert not "".join(c["delta"].get("content") or "" for c in events), events  # no call's text as content
    calls = [call for c in events for call in c["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in calls] == [(0, whole["message"]["tool_calls"][0]["function"])]
    assert events[-1]["finish_reason"] == "tool_calls"


def test_tool_choice_auto_reads_the_models_own_calls(served):
    """tool_choice "auto" (the default with tools) on a server started with a tool-call parser (hermes here): the
    model's text before `<tool_call>` is the content, the blocks its calls, whole and streamed; a reply without
    one is text. A tiny random model does not call tools of itself: `structured_outputs` makes it write them."""
    call = '<tool_call>{"name":"now","arguments":{}}</tool_call>'
    body = {"model": "tiny", "messages": [{"role": "user", "content": "time?"}], "tools": TOOLS[1:],
            "max_tokens": 80, "temperature": 0, "structured_outputs": {"choice": ["Ok " + call]}}
    whole = _post(served, "/v1/chat/completions", body)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Ok ", whole
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == \
        [("now", "{}")]
    events = [e["choices"][0] for e in _stream(served, "/v1/chat/completions", {**body, "tool_choice": "auto"})]
    assert "".join(c["delta"].get("content") or "" for c in events) == "Ok "
    calls = [call for c in events for call in c["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in calls] == [(0, {"name": "now", "arguments": "{}"})]
    assert events[-1]["finish_reason"] == "tool_calls"
    # no call in the text: content, as without tools; a broken call stays text
    for text, reason in (("Ok no call", "stop"), ("<tool_call>{oops}", "stop")):
        plain = {**body, "structured_outputs": {"choice": [text]}}
        out = _post(served, "/v1/chat/completions", plain)["choices"][0]
        # (a reasoning parser's fields too: a reply held to a grammar is split like any other)
        assert out["message"] == {"role": "assistant", "content": text, "reasoning": None, "reasoning_content": None} \
            and out["finish_reason"] == reason, out
        events = [e["choices"][0] for e in _stream(served, "/v1/chat/completions", plain)]
        assert "".join(c["delta"].get("content") or "" for c in events) == text


def test_a_reasoning_models_thinking_is_answered_apart(served):
    """With --reasoning-parser qwen3, a reply whose prompt left <think> open (here by continuing a prefilled
    assistant message, continue_final_message) is its thinking: `reasoning` / `reasoning_content`, whole and
    streamed, no content until </think> (a tiny random model never writes it: tests/test_reply_parsers.py splits
    replies that do); a reply to a prompt that did not open one is all content."""
    ask = [{"role": "user", "content": "2+2?"}]
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = _post(served, "/v1/chat/completions", {**body, "messages": ask})["choices"][0]["message"]
    assert plain["content"] and plain["reasoning"] is None and plain["reasoning_content"] is None, plain
    # a user's own <think> opens nothing: only what the template writes of the reply does (a fuzz pass: the whole
    # reply became reasoning)
    tag = {**body, "messages": [{"role": "user", "content": "what does <think> mean?"}]}
    assert _post(served, "/v1/chat/completions", tag)["choices"][0]["message"]["reasoning"] is None
    opened = {**body, "messages": [*ask, {"role": "assistant", "content": "<think>\n"}],
              "continue_final_message": True, "add_generation_prompt": False}
    whole = _post(served, "/v1/chat/completions", opened)["choices"][0]
    assert whole["message"]["content"] is None and whole["message"]["reasoning"], whole
    assert whole["message"]["reasoning"] == whole["message"]["reasoning_content"]
    events = [e["choices"][0] for e in _stream(served, "/v1/chat/completions", opened)]
    assert "".join(c["delta"].get("reasoning") or "" for c in events) == whole["message"]["reasoning"]
    assert not any(c["delta"].get("content") for c in events) and events[-1]["finish_reason"] == "length"
    # the prefilled text is the prompt's end (the fallback template would close the message with a newline)
    ids = served.engine.engine.tokenizer.encode_chat([*ask, {"role": "assistant", "content": "<think>\n"}],
                                                     add_generation_prompt=False, continue_final_message=True)
    assert served.engine.engine.tokenizer.decode(ids).endswith("<|assistant|>\n<think>\n")


def test_a_grammar_holds_a_thinking_reply_only_after_its_thinking(served):
    """A reply whose prompt opened <think> is free until its </think> (the engine's structured_after, checked in
    tests/test_structured.py): the tiny model never writes one, so its whole reply is reasoning, not the JSON a
    reply that does not think is held to (test_response_format_and_structured_outputs_hold_the_text_to_them)."""
    ask = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\n"}]
    body = {"model": "tiny", "messages": ask, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "response_format": {"type": "json_object"}}
    out = _post(served, "/v1/chat/completions", body)["choices"][0]
    assert out["message"]["content"] is None and out["message"]["reasoning"], out
    free = _post(served, "/v1/chat/completions", {k: v for k, v in body.items() if k != "response_format"})
    assert free["choices"][0]["message"]["reasoning"] == out["message"]["reasoning"]


def test_tokenize_and_detokenize_as_vllm(served):
    """POST /tokenize: a completion's prompt or a chat's messages as the ids the model reads (the chat's count is
    its completion's prompt_tokens), with their texts where asked; /detokenize gives the text back."""
    tok = served.engine.engine.tokenizer
    out = _post(served, "/tokenize", {"model": "tiny", "prompt": "hello world", "return_token_strs": True})
    assert out["tokens"] == tok.encode("hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 128 and "".join(out["token_strs"]) == tok.decode(out["tokens"])
    plain = _post(served, "/tokenize", {"model": "tiny", "prompt": "hello world", "add_special_tokens": False})
    assert plain["tokens"] == tok.encode("hello world", add_special_tokens=False) and plain["token_strs"] is None
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS[1:]}
    counted = _post(served, "/tokenize", chat)["count"]
    answer = _post(served, "/v1/chat/completions", {**chat, "tool_choice": "none", "max_tokens": 1})
    assert counted == answer["usage"]["prompt_tokens"]
    assert _post(served, "/detokenize", {"model": "tiny", "tokens": out["tokens"]}) == {"prompt": "hello world"}
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": chat["messages"]}, "prompt"),
                              ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "a"}, "tokens")):
        r = httpx.post(served.url + path, headers=HEADERS, json={"model": "tiny", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_the_responses_api_answers_as_the_chat_it_asks_for(served):
    """POST /v1/responses (OpenAI's newer API, stateless as vLLM serves it): instructions and input as the chat's
    messages, its text as the chat's, whole and streamed as the Responses events; items (text parts, a function call
    and its output) and function tools in the Responses' own form; errors naming the Responses fields."""
    chat = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello world"}], "max_tokens": 5,
            "temperature": 0}
    want = _post(served, "/v1/chat/completions", chat)
    body = {"model": "tiny", "instructions": "be brief", "input": "hello world", "max_output_tokens": 5,
            "temperature": 0}
    got = _post(served, "/v1/responses", body)
    assert got["object"] == "response" and got["store"] is False and got["id"].startswith("resp_")
    assert [item["type"] for item in got["output"]] == ["message"]
    assert got["output"][0]["content"][0]["text"] == want["choices"][0]["message"]["content"]
    assert got["status"] == ("incomplete" if want["choices"][0]["finish_reason"] == "length" else "completed")
    assert got["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["output_tokens"] == want["usage"]["completion_tokens"]
    events = _stream(served, "/v1/responses", body)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == f"response.{got['status']}", kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == got["output"][0]["content"][0]["text"] == events[-1]["response"]["output"][0]["content"][0]["text"]
    streamed_usage = events[-1]["response"]["usage"]
    assert {**streamed_usage, "input_tokens_details": None} == {**got["usage"], "input_tokens_details": None}
    # the cache's state may differ between the two: a count of the prompt's tokens
    assert 0 <= streamed_usage["input_tokens_details"]["cached_tokens"] <= streamed_usage["input_tokens"]
    # items: text parts, the model's earlier function call and its output; a forced function call answered as a
    # function_call item, whole and streamed
    items = [{"role": "user", "content": [{"type": "input_text", "text": "add 2"}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "3"},
             {"type": "message", "role": "user", "content": "again"}]
    tools = [{"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}]
    forced = {"model": "tiny", "input": items, "tools": tools, "tool_choice": {"type": "function", "name": "add"},
              "max_output_tokens": 40, "temperature": 0}
    got = _post(served, "/v1/responses", forced)
    call = got["output"][-1]
    assert call["type"] == "function_call" and call["name"] == "add" and set(json.loads(call["arguments"])) == \
        {"a", "b"}, got
    as_chat = {"model": "tiny", "messages": [
        {"role": "user", "content": "add 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}, {"role": "user", "content": "again"}],
        "tools": TOOLS[:1], "tool_choice": {"type": "function", "function": {"name": "add"}}, "max_tokens": 40,
        "temperature": 0}
    assert got["usage"]["input_tokens"] == _post(served, "/v1/chat/completions", as_chat)["usage"]["prompt_tokens"]
    events = _stream(served, "/v1/responses", forced)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0]["arguments"] == call["arguments"], events
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"][-1]["name"] == "add"
    for change, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input"), ({"input": []}, "input"),
                          ({"tools": [{"type": "web_search"}]}, "tools"),
                          ({"max_output_tokens": -1}, "max_output_tokens"),
                          ({"text": {"format": {"type": "xml"}}}, "text"), ({"include": ["reasoning"]}, "include"),
                          ({"max_tool_calls": 1}, "max_tool_calls"), ({"tools": [{"type": "function"}]}, "tools"),
                          ({"tool_choice": {"type": "function"}}, "tool_choice"), ({"seed": "x"}, "seed"),
                          ({"max_output_tokens": 10**6}, "input"),
                          # found by a fuzz pass: answered 200, or named a chat field
                          ({"metadata": 5}, "metadata"), ({"reasoning": "junk"}, "reasoning"), ({"text": 5}, "text"),
                          ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
                          ({"response_format": {"type": "json_object"}}, "response_format"), ({"n": 2}, "n"),
                          ({"instructions": "\ud800"}, "instructions"),
                          ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
                          ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
                          ({"tools": tools, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice")):
        r = httpx.post(served.url + "/v1/responses", headers=HEADERS, content=json.dumps({**body, **change}),
                       timeout=30)  # json.dumps escapes a lone surrogate, which httpx would not encode
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (change, r.text)
        assert "max_tokens" not in r.json()["error"]["message"], r.text  # the chat path's words renamed
        assert "\"function\": {" not in r.json()["error"]["message"], r.text  # the Responses' own shapes
        assert "structured_outputs" not in r.json()["error"]["message"] or param == "structured_outputs", r.text
    # a text format beside a forced call: named as text alone (a fuzz pass: "text / structured_outputs")
    r = httpx.post(served.url + "/v1/responses", headers=HEADERS, timeout=30, json={
        **forced, "tool_choice": "required", "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 400 and "leave out text" in r.json()["error"]["message"], r.text
    # a request that fails mid-way: the error event, then response.failed (a fuzz pass: the stream just ended)
    eos = served.engine.engine.eos_token_ids[0]
    events = _stream(served, "/v1/responses", {**body, "allowed_token_ids": [eos], "min_tokens": 2})
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"], events
    assert events[-1]["response"]["status"] == "failed" and "allowed_token_ids" in events[-1]["response"]["error"][
        "message"]
    text_events = [e for e in _stream(served, "/v1/responses", body) if e["type"].startswith("response.output_text")]
    assert text_events and all(e["logprobs"] == [] for e in text_events)  # the SDK's events require the key
    # the chat path's extras pass on (a review: seed was dropped): a draw with a seed is the same draw again
    def drawn(seed):
        answer = _post(served, "/v1/responses", {**body, "temperature": 1.0, "seed": seed, "max_output_tokens": 8})
        return answer["output"][0]["content"][0]["text"]

    assert drawn(7) == drawn(7) and len({drawn(s) for s in range(7, 11)}) > 1
    # and the chat path's own refusals and options: vLLM's guided_json, retrieval without an index (a review: they
    # were dropped, a grammar ignored); a text object that is not a format
    for change, param in (({"guided_json": {"type": "object"}}, "guided_json"), ({"rag": {"top_k": 2}}, "rag"),
                          ({"text": {"foo": 1}}, "text"), ({"text": {"format": {"type": "json_schema", "name": "x"}}},
                                                         "text"), ({"echo": True}, "echo")):
        r = httpx.post(served.url + "/v1/responses", headers=HEADERS, json={**body, **change}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (change, r.text)
    assert _post(served, "/v1/responses", {**body, "top_logprobs": 0, "store": True, "user": "u"})["status"]


def test_the_models_generation_config_sets_the_sampling_defaults(served, tmp_path, capsys):
    """vLLM's --generation-config auto: the sampling fields a model's generation_config.json recommends are the
    defaults of requests that leave them out (a request's own value wins); `vllm` reads none; a file whose values
    no request could take is refused in one line before the server starts."""
    from argparse import Namespace

    from fastapi.testclient import TestClient

    from meshlm.cli import main
    from meshlm.cli.serve import sampling_defaults_of
    from meshlm.infer.server import create_app
    from meshlm.tokenizer import read_generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.0, "top_k": 5, "max_new_tokens": 9, "eos_token_id": 1}))
    assert read_generation_defaults(tmp_path) == {"temperature": 0.0, "top_k": 5}
    assert sampling_defaults_of(Namespace(model=str(tmp_path), generation_config="auto")) == {"temperature": 0.0,
                                                                                              "top_k": 5}
    assert sampling_defaults_of(Namespace(model=str(tmp_path), generation_config="vllm")) == {}
    assert sampling_defaults_of(Namespace(model="elsewhere", generation_config=str(tmp_path)))["top_k"] == 5
    app = create_app(served.engine, model_name="tiny", api_key="k", sampling_defaults={"temperature": 0.0})
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 6, "ignore_eos": True}
    greedy = _post(served, "/v1/completions", {**body, "temperature": 0})["choices"][0]["text"]
    with TestClient(app) as client:
        headers = {"Authorization": "Bearer k"}
        assert client.post("/v1/completions", json=body, headers=headers).json()["choices"][0]["text"] == greedy
        drawn = [client.post("/v1/completions", json={**body, "temperature": 1.0, "seed": s}, headers=headers).json()
                 for s in range(4)]
    assert any(d["choices"][0]["text"] != greedy for d in drawn)  # the request's own temperature wins
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    assert main(["serve", "--model", str(tmp_path), "--generation-config", "auto"]) == 2
    assert "generation_config.json: temperature=-1.0 must be >= 0" in capsys.readouterr().err


def test_a_completion_echoes_its_prompt_with_each_tokens_logprob_as_lm_eval_asks(served):
    """lm-evaluation-harness's loglikelihood request to an OpenAI completions server (token ids, echo, logprobs 1,
    max_tokens 1, temperature 0): the logprobs cover the prompt, the first token's null, then the generated token;
    each prompt token's is the model's own given the tokens before it (one forward over the prompt), whatever the
    prefix cache holds."""
    import torch

    prompt = [5, 40, 41, 42, 43, 44, 45, 46, 47]
    body = {"model": "tiny", "prompt": [prompt], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    for _ in range(2):  # the second time its blocks are in the prefix cache: still every position is computed
        r = httpx.post(f"{served.url}/v1/completions", headers=HEADERS, json=body, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        with torch.no_grad():
            ref = torch.log_softmax(served.engine.engine.model(torch.tensor([prompt])).float(), -1)[0]
        for p in range(1, len(prompt)):
            assert abs(lp["token_logprobs"][p] - float(ref[p - 1, prompt[p]])) < 1e-5, p
            assert len(lp["top_logprobs"][p]) == 1
        assert choice["text"].startswith(served.engine.engine.tokenizer.decode(prompt))
        # where each token's text begins in the choice's text (OpenAI's legacy field)
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(prompt) + 1)]
    # max_tokens 0 (OpenAI's legacy API, HELM): the prompt and its logprobs, no token
    r = httpx.post(f"{served.url}/v1/completions", headers=HEADERS, json={**body, "max_tokens": 0}, timeout=30)
    assert r.status_code == 200, r.text
    only = r.json()
    assert only["choices"][0]["text"] == served.engine.engine.tokenizer.decode(prompt)
    assert only["choices"][0]["logprobs"] == {k: v[:-1] for k, v in lp.items()}
    assert only["choices"][0]["finish_reason"] == "length" and only["usage"]["completion_tokens"] == 0
    r = httpx.post(f"{served.url}/v1/completions", headers=HEADERS, json={**body, "max_tokens": 0, "echo": False},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(f"{served.url}/v1/completions", headers=HEADERS, timeout=30,
                   json={"model": "tiny", "prompt": "hello world", "max_tokens": 2, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hello world"), r.text
    r = httpx.post(f"{served.url}/v1/chat/completions", headers=HEADERS, json={**CHAT, "echo": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    # streamed: the prompt (and its logprobs) in the chunk before the first token's; the chunks add up to the answer
    for tokens in (3, 0):
        scored = {**body, "max_tokens": tokens, "prompt": [prompt, prompt[:4]], "ignore_eos": True}
        whole = _post(served, "/v1/completions", scored)
        events = _stream(served, "/v1/completions", {**scored, "stream_options": {"include_usage": True}})
        assert {**events[-1]["usage"], "prompt_tokens_details": None} == {**whole["usage"],
                                                                           "prompt_tokens_details": None}
        for choice in whole["choices"]:
            mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == choice["index"]]
            assert "".join(c["text"] for c in mine) == choice["text"]
            got = {k: [x for c in mine if c.get("logprobs") for x in c["logprobs"][k]] for k in lp}
            want = choice["logprobs"]
            assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
            # the same numbers up to float32 (the two runs batch their steps differently)
            assert [None if v is None else pytest.approx(v, abs=1e-5) for v in want["token_logprobs"]] == \
                got["token_logprobs"]
            assert [None if d is None else pytest.approx(d, abs=1e-5) for d in want["top_logprobs"]] == \
                got["top_logprobs"]
            assert mine[-1]["finish_reason"] == choice["finish_reason"] == "length"
