"""The OpenAI API's request bodies, checked: every malformed value becomes an `APIError` (a 4xx with an
OpenAI-style error body naming the field), before anything reaches the engine.

Responsible for: the body as JSON naming the served model (`json_body`), sampling parameters
(`sampling_params_from`: penalties, structured outputs (`structured_outputs`), vLLM's extras, the server's
defaults for what a request leaves out), the options of a completion (`RequestOptions.of`: n, stream, echo, rag),
a chat's tools (`ToolChoice`), chat messages and how they become the prompt (`chat_template_options`), completion
prompts, the `rag` option and the size limits of a request (`read_limited`: a body over the limit is a 413).
Not responsible for: HTTP, the engine, retrieval or the responses (server.py, engine.py, rag.py, responses.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from meshlm.infer.sequence import SamplingError, SamplingParams
from meshlm.messages import checked_text, short, template_messages


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


async def read_limited(request, limit: int) -> bytes:
    """A request's raw body (an ASGI request: headers, `stream()`); a 413 APIError once it is over `limit` bytes,
    whether it declares its length or not."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body has {declared} bytes; at most {limit} are accepted")
    raw = bytearray()
    try:
        async for chunk in request.stream():  # counted as it arrives: a chunked upload has no length
            raw += chunk
            if len(raw) > limit:
                raise APIError(413, f"the body is over {limit} bytes, the most accepted")
    except Exception as e:  # starlette's ClientDisconnect: nobody is left to answer
        if type(e).__name__ != "ClientDisconnect":
            raise
        raise APIError(CLIENT_LEFT, "the client left before its body arrived") from None
    return bytes(raw)


CLIENT_LEFT = 499  # the status logged for a request whose client hung up (nginx's convention)


def json_body(raw: bytes, *, model_name: str) -> dict:
    """A request's body: a JSON object whose "model" is the one this server serves."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise APIError(400, "'model' is required", param="model")
    if model != model_name:
        raise APIError(404, f"the model {short(model)} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    return body


@dataclass
class RequestOptions:
    """What a completion or chat completion asks for besides its prompts."""

    params: SamplingParams
    n: int  # choices per prompt
    stream: bool
    include_usage: bool  # a streamed answer ends with the token usage (stream_options)
    echo: bool  # a completion's text (and logprobs) begin with its prompt's
    rag: tuple[int, str] | None  # (top_k, mode) of retrieval, or None
    prompt_only: bool = False  # echo with max_tokens 0: the prompt and its logprobs, no token generated
    tools: "ToolChoice | None" = None  # a chat's tools and tool_choice

    @classmethod
    def of(cls, body: dict, *, chat: bool, rag_index, rag_top_k: int, tool_call_parser: str | None = None,
           defaults: dict | None = None) -> "RequestOptions":
        tools = ToolChoice.of(body, tool_call_parser) if chat else None
        params = sampling_params_from(body, chat=chat, tools=tools, defaults=defaults)
        n = number(body, "n", 1, int, count=True)
        if not 1 <= n <= MAX_CHOICES:
            raise APIError(400, f"n={n} must be between 1 and {MAX_CHOICES}", param="n")
        if body.get("best_of") not in (None, n):
            raise APIError(400, f"best_of={short(body['best_of'])}: only best_of == n is supported", param="best_of")
        stream = boolean(body, "stream")
        echo = not chat and boolean(body, "echo")
        for key in ("stop", "stop_token_ids"):  # they would cut the calls' JSON, which would then come back as text
            if tools is not None and tools.calls and body.get(key):
                raise APIError(400, f"{key} would cut a tool call short: leave it out with tool_choice "
                                    f"{tools.name and 'naming a function' or 'required'}", param=key)
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise APIError(400, "stream_options applies to a streamed answer: give stream: true with it",
                               param="stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage"}:
                raise APIError(400, "stream_options must be an object such as {\"include_usage\": true}",
                               param="stream_options")
        return cls(params, n, stream, include_usage=boolean(options or {}, "include_usage"), echo=echo,
                   rag=rag_options(body.get("rag"), rag_index, rag_top_k),
                   prompt_only=echo and echo_without_tokens(body), tools=tools)


def echo_without_tokens(body: dict) -> bool:
    """A completion that asks for its prompt back and no token (echo, max_tokens 0: OpenAI's legacy API answered
    it, HELM and older lm-eval score prompts so). The engine samples one token, which the answer leaves out, as
    vLLM does."""
    return boolean(body, "echo") and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)


def number(body: dict, key: str, default, kind=float, *, allow_none=True, count=False):
    """`body[key]` as a finite `kind`, else an APIError naming it; `count`: a count of things (choices, tokens),
    refused from 2**64 on, so that no message prints an int(1e308) of 309 digits."""
    value = body.get(key, default)
    if value is None and allow_none:
        return default
    # json.loads accepts NaN and Infinity: refused here (int(inf) would raise OverflowError, a 500).
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value)) or (kind is int and int(value) != value)):
        raise APIError(400, f"{key}={short(value)} must be {'an integer' if kind is int else 'a finite number'}",
                       param=key)
    if count and abs(value) >= 1 << 64:
        raise APIError(400, f"{key}={short(value)} is out of range", param=key)
    try:
        return kind(value)
    except OverflowError:  # float(10**400)
        raise APIError(400, f"{key}={short(value)} is out of range", param=key) from None


def boolean(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{key}={short(value)} must be true or false", param=key)
    return value


def check_text(text: str, param: str) -> str:
    """Refuse text that is not valid Unicode (JSON lets a lone surrogate such as \\ud800 through)."""
    try:
        return checked_text(text, param)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


# Parameters of the OpenAI API this server does not implement, and the values that ask for nothing: a request with
# any other value is refused, naming it, rather than answered as if it had not asked. A chat also has no `echo` (a
# completion echoes its prompt: CHAT_UNSUPPORTED).
UNSUPPORTED = {"suffix": ("",), "functions": ([],), "function_call": ("none",),
               # vLLM's extra sampling fields
               "bad_words": ([],), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
               "truncate_prompt_tokens": (), "use_beam_search": (False,), "prompt_logprobs": ()}
CHAT_UNSUPPORTED = {**UNSUPPORTED, "echo": (False,), "chat_template": ()}  # the template is the model's
COMPLETION_UNSUPPORTED = {**UNSUPPORTED, "tools": ([],), "tool_choice": ("none",)}  # tools are the chat API's


# What the API samples with where a request leaves these out and the server has no defaults of its own (the model's
# generation_config.json, `tokenizer.read_generation_defaults`, which names the same fields)
API_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_params_from(body: dict, *, chat: bool, tools: "ToolChoice | None" = None,
                         defaults: dict | None = None) -> SamplingParams:
    """The request's sampling parameters; `defaults`: the server's for the fields it leaves out (the model's
    generation_config.json, `tokenizer.read_generation_defaults`), else the API's."""
    default = {**API_SAMPLING_DEFAULTS, **(defaults or {})}
    for key, plain in (CHAT_UNSUPPORTED if chat else COMPLETION_UNSUPPORTED).items():
        if body.get(key) is not None and body[key] not in plain:
            raise APIError(400, f"{key}={short(body[key])} is not supported by this server; leave it out",
                           param=key)
    given = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if not chat and "max_completion_tokens" in given:
        raise APIError(400, "max_completion_tokens is the chat API's; a completion takes max_tokens",
                       param="max_completion_tokens")
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise APIError(400, "give one of max_tokens and max_completion_tokens (max_tokens is the older name)",
                       param="max_tokens")
    max_key = given[-1] if given else "max_tokens"
    for old in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):  # vLLM's older names
        if body.get(old) is not None:
            raise APIError(400, f"{old} is vLLM's older name: give structured_outputs {{\"{old[7:]}\": ...}}",
                           param=old)
    if not chat and echo_without_tokens(body) and body.get("min_tokens"):
        raise APIError(400, "min_tokens asks for tokens where max_tokens 0 (with echo) asks for none",
                       param="min_tokens")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise APIError(400, "stop must be a string or a list of strings", param="stop")
    for s in [stop] if isinstance(stop, str) else stop or []:
        check_text(s, "stop")
    if isinstance(stop, list) and len(stop) > 16:
        raise APIError(400, f"{len(stop)} stop strings: at most 16", param="stop")
    logprobs = body.get("logprobs")
    logprobs_key = "top_logprobs" if chat else "logprobs"
    if chat:  # chat: logprobs is a boolean, the count is top_logprobs
        if body.get("top_logprobs") is not None and not boolean(body, "logprobs"):
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = number(body, "top_logprobs", 0, int, count=True) if boolean(body, "logprobs") else None
    elif logprobs is not None:
        logprobs = number(body, "logprobs", None, int, count=True)
    stop_ids = token_ids(body, "stop_token_ids")
    try:
        return SamplingParams(
            temperature=number(body, "temperature", default["temperature"]),
            top_p=number(body, "top_p", default["top_p"]), min_p=number(body, "min_p", default["min_p"]),
            min_tokens=number(body, "min_tokens", 0, int, count=True),
            top_k=number(body, "top_k", default["top_k"], int),
            # chat's default: up to the context (OpenAI's); a completion's: 16 (OpenAI's legacy default)
            max_tokens=1 if not chat and echo_without_tokens(body) else number(body, max_key, None if chat else 16,
                                                                                int, count=True),
            seed=number(body, "seed", None, int), stop=stop, stop_token_ids=stop_ids, logprobs=logprobs,
            ignore_eos=boolean(body, "ignore_eos"),
            num_speculative_tokens=number(body, "num_speculative_tokens", None, int, count=True),
            prompt_logprobs=logprobs if not chat and boolean(body, "echo") else None,
            presence_penalty=number(body, "presence_penalty", 0.0),
            frequency_penalty=number(body, "frequency_penalty", 0.0),
            repetition_penalty=number(body, "repetition_penalty", default["repetition_penalty"]),
            logit_bias=logit_bias(body),
            structured_outputs=structured_outputs(body, tools), allowed_token_ids=token_ids(body, "allowed_token_ids"),
            include_stop_str_in_output=boolean(body, "include_stop_str_in_output"))
    except SamplingError as e:  # named as the request named it
        sent = {"max_tokens": max_key, "logprobs": logprobs_key,
                "structured_outputs": structured_key(body, tools)}.get(e.field, e.field)
        message = str(e)
        if sent != e.field and message.startswith(e.field + "="):
            message = sent + message[len(e.field):]
        raise APIError(400, message, param=sent) from e


def is_id_list(value) -> bool:
    """A list of integers (JSON's: not booleans), as token ids come."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def token_ids(body: dict, key: str) -> list[int] | None:
    """`body[key]` as a list of token ids (integers), or None if not given."""
    ids = body.get(key)
    if ids is not None and not is_id_list(ids):
        raise APIError(400, f"{key} must be a list of integers", param=key)
    return ids


def structured_outputs(body: dict, tools: "ToolChoice | None" = None) -> dict | None:
    """What the output must follow: a chat's tool calls (`tools`), OpenAI's `response_format` (json_object;
    json_schema, its `schema`) or vLLM's `structured_outputs` (json, regex, choice, grammar, json_object), as
    `infer.structured.StructuredOutputs`' fields; None for plain text."""
    fmt, vllm = body.get("response_format"), body.get("structured_outputs")
    text = fmt in (None, {"type": "text"})  # response_format asks for nothing
    if tools is not None and tools.calls:
        if not text or vllm is not None:
            raise APIError(400, "a tool call is JSON of its own: leave out response_format / structured_outputs",
                           param="tool_choice")
        return {"json": tools.schema()}
    if not text and vllm is not None:
        raise APIError(400, "give one of response_format and structured_outputs", param="structured_outputs")
    if vllm is not None:
        if not isinstance(vllm, dict):
            raise APIError(400, "structured_outputs must be an object such as {\"regex\": \"[0-9]+\"}",
                           param="structured_outputs")
        return vllm
    if text:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        return {"json": spec["schema"]}
    raise APIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                   param="response_format")


@dataclass
class ToolChoice:
    """A chat's `tools` (the OpenAI API's function definitions, which the chat template lists) and its
    `tool_choice`: "none" (`calls` False: text), "required" (`name` None: one or more calls of any of them, one
    with parallel_tool_calls false, as under "auto"), a named function, or "auto" (the API's default with tools:
    the model writes text or calls in its own format, which the server's `--tool-call-parser` reads; refused
    without one)."""

    tools: list[dict]
    calls: bool  # a grammar holds the reply to calls ("required" or a named function)
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: "required" and "auto" may answer several calls (else one)
    auto: bool = False  # "auto": the reply's calls, if any, are read from its text by the server's parser

    @classmethod
    def of(cls, body: dict, parser: str | None = None) -> "ToolChoice | None":
        """The tools and choice of a chat's `body`; `parser`: the server's --tool-call-parser, if any."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if tools is None or tools == []:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice")
            return None
        if not (isinstance(tools, list) and len(tools) <= 128 and all(_is_function(t) for t in tools)):
            raise APIError(400, "tools must be a list of at most 128 {\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"parameters\": {...}}}", param="tools")
        check_text(json.dumps(tools, ensure_ascii=False), "tools")  # they reach the template, then the tokenizer
        names = [t["function"]["name"] for t in tools]
        parallel = boolean(body, "parallel_tool_calls", True)
        if choice == "none":
            return cls(tools, calls=False)
        if choice == "required":
            return cls(tools, calls=True, parallel=parallel)
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
                and choice["function"].get("name") in names:
            return cls(tools, calls=True, name=choice["function"]["name"])
        if (choice is None or choice == "auto") and parser is not None:
            return cls(tools, calls=False, parallel=parallel, auto=True)
        if choice is None or choice == "auto":
            raise APIError(400, "tool_choice \"auto\" (the default with tools) needs a parser of the model's own "
                                "tool-call format: start the server with --tool-call-parser (hermes, llama3_json), "
                                "or give tool_choice \"required\", {\"type\": \"function\", \"function\": "
                                "{\"name\": ...}} or \"none\"", param="tool_choice")
        raise APIError(400, f"tool_choice must be \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": N}}}} with N one of {', '.join(map(repr, names))}", param="tool_choice")

    def parameters(self, name: str) -> dict:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or {"type": "object", "properties": {}}

    def schema(self) -> dict:
        """What the reply must be: the named function's arguments, or a list of calls ({"name", "parameters"})
        of any of the tools (vLLM's form for "required"). Compact JSON (llguidance's `x-guidance` option, unless
        the schema sets its own): a call is parsed, not read, and free blanks let a weak model loop in them."""
        compact = {"x-guidance": {"whitespace_flexible": False}}
        if self.name is not None:
            return {**compact, **self.parameters(self.name)}
        calls, defs = [], {}
        for tool in self.tools:  # each tool's definitions move to the root, where its "#/$defs/X" points
            parameters = dict(self.parameters(tool["function"]["name"]))
            for key, value in (parameters.pop("$defs", None) or {}).items():
                if defs.setdefault(key, value) != value:
                    raise APIError(400, f"tools define $defs {short(key)} differently; give their definitions "
                                        "distinct names", param="tools")
            calls.append({"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                           "parameters": parameters},
                          "required": ["name", "parameters"], "additionalProperties": False})
        return {**compact, **({"$defs": defs} if defs else {}), "type": "array", "minItems": 1,
                **({} if self.parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def _is_function(tool) -> bool:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and bool(function["name"]) \
        and isinstance(function.get("parameters", {}), dict)


def structured_key(body: dict, tools: ToolChoice | None) -> str:
    """The field a request gave its structured output in (for the errors about it): its tools where they call
    (`structured_outputs` builds their grammar), else the field the grammar came in."""
    if tools is not None and tools.calls:
        return "tools"
    return "structured_outputs" if body.get("structured_outputs") is not None else "response_format"


def logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: an object from token ids (JSON's keys are strings) to biases."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > 1024:
        raise APIError(400, "logit_bias must be an object of at most 1024 token ids (as strings) to biases",
                       param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise APIError(400, f"logit_bias key {short(key)} is not a token id", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise APIError(400, f"logit_bias[{short(key)}]={short(value)} must be a number", param="logit_bias")
        if int(key) in out:  # "5" and "05"
            raise APIError(400, f"logit_bias names token {int(key)} twice", param="logit_bias")
        out[int(key)] = float(value)
    return out


def chat_messages(body: dict) -> list[dict]:
    """A chat's messages as the template takes them (`meshlm.messages.template_messages`, which training's
    conversations go through too)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
    try:
        return template_messages(messages)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


TEMPLATE_SET = ("messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token")


def chat_template_options(body: dict, messages: list[dict]) -> dict:
    """How a chat's messages become its prompt besides the template itself (vLLM's fields), as
    `Tokenizer.apply_chat_template`'s options: `add_generation_prompt` (default true: the template opens the
    assistant's turn), `continue_final_message` (the prompt ends inside the last message, an assistant's, which
    the reply continues: a prefilled answer) and `chat_template_kwargs` (more of the template's variables, e.g.
    Qwen3's `enable_thinking`)."""
    add = boolean(body, "add_generation_prompt", True)
    cont = boolean(body, "continue_final_message")
    if add and cont:
        raise APIError(400, "continue_final_message continues the last message, which a generation prompt would "
                            "close: give add_generation_prompt false with it", param="continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise APIError(400, f"continue_final_message continues an assistant's message; the last message's role is "
                            f"{short(messages[-1]['role'])}", param="continue_final_message")
    variables = body.get("chat_template_kwargs")
    if variables is not None and not isinstance(variables, dict):
        raise APIError(400, "chat_template_kwargs must be an object of the chat template's variables, e.g. "
                            "{\"enable_thinking\": false}", param="chat_template_kwargs")
    clash = sorted(set(variables or ()) & set(TEMPLATE_SET))
    if clash:
        raise APIError(400, f"chat_template_kwargs sets {', '.join(clash)}, which the server sets from the request "
                            "(add_generation_prompt and continue_final_message are fields of their own)",
                       param="chat_template_kwargs")
    check_text(json.dumps(variables or {}, ensure_ascii=False), "chat_template_kwargs")
    return {"add_generation_prompt": add, "continue_final_message": cont, "variables": variables}


MAX_CHOICES = 64  # choices (prompts x n) of one request: bounded so one request cannot fill the queue
MAX_BODY_BYTES = 16 << 20  # default request size limit: far above any prompt a context holds


def rag_options(value, index, default_top_k: int) -> tuple[int, str] | None:
    """A request's `rag` field -> (top_k, mode), or None when it does not ask for retrieval."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise APIError(400, f"rag={short(value)} must be an object such as {{\"top_k\": 4}} (or true)", param="rag")
    unknown = set(value) - {"top_k", "mode"}
    if unknown:
        raise APIError(400, f"rag has unknown fields {sorted(map(short, unknown))}; it takes top_k and mode",
                       param="rag")
    if index is None:
        raise APIError(400, "this server has no retrieval index (start it with --rag INDEX)", param="rag")
    top_k = number(value, "top_k", default_top_k, int, count=True)
    mode = value.get("mode", "bm25")
    if mode not in index.modes:
        raise APIError(400, f"rag mode {short(mode)} is not available; this index offers {list(index.modes)}",
                       param="rag")
    if not 1 <= top_k <= 64:
        raise APIError(400, f"rag top_k={top_k} must be between 1 and 64", param="rag")
    return top_k, mode


def completion_prompts(prompt, *, has_tokenizer: bool) -> list:
    """A completion's `prompt`: a string, a list of token ids, or a list of either (several prompts)."""
    def one(p):
        if isinstance(p, str) and p:
            if not has_tokenizer:
                raise APIError(400, "this model has no tokenizer: send 'prompt' as a list of token ids", param="prompt")
            return check_text(p, "prompt")
        if is_id_list(p) and p:
            return p
        raise APIError(400, "'prompt' is required: a non-empty string or list of token ids, or a list of those",
                       param="prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise APIError(400, f"{len(prompt)} prompts: at most {MAX_CHOICES} per request", param="prompt")
        return [one(p) for p in prompt]
    return [one(prompt)]
