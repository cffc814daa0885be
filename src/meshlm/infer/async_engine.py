"""The engine in a background thread, for the HTTP server: requests are queued to it from the event loop, and each
step's outputs go back to the requests' queues.

Responsible for: `AsyncEngine` (submitting a request, aborting it, stopping; the TTFT / TPOT / retrieval histograms
that /metrics prints; a multi-rank engine whose rank is gone fails every request and refuses the next with
`EngineUnavailable`, HTTP 503).
Not responsible for: the HTTP API (server.py), the engine itself (engine.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from meshlm.comm import CollectiveError
from meshlm.infer.engine import Engine
from meshlm.infer.metrics import Histogram
from meshlm.infer.sequence import SamplingParams



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

    async def submit_async(self, prompt: str | list[int], params: SamplingParams, queue: asyncio.Queue, *,
                           rag: bool = False) -> tuple[str, asyncio.Queue, list[int]]:
        """Queue a request, tokenizing it in a worker thread (a long prompt never holds up the event loop);
        ValueError if it is invalid. Returns (id, queue, the prompt's token ids). Several requests may share one
        `queue` (the choices of one HTTP request): outputs carry their id.

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
