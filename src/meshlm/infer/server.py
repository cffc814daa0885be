"""`meshlm serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, extra `serve`).

Responsible for: POST /v1/completions (one prompt or several) and /v1/chat/completions, `n` choices
each, streamed as server-sent events (with logprobs per chunk) or not (the answers' layout is
`infer/responses.py`'s); GET /v1/models, /health and /metrics (Prometheus text, `infer/metrics.py`); answering bad input with a
4xx and an OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`, the checks in
`infer/requests.py`) while the other requests go on; aborting the requests of a client that hangs up; an
optional API key (`Authorization: Bearer KEY`, `infer/auth.py`: every endpoint but /health, /openapi.json
included; /docs and /redoc are not served); one log line per request; retrieval-augmented requests (`"rag"`, with an
index from `meshlm.infer.rag`: retrieval runs in worker threads, the passages go before the prompt and
the response lists them as `retrieved`); running the engine in one background thread that requests are
queued to (`AsyncEngine`).
Not responsible for: the engine itself, tensor parallelism, or TLS (put a proxy in front). Binds to
127.0.0.1 unless told otherwise.

Chat prompts use the model's chat template; a tokenizer without one gets the fallback template
documented in `meshlm.tokenizer` (`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`).
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime.

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from meshlm.comm import CollectiveError
from meshlm.infer.auth import APIKey
from meshlm.infer.engine import Engine, RequestOutput
from meshlm.infer.metrics import Histogram, metrics_text
from meshlm.infer.rag import augment_messages, format_passages
from meshlm.infer.requests import (
    MAX_BODY_BYTES, MAX_CHOICES, APIError, RequestOptions, chat_messages, chat_template_options, completion_prompts,
    json_body, read_limited, short, structured_key)
from meshlm.infer.responses import Replies, sse
from meshlm.infer.sequence import SamplingParams
from meshlm.infer.reasoning import PARSERS as REASONING
from meshlm.infer.tool_parsers import PARSERS, Forced

# ---------------------------------------------------------------------------------------------
# The engine in a background thread
# ---------------------------------------------------------------------------------------------


_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.submit_time = time.monotonic()
        self.first_token_time: float | None = None
        self.rag = False  # a retrieval-augmented prompt


class AsyncEngine:
    """Owns the engine; a daemon thread steps it while there is work.

    `submit` and `abort` may be called from any thread: a request is tokenized and validated in the
    caller's thread, then queued; only the engine thread touches the scheduler, between steps, so a
    new request never waits for a running step to be accepted or rejected.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._pending: list = []
        self._aborts: list[str] = []
        self._stopped = False
        # A rank of a multi-rank engine is gone (CollectiveError): nothing can run any more. Requests then
        # fail with 503 and /health says unhealthy, instead of waiting on a collective that never completes.
        self.broken: Exception | None = None
        self.ttft = Histogram(_TIME_BUCKETS)
        self.tpot = Histogram(_TIME_BUCKETS)
        self.num_requests = 0
        self.num_errors = 0
        self.rag_latency = Histogram(_TIME_BUCKETS)
        self.rag_tokens = Histogram(_TOKEN_BUCKETS)
        self.rag_prompt_tokens = 0  # prompt tokens of retrieval-augmented sequences
        self.rag_cached_tokens = 0  # ... of which the prefix cache already held
        self._thread = threading.Thread(target=self._run, name="meshlm-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: str | list[int], params: SamplingParams,
               queue: asyncio.Queue | None = None) -> tuple[str, asyncio.Queue, int]:
        """Queue a request; ValueError if it is invalid. Returns (id, queue of RequestOutput, prompt tokens).

        Several requests may share one `queue` (the choices of one HTTP request): outputs carry their id.
        """
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop())
        if queue is not None:
            stream.queue = queue
        seq = self.engine.make_sequence(prompt, params, request_id=f"req-{uuid.uuid4().hex}")
        with self._cv:
            self._pending.append(seq)
            self._streams[seq.request_id] = stream
            self.num_requests += 1
            self._cv.notify()
        return seq.request_id, stream.queue, seq.num_prompt_tokens

    async def submit_async(self, prompt: str | list[int], params: SamplingParams, queue: asyncio.Queue, *,
                           rag: bool = False) -> tuple[str, asyncio.Queue, list[int]]:
        """`submit`, tokenizing in a worker thread: a long prompt never holds up the event loop.
        Returns (id, queue, the prompt's token ids).

        `rag`: the prompt starts with retrieved passages (counted in the RAG prefix-cache figures)."""
        self._check_alive()
        seq = await asyncio.to_thread(self.engine.make_sequence, prompt, params,
                                      request_id=f"req-{uuid.uuid4().hex}")
        stream = _Stream(asyncio.get_running_loop())
        stream.queue, stream.rag = queue, rag
        with self._cv:
            self._pending.append(seq)
            self._streams[seq.request_id] = stream
            self.num_requests += 1
            self._cv.notify()
        return seq.request_id, queue, seq.prompt_token_ids

    def _check_alive(self) -> None:
        if self.broken is not None:
            raise EngineUnavailable(f"the engine stopped: {self.broken}")

    def abort(self, request_id: str) -> None:
        with self._cv:
            if self._streams.pop(request_id, None) is not None:
                self._aborts.append(request_id)
                self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def stats(self) -> dict:
        return self.engine.stats()  # plain counters, read without stopping the engine

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._pending or self._aborts or self.engine.has_unfinished()) \
                        or (self.broken is not None and not self._stopped):
                    self._cv.wait()
                if self._stopped:
                    return
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                self.engine.abort(request_id)
            for seq in pending:
                if seq.request_id in aborts:
                    continue
                self.engine.add_sequence(seq)
            try:
                outputs, error = self.engine.step(), None
            except CollectiveError as e:  # another rank is gone: fail everything, refuse what comes
                outputs, error, self.broken = [], EngineUnavailable(f"the engine stopped: {e}"), e
                self.num_errors += 1
            except Exception as e:  # a bug in a step: fail the requests in flight, keep serving
                outputs, error = [], e
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
                self.num_errors += 1
            now = time.monotonic()
            deliveries = []
            with self._cv:
                if error is not None:
                    deliveries = [(s, error) for s in self._streams.values()]
                    self._streams.clear()
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.new_token_ids and stream.first_token_time is None:
                        stream.first_token_time = now
                        self.ttft.observe(now - stream.submit_time)
                        if stream.rag:  # its prefill is done: how much of the prompt the cache held
                            self.rag_prompt_tokens += len(out.prompt_token_ids)
                            self.rag_cached_tokens += out.num_cached_tokens
                    if out.finished:
                        del self._streams[out.request_id]
                        if len(out.token_ids) > 1 and stream.first_token_time is not None:
                            self.tpot.observe((now - stream.first_token_time) / (len(out.token_ids) - 1))
                    deliveries.append((stream, out))
            for stream, item in deliveries:
                try:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
                except RuntimeError:  # the request's event loop is gone
                    pass


class EngineUnavailable(RuntimeError):
    """The engine cannot run any request (a rank of a multi-rank engine is gone): HTTP 503."""


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


def create_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, log=None, rag_index=None, rag_top_k: int = 4,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None):
    """The FastAPI app. `log(line)`, when given, gets one line per request: method, path, status,
    completion tokens and latency (status 499: the client left before the answer). `rag_index` (a
    `meshlm.infer.rag.RagIndex`) lets requests opt in to retrieval with `"rag": {"top_k": K}`.
    `tool_call_parser` (a name of `tool_parsers.PARSERS`): the model's own tool-call format, which lets chats
    with tools leave the choice to the model (tool_choice "auto"); `reasoning_parser` (a name of
    `reasoning.PARSERS`): a reasoning model's thinking, answered apart from its reply."""
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    # No /docs or /redoc (they would load scripts from a CDN); /openapi.json is served below, behind the key.
    app = FastAPI(title="meshlm", docs_url=None, redoc_url=None, openapi_url=None)
    if log is not None:
        app.add_middleware(_AccessLog, log=log)
    api = _Completions(engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                       rag_index=rag_index, rag_top_k=rag_top_k, tool_call_parser=tool_call_parser,
                       reasoning_parser=reasoning_parser)
    created = int(time.time())

    async def answer(request: Request, *, chat: bool) -> Response:
        reply = await api.run(request, chat=chat)
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
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

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
    """The work behind POST /v1/completions and /v1/chat/completions: read and check the body, build the
    prompts (retrieval first where asked), queue every choice to the engine, then answer whole or as a stream.
    Also the API key check of the other endpoints. Works on the request's ASGI interface (headers, body
    stream, receive, scope); the FastAPI responses are `create_app`'s."""

    def __init__(self, engine: AsyncEngine, *, model_name: str, api_key: str | None, max_body_bytes: int,
                 rag_index, rag_top_k: int, tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser={tool_call_parser!r} must be one of {', '.join(PARSERS)}")
        if reasoning_parser is not None and reasoning_parser not in REASONING:
            raise ValueError(f"reasoning_parser={reasoning_parser!r} must be one of {', '.join(REASONING)}")
        self.reasoning = REASONING.get(reasoning_parser)
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
        body = await self.read_body(request)
        options = RequestOptions.of(body, chat=chat, rag_index=self.rag_index, rag_top_k=self.rag_top_k,
                                    tool_call_parser=self.tool_call_parser)
        if chat:
            prompts, retrieved = await self.prompts_of_chat(body, options.rag, options.tools)
        else:
            prompts, retrieved = await self.prompts_of_completion(body, options.rag)
        # a reasoning model's thinking is split off its reply, unless a grammar holds the whole reply
        reasoning = self.reasoning if chat and options.params.structured_outputs is None else None
        n = options.n
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most "
                                f"{MAX_CHOICES} per request", param="n")
        queue: asyncio.Queue = asyncio.Queue()
        names = {"structured_outputs": structured_key(body, options.tools)}  # a grammar's errors, as the request
        # named their field
        try:
            ids, num_prompt = await self.submit_choices(prompts, options.params, n, queue, rag=retrieved is not None,
                                                        chat=chat)
        except APIError as e:  # a grammar that does not compile
            raise _named(e, names) from e
        replies = Replies(chat=chat, rid=("chatcmpl-" if chat else "cmpl-") + ids[0].removeprefix("req-"),
                          model=self.model_name, dec=self.dec, shown=self.shown,
                          logprobs=options.params.logprobs is not None,
                          retrieved=retrieved, n=n, echo=[self.text_of(p) for p in prompts] if options.echo else None,
                          prompt_only=options.prompt_only,
                          calls=self.call_format(options.tools), reasoning=reasoning,
                          thinking=[reasoning.opens(self.tail(p)) for p in prompts] if reasoning else None)
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

    async def prompts_of_chat(self, body: dict, rag, tools) -> tuple[list, list[list[dict]] | None]:
        """The one prompt of a chat (its messages, and its tools, through the chat template), retrieved passages
        first."""
        from jinja2 import TemplateError  # the chat templates' engine (a dependency of torch)

        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; chat needs one")
        messages, retrieved = chat_messages(body), None
        options = chat_template_options(body, messages)
        if rag is not None:
            query = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
            block, found = await self.retrieve(query, *rag)
            messages, retrieved = augment_messages(messages, block), [found]
        try:
            listed = tools.tools if tools is not None else None
            return [await asyncio.to_thread(self.tokenizer.encode_chat, messages, listed, **options)], retrieved
        except (ValueError, TemplateError, TypeError, KeyError, AttributeError) as e:
            # the template's raise_exception("roles must alternate"), or a filter given what it cannot take
            raise APIError(400, f"the model's chat template rejects these messages: {type(e).__name__}: {e}",
                           param=getattr(e, "field", "messages")) from e

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
            raise APIError(400, str(e), param=param, code="context_length_exceeded" if context else None) from e

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
                    yield replies.usage_event(num_prompt, replies.completion_tokens(finished.values()))
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
        return PARSERS[self.tool_call_parser] if tools is not None and tools.auto else None

    def tail(self, prompt: list[int]) -> str:
        """A chat prompt's last tokens' text, special tokens shown (where a reply starts: inside `<think>`?)."""
        return self.tokenizer.decode(prompt[-32:], skip_special_tokens=False)

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
