"""`meshlm serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, extra `serve`).

Responsible for: POST /v1/completions (one prompt or several) and /v1/chat/completions, `n` choices
each, and OpenAI's POST /v1/responses as the chat it asks for (`infer/openai_responses.py`), streamed as server-sent events (with logprobs per chunk) or not (the answers' layout is
`infer/responses.py`'s); GET /v1/models, /health and /metrics (Prometheus text, `infer/metrics.py`); answering bad input with a
4xx and an OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`, the checks in
`infer/requests.py`) while the other requests go on; aborting the requests of a client that hangs up; an
optional API key (`Authorization: Bearer KEY`, `infer/auth.py`: every endpoint but /health, /openapi.json
included; /docs and /redoc are not served); one log line per request; retrieval-augmented requests (`"rag"`, with an
index from `meshlm.infer.rag`: retrieval runs in worker threads, the passages go before the prompt and
the response lists them as `retrieved`); tool calls and reasoning read from a chat's reply (`--tool-call-parser`,
`--reasoning-parser`); POST /tokenize and /detokenize (vLLM's). The engine runs in one background thread that
requests are queued to (`infer/async_engine.py`).
Not responsible for: the engine itself, tensor parallelism, or TLS (put a proxy in front). Binds to
127.0.0.1 unless told otherwise.

Chat prompts use the model's chat template; a tokenizer without one gets the fallback template
documented in `meshlm.tokenizer` (`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`).
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime.

import asyncio
import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from meshlm.infer.async_engine import AsyncEngine, EngineUnavailable
from meshlm.infer.auth import APIKey
from meshlm.infer.engine import RequestOutput
from meshlm.infer.metrics import metrics_text
from meshlm.infer.rag import augment_messages, format_passages
from meshlm.infer.requests import (
    MAX_BODY_BYTES, MAX_CHOICES, APIError, RequestOptions, ToolChoice, boolean, chat_messages, chat_template_options,
    check_text, completion_prompts, is_id_list, json_body, read_limited, short, structured_key)
from meshlm.infer.responses import Replies, sse
from meshlm.infer.sequence import SamplingParams
from meshlm.infer.openai_responses import ResponseEvents, as_chat, renamed, response_of
from meshlm.infer.reasoning import END as REASONING_END
from meshlm.infer.reasoning import PARSERS as REASONING
from meshlm.infer.tool_parsers import PARSERS, Auto, Forced
from meshlm.tokenizer import ChatTemplateError

# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


def create_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, log=None, rag_index=None, rag_top_k: int = 4,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None,
               sampling_defaults: dict | None = None):
    """The FastAPI app. `log(line)`, when given, gets one line per request: method, path, status,
    completion tokens and latency (status 499: the client left before the answer). `rag_index` (a
    `meshlm.infer.rag.RagIndex`) lets requests opt in to retrieval with `"rag": {"top_k": K}`.
    `tool_call_parser` (a name of `tool_parsers.PARSERS`): the model's own tool-call format, which lets chats
    with tools leave the choice to the model (tool_choice "auto"); `reasoning_parser` (a name of
    `reasoning.PARSERS`): a reasoning model's thinking, answered apart from its reply. `sampling_defaults`: the
    temperature, top_p, top_k, min_p and repetition_penalty of requests that leave them out (the model's
    generation_config.json's, `tokenizer.read_generation_defaults`)."""
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    # No /docs or /redoc (they would load scripts from a CDN); /openapi.json is served below, behind the key.
    app = FastAPI(title="meshlm", docs_url=None, redoc_url=None, openapi_url=None)
    if log is not None:
        app.add_middleware(_AccessLog, log=log)
    api = _Completions(engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                       rag_index=rag_index, rag_top_k=rag_top_k, tool_call_parser=tool_call_parser,
                       reasoning_parser=reasoning_parser, sampling_defaults=sampling_defaults)
    created = int(time.time())

    async def answer(request: Request, work) -> Response:
        reply = await work(request)  # the body, the stream, or None
        if reply is None:  # the client hung up: nobody will read the answer
            return Response(status_code=499)
        if isinstance(reply, dict):
            return JSONResponse(reply)
        return StreamingResponse(reply, media_type="text/event-stream")

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        # json.dumps escapes to ASCII: an error never fails to encode, whatever text it quotes.
        return Response(json.dumps(exc.body()), status_code=exc.status, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):  # 404 no such path, 405 wrong method: OpenAI's shape
        path = short(request.url.path)
        what = {404: f"no such path {path}", 405: f"{request.method} is not allowed on {path}"}
        return await _api_error(request, APIError(exc.status_code, what.get(exc.status_code, str(exc.detail)),
                                                  code="not_found" if exc.status_code == 404 else None))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, lambda r: api.run(r, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, lambda r: api.run(r, chat=True))

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await answer(request, api.responses)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await api.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await api.detokenize(request)

    @app.get("/v1/models")
    async def models(request: Request):
        api.check_key(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "meshlm",
                                            "max_model_len": engine.engine.max_model_len}]}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        api.check_key(request)
        return JSONResponse(app.openapi())

    @app.get("/health")
    async def health():
        if engine.broken is not None:
            return JSONResponse({"status": "unhealthy", "error": str(engine.broken)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        api.check_key(request)
        return PlainTextResponse(metrics_text(engine), media_type="text/plain; version=0.0.4")

    return app


class _Completions:
    """The work behind POST /v1/completions, /v1/chat/completions and /v1/responses (and /tokenize,
    /detokenize): read and check the body, build the prompts (retrieval first where asked), queue every choice to
    the engine, then answer whole or as a stream.
    Also the API key check of the other endpoints. Works on the request's ASGI interface (headers, body
    stream, receive, scope); the FastAPI responses are `create_app`'s."""

    def __init__(self, engine: AsyncEngine, *, model_name: str, api_key: str | None, max_body_bytes: int,
                 rag_index, rag_top_k: int, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 sampling_defaults: dict | None = None):
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser={tool_call_parser!r} must be one of {', '.join(PARSERS)}")
        if reasoning_parser is not None and reasoning_parser not in REASONING:
            raise ValueError(f"reasoning_parser={reasoning_parser!r} must be one of {', '.join(REASONING)}")
        self.reasoning = REASONING.get(reasoning_parser)
        self.sampling_defaults = sampling_defaults or {}
        self.engine, self.model_name, self.api_key = engine, model_name, APIKey(api_key)
        self.tool_call_parser = tool_call_parser
        self.max_body_bytes = max_body_bytes
        self.tokenizer = engine.engine.tokenizer
        self.rag_index, self.rag_top_k = rag_index, rag_top_k
        self.rag_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="meshlm-rag") \
            if rag_index is not None else None

    async def run(self, request, *, chat: bool):
        """The answer: a JSON body (dict), an event stream (async iterator of str), or None when the client
        hung up before it was ready."""
        return await self.answer(request, await self.read_body(request), chat=chat)

    async def responses(self, request):
        """POST /v1/responses: the Responses request answered as the chat completion it asks for
        (`openai_responses`), its errors naming the Responses fields."""
        body = await self.read_body(request)
        chat_body = as_chat(body)  # its errors name the Responses fields already
        try:
            reply = await self.answer(request, chat_body, chat=True)
        except APIError as e:  # the chat path's: renamed
            e.param, e.message = renamed(e.param, e.message)
            raise
        if reply is None or isinstance(reply, dict):
            return reply and response_of(reply, body, self.model_name, self.sampling_defaults)
        return self.response_events(reply, ResponseEvents(body, self.model_name, self.sampling_defaults))

    @staticmethod
    async def response_events(chunks, events: ResponseEvents):
        """A streamed chat completion's chunks as the Responses API's events."""
        try:
            for event in events.start():
                yield event
            async for line in chunks:
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                for event in events.chunk(chunk):
                    yield event
                if "error" in chunk:
                    return
            for event in events.finish():
                yield event
        finally:
            await chunks.aclose()  # its own finally aborts what has not finished

    async def answer(self, request, body: dict, *, chat: bool):
        """`run`'s answer to a request's `body`."""
        options = RequestOptions.of(body, chat=chat, rag_index=self.rag_index, rag_top_k=self.rag_top_k,
                                    tool_call_parser=self.tool_call_parser, defaults=self.sampling_defaults)
        if chat:
            prompts, retrieved, opening = await self.prompts_of_chat(body, options.rag, options.tools)
        else:
            (prompts, retrieved), opening = await self.prompts_of_completion(body, options.rag), ""
        # a reasoning model's thinking is split off its reply; a grammar (structured outputs, a forced tool choice)
        # holds a reply that starts thinking only after it (reasoning.py says why not one that may)
        reasoning, params = (self.reasoning if chat else None), options.params
        thinking = reasoning is not None and reasoning.opens(opening)
        if thinking and params.structured_outputs is not None:
            params = dataclasses.replace(params, structured_after=REASONING_END)
        n = options.n
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most "
                                f"{MAX_CHOICES} per request", param="n")
        queue: asyncio.Queue = asyncio.Queue()
        names = {"structured_outputs": structured_key(body, options.tools)}  # a grammar's errors, as the request
        # named their field
        try:
            ids, num_prompt = await self.submit_choices(prompts, params, n, queue, rag=retrieved is not None,
                                                        chat=chat)
        except APIError as e:  # a grammar that does not compile
            raise _named(e, names) from e
        replies = Replies(chat=chat, rid=("chatcmpl-" if chat else "cmpl-") + ids[0].removeprefix("req-"),
                          model=self.model_name, dec=self.dec, shown=self.shown,
                          logprobs=options.params.logprobs is not None,
                          retrieved=retrieved, n=n, echo=[self.text_of(p) for p in prompts] if options.echo else None,
                          prompt_only=options.prompt_only,
                          calls=self.call_format(options.tools), reasoning=reasoning,
                          thinking=thinking)
        if options.stream:
            return self.stream(request, ids, queue, replies, num_prompt, include_usage=options.include_usage,
                               names=names)
        finals = await self.collect(request, ids, queue, names)
        if finals is None:
            return None
        outputs = [finals[request_id] for request_id in ids]
        request.scope["meshlm.tokens"] = replies.completion_tokens(outputs)
        return replies.response(outputs, num_prompt)

    # ---- the request ---------------------------------------------------------------------------

    def check_key(self, request) -> None:
        self.api_key.check(request)

    async def read_body(self, request) -> dict:
        self.check_key(request)
        return json_body(await read_limited(request, self.max_body_bytes), model_name=self.model_name)

    async def tokenize(self, request) -> dict:
        """POST /tokenize (vLLM's): a completion's `prompt` (with its special tokens unless `add_special_tokens` is
        false) or a chat's `messages` (its tools and template options too) as the token ids the model reads, their
        `count`, the context's `max_model_len`, and each token's text where `return_token_strs` asks."""
        body = await self.read_body(request)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: there is no text to tokenize")
        if (body.get("messages") is None) == (body.get("prompt") is None):
            raise APIError(400, "give one of 'prompt' (a completion's text) and 'messages' (a chat's)", param="prompt")
        if body.get("messages") is not None:
            tools = ToolChoice.of({"tools": body.get("tools"), "tool_choice": "none"})
            (ids,), _, _ = await self.prompts_of_chat(body, None, tools, opening_needed=False)
        else:
            if not isinstance(body["prompt"], str) or not body["prompt"]:
                raise APIError(400, "'prompt' must be a non-empty string", param="prompt")
            add = boolean(body, "add_special_tokens", True)
            ids = self.tokenizer.encode(check_text(body["prompt"], "prompt"), **({} if add else {
                "add_special_tokens": False}))
        strs = [self.dec(t) for t in ids] if boolean(body, "return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.engine.engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, request) -> dict:
        """POST /detokenize (vLLM's): token ids as their text, special tokens written out."""
        body = await self.read_body(request)
        tokens = body.get("tokens")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: there is no text to give")
        vocab = self.tokenizer.vocab_size
        if not (is_id_list(tokens) and all(0 <= t < vocab for t in tokens)):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(tokens, skip_special_tokens=False)}

    async def prompts_of_chat(self, body: dict, rag, tools, *,
                              opening_needed: bool = True) -> tuple[list, list[list[dict]] | None, str]:
        """The one prompt of a chat (its messages, and its tools, through the chat template), retrieved passages
        first; and, with a reasoning parser, what the template writes of the reply (does it open `<think>`?: not
        the messages' own text, which may name the tag)."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; chat needs one")
        messages, retrieved = chat_messages(body), None
        options = chat_template_options(body, messages)
        if rag is not None:
            query = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
            block, found = await self.retrieve(query, *rag)
            messages, retrieved = augment_messages(messages, block), [found]
        listed = tools.tools if tools is not None else None
        # (a reply that always thinks can be closed only by a continued message, which costs no render)
        opens = opening_needed and self.reasoning is not None and (not self.reasoning.always_open
                                                                   or options.get("continue_final_message", False))

        def render():  # the template once: the prompt's ids, and what it writes of the reply where that decides
            text = self.tokenizer.apply_chat_template(messages, listed, **options)
            opening = self.tokenizer.reply_opening(messages, listed, whole=text, **options) if opens else ""
            return self.tokenizer.encode_prompt(text), opening

        try:
            prompt, opening = await asyncio.to_thread(render)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param=e.field) from e
        return [prompt], retrieved, opening

    async def prompts_of_completion(self, body: dict, rag) -> tuple[list, list[list[dict]] | None]:
        """A completion's prompts, each with its retrieved passages before it where asked."""
        prompts = completion_prompts(body.get("prompt"), has_tokenizer=self.tokenizer is not None)
        if rag is None:
            return prompts, None
        if not all(isinstance(p, str) for p in prompts):
            raise APIError(400, "rag needs text prompts (the query is the prompt's text), not token ids", param="rag")
        retrieved = []
        for i, prompt in enumerate(prompts):
            block, found = await self.retrieve(prompt, *rag)
            prompts[i] = block + prompt
            retrieved.append(found)
        return prompts, retrieved

    async def retrieve(self, query: str, top_k: int, mode: str) -> tuple[str, list[dict]]:
        """Search in a worker thread (the event loop and the engine thread never wait on it)."""
        def work():
            start = time.monotonic()
            passages = self.rag_index.search(query, top_k=top_k, mode=mode)
            block = format_passages(passages)
            num_tokens = len(self.tokenizer.encode(block, add_special_tokens=False)) \
                if self.tokenizer is not None and block else 0
            return passages, block, num_tokens, time.monotonic() - start

        try:
            passages, block, num_tokens, seconds = await asyncio.get_running_loop().run_in_executor(self.rag_pool,
                                                                                                    work)
        except ValueError as e:
            raise APIError(400, str(e), param="rag") from e
        self.engine.rag_latency.observe(seconds)
        self.engine.rag_tokens.observe(num_tokens)
        return block, [p.public() for p in passages]

    # ---- the engine ----------------------------------------------------------------------------

    async def submit_choices(self, prompts: list, params: SamplingParams, n: int, queue: asyncio.Queue, *,
                             rag: bool, chat: bool) -> tuple[list[str], int]:
        """Queue n samples of every prompt, all or nothing. Returns (the request id of each choice, numbered
        prompt * n + sample as OpenAI numbers them; prompt tokens)."""
        ids: list[str] = []
        num_prompt = 0
        try:
            for prompt in prompts:
                for j in range(n):
                    # Sample j of a seeded request draws from its own seed, so the n choices differ.
                    p = params if j == 0 or params.seed is None else replace(params, seed=(params.seed + j) % (1 << 64))
                    request_id, _, prompt_ids = await self.submit(prompt, p, queue, rag, chat=chat)
                    ids.append(request_id)
                    if j == 0:
                        num_prompt += len(prompt_ids)
                        prompt = prompt_ids  # the other samples reuse the tokens
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return ids, num_prompt

    async def submit(self, prompt, params: SamplingParams, queue: asyncio.Queue, rag: bool, *, chat: bool):
        try:
            return await self.engine.submit_async(prompt, params, queue, rag=rag)
        except EngineUnavailable as e:
            raise APIError(503, str(e), type_="server_error") from e
        except ValueError as e:
            context = "context length" in str(e) or "leaves no room" in str(e)
            param = getattr(e, "field", None) or ("messages" if chat else "prompt")
            status = getattr(e, "status", 400)  # 501: what this server lacks (llguidance for a grammar)
            raise APIError(status, str(e), param=param, code="context_length_exceeded" if context else None,
                           **({} if status == 400 else {"type_": "server_error"})) from e

    async def collect(self, request, ids: list[str], queue: asyncio.Queue,
                      names: dict[str, str]) -> dict[str, RequestOutput] | None:
        """Every choice's final output by request id; None if the client hung up first (its choices aborted)."""
        finals: dict[str, RequestOutput] = {}
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            while len(finals) < len(ids):
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:  # the client hung up: nobody will read the answer
                    getter.cancel()
                    request.scope["meshlm.tokens"] = sum(len(o.token_ids) for o in finals.values())
                    return None
                out = getter.result()
                if isinstance(out, Exception):
                    raise _engine_failed(out)
                if out.finished:
                    if out.finish_reason == "error":
                        raise _request_failed(out, names)
                    finals[out.request_id] = out
        finally:
            gone.cancel()
            for request_id in ids:
                if request_id not in finals:
                    self.engine.abort(request_id)
        return finals

    async def stream(self, request, ids: list[str], queue: asyncio.Queue, replies: Replies, num_prompt: int, *,
                     include_usage: bool, names: dict[str, str]):
        """The choices as server-sent events while they are generated, then `[DONE]`."""
        index = {request_id: i for i, request_id in enumerate(ids)}
        finished: dict[str, RequestOutput] = {}
        echoed: set[int] = set()  # choices whose prompt went out (echo): in the chunk before their first token's
        try:
            if replies.chat or replies.retrieved is not None:  # the first chunk of each choice: role, passages
                for i in range(len(ids)):
                    yield replies.event(i, None, None, first=True)
            while len(finished) < len(ids):
                out = await queue.get()
                if isinstance(out, Exception) or out.finish_reason == "error":
                    failed = _engine_failed(out) if isinstance(out, Exception) else _request_failed(out, names)
                    yield sse(failed.body())
                    break
                i = index[out.request_id]
                if replies.echo is not None and i not in echoed:
                    echoed.add(i)
                    yield replies.echo_event(i, out)
                # Logprobs of this step's new tokens travel with the chunk (its text may lag a token or
                # two behind them: an incomplete character or a possible stop string is held back).
                new_lp = out.logprobs[len(out.logprobs) - len(out.new_token_ids):] if (
                    replies.logprobs and out.new_token_ids) else None
                event = replies.event(i, out.new_text, None, logprobs=new_lp) if (
                    out.new_text or new_lp) and not replies.prompt_only else ""
                if event:
                    yield event
                if out.finished:
                    finished[out.request_id] = out
                    for event in replies.finish_events(i, out):
                        yield event
            else:
                if include_usage:
                    yield replies.usage_event(num_prompt, replies.completion_tokens(finished.values()),
                                              replies.cached_tokens((index[r], out) for r, out in finished.items()))
            yield "data: [DONE]\n\n"
        finally:
            request.scope["meshlm.tokens"] = replies.completion_tokens(finished.values())
            for request_id in ids:
                if request_id not in finished:  # the client went away (or one choice failed): free the blocks
                    self.engine.abort(request_id)

    def call_format(self, tools):
        """How a chat's reply makes tool calls: through the grammar of a forced choice, in the model's own format
        (tool_choice "auto", the server's parser), or not at all (None)."""
        if tools is not None and tools.calls:
            return Forced(tools)
        return Auto(PARSERS[self.tool_call_parser], tools) if tools is not None and tools.auto else None

    def text_of(self, prompt: str | list[int]) -> str:
        """A prompt as echoed: its text as sent, or its token ids' text (special tokens too, as `dec` names them)."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens=False) if self.tokenizer is not None else ""

    def shown(self, token: int) -> str:
        """What a generated token adds to a choice's text: its text as the engine decodes output (special tokens
        skipped where the tokenizer skips them)."""
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def dec(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else str(token)


def _request_failed(out: RequestOutput, names: dict[str, str]) -> APIError:
    """A request the engine failed alone: a 400 naming the parameter when the request's own parameters failed it
    (a grammar the sampler could not follow), else a 500."""
    if out.error_field is None:
        return APIError(500, f"generating this request failed: {out.error}", type_="server_error")
    return _named(APIError(400, f"generating this request failed: {out.error}", param=out.error_field), names)


def _named(error: APIError, names: dict[str, str]) -> APIError:
    """`error` naming its parameter as the request named it (response_format for a grammar given there)."""
    if error.param in names:
        error.message = error.message.replace(error.param, names[error.param], 1)
        error.param = names[error.param]
    return error


def _engine_failed(why) -> APIError:
    """The error of a request the engine could not run: 503 when it has stopped for good, else 500."""
    return APIError(503 if isinstance(why, EngineUnavailable) else 500, f"the engine failed: {why}",
                    type_="server_error")


class _AccessLog:
    """ASGI middleware: one log line per request once its response is fully sent (streams included).

    Plain ASGI rather than FastAPI's `http` middleware, which would buffer streamed responses and hide
    client disconnects from the handlers."""

    def __init__(self, app, log):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        status = [499]  # until a response starts: the client left first

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            tokens = scope.get("meshlm.tokens", 0)
            self.log(f"{scope['method']} {scope['path']} {status[0]} tokens={tokens} "
                     f"{time.monotonic() - start:.3f}s")


async def _client_gone(request) -> None:
    """Return when the client closes the connection (the body has been read: only a disconnect comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
