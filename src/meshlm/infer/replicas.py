"""`meshlm serve --replicas R`: R ordinary servers as child processes, behind one endpoint that routes.

Responsible for:
- the replicas' processes (`ReplicaSet`): R `meshlm serve` commands, each on a free port of 127.0.0.1 and in a
  session of its own (its tp x cp ranks are its own business); waiting until each answers /health; stopping
  them all when the router stops, however it stops: SIGTERM to each replica's process group, SIGKILL to it and to
  what still runs below the replica (its ranks) after a grace period; SIGTERM to the router itself is turned into
  an exception so that this cleanup runs, and the kernel sends a replica SIGTERM if the router dies without it
  (Linux);
- the router's HTTP app (`create_router_app`, FastAPI + httpx): POST /v1/completions and /v1/chat/completions
  proxied unchanged -- status, body, server-sent events as they come -- to the replica the policy picks
  (`infer/router.py`), the response carrying `x-meshlm-replica: INDEX`; GET /v1/models from a live replica;
  GET /health: 200 `{"status": "ok" | "degraded", "replicas": [...]}` while at least one replica lives, 503
  when none does; GET /metrics: per replica its state, requests in flight, routed and failed, and the router's
  prefix hit rate, then every live replica's own /metrics, each sample labelled replica="INDEX" (e.g. a
  disaggregated server's KV transfers behind its front); the same API key as the replicas (`infer/auth.py`), checked before anything is routed.

A replica that dies (its process exits, or its /health answers 503): the requests it was running end with an
error naming it -- HTTP 502 with a JSON error body (`code` "replica_failed", the replica's index and port), or,
in a stream already under way, that body as a last event before `[DONE]` -- and it gets no new requests while
the others go on serving. Nothing is retried on another replica: a completion may have been partly generated or
streamed already, and only the client knows whether sending it again is right. A client that hangs up closes
the connection to its replica, which aborts the request there.
Not responsible for: restarting replicas, what a replica answers (it checks every request), TLS.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime.

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from meshlm.infer.auth import APIKey
from meshlm.infer.client import ServerNotReady, wait_until_healthy
from meshlm.infer.requests import MAX_BODY_BYTES, APIError, read_limited
from meshlm.infer.router import NoReplica, Policy, routing_key
from meshlm.processes import free_ports, stop_tree

HEALTH_EVERY_S = 1.0  # how often the router asks each live replica's /health
FORWARDED_HEADERS = ("authorization", "content-type", "accept")


class Replica:
    """One child `meshlm serve`: its index, port and process, and the router's counters of it."""

    def __init__(self, index: int, port: int, proc: subprocess.Popen, *, label: str | None = None):
        self.index, self.port, self.proc = index, port, proc
        self.label = label
        self.url = f"http://127.0.0.1:{port}"
        self.in_flight = 0
        self.routed = 0
        self.failed = 0  # requests that ended with this replica failing
        self.unhealthy: str | None = None  # its /health answered 503 (e.g. a rank of its engine is gone)

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll()

    @property
    def live(self) -> bool:
        return self.exit_code is None and self.unhealthy is None

    def name(self) -> str:
        return f"{self.label or f'replica {self.index}'} (127.0.0.1:{self.port})"

    def state(self) -> dict:
        code = self.exit_code
        status = "ok" if code is None and self.unhealthy is None else "unhealthy" if code is None else "exited"
        out = {"replica": self.index, "port": self.port, "status": status, "in_flight": self.in_flight}
        if code is not None:
            out["exit_code"] = code
        if self.unhealthy is not None and code is None:
            out["error"] = self.unhealthy
        return out


def _terminate_with_parent() -> None:
    """In a replica, before it runs: the kernel sends it SIGTERM when the router dies (Linux; else nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG


class ReplicaSet:
    """The replicas' processes, as a context manager: started on entry, stopped on exit (an exception, Ctrl-C,
    or SIGTERM, which raises SystemExit while inside).

    `command(index, port)`: the argv of replica `index` listening on 127.0.0.1:`port`; `grace_s`: how long a
    replica may take to stop after SIGTERM before it gets SIGKILL; `stdout`: where the replicas print (default:
    where this process does); `label`: how messages name a replica (default "replica INDEX"); `avoid_ports`: ports
    the replicas' ports must not be (their rendezvous, which their launchers bind later)."""

    def __init__(self, command: Callable[[int, int], list[str]], count: int, *, grace_s: float = 10.0, stdout=None,
                 label: str | None = None, avoid_ports: tuple[int, ...] = ()):
        if count < 1:
            raise ValueError(f"--replicas={count} must be >= 1")
        self.command, self.count, self.grace_s, self.stdout = command, count, grace_s, stdout
        self.label, self.avoid_ports = label, avoid_ports
        self.replicas: list[Replica] = []
        self._previous_sigterm = None

    def __enter__(self) -> "ReplicaSet":
        self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            for index, port in enumerate(free_ports(self.count, avoid=self.avoid_ports)):
                proc = subprocess.Popen(self.command(index, port), start_new_session=True, stdout=self.stdout,
                                        preexec_fn=_terminate_with_parent)
                self.replicas.append(Replica(index, port, proc, label=self.label))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            signal.signal(signal.SIGTERM, self._previous_sigterm or signal.SIG_DFL)

    def wait_until_healthy(self, timeout_s: float) -> None:
        """Return once every replica answers /health; ValueError naming the first that exits or times out."""
        deadline = time.monotonic() + timeout_s
        for r in self.replicas:
            try:
                wait_until_healthy(r.url, timeout_s=max(deadline - time.monotonic(), 1.0), proc=r.proc, poll_s=0.2)
            except ServerNotReady as e:
                raise ValueError(f"{r.name()} did not start: {e}") from None

    def wait_for_exit(self, poll_s: float = 0.5) -> int:
        """Block until a replica's process exits; its exit code (the others are stopped on leaving the set)."""
        while True:
            for r in self.replicas:
                if r.exit_code is not None:
                    return r.exit_code
            time.sleep(poll_s)

    def stop(self) -> None:
        """SIGTERM to every replica's process group; SIGKILL to the groups, and to whatever still runs below a replica
        (its ranks), after one shared grace period of `grace_s` (`processes.stop_tree`)."""
        stop_tree([r.proc for r in self.replicas], self.grace_s)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


# ---------------------------------------------------------------------------------------------
# The router's app
# ---------------------------------------------------------------------------------------------


def create_router_app(replicas: list[Replica], policy: Policy, *, api_key: str | None = None,
                      max_body_bytes: int = MAX_BODY_BYTES, log=None):
    """The router's FastAPI app over running `replicas`. `log(line)`, when given, gets one line per proxied
    request: method, path, status, replica and latency."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    router = _Router(replicas, policy, api_key=api_key, max_body_bytes=max_body_bytes, log=log)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        timeout = httpx.Timeout(connect=10.0, read=None, write=None, pool=None)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            router.client = client
            watcher = asyncio.create_task(router.watch())
            try:
                yield
            finally:
                watcher.cancel()

    app = FastAPI(title="meshlm router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return Response(json.dumps(exc.body()), status_code=exc.status, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.proxy(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.proxy(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await router.proxy(request, "/v1/responses", chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await router.proxy(request, "/tokenize", chat=False, keyed=False)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await router.proxy(request, "/detokenize", chat=False, keyed=False)

    @app.get("/v1/models")
    async def models(request: Request):
        router.key.check(request)
        live = [r for r in replicas if r.live]
        if not live:
            raise APIError(503, "no replica is alive", type_="server_error")
        r = min(live, key=lambda r: r.in_flight)
        try:
            answer = await router.client.get(r.url + "/v1/models", headers=_forwarded(request))
        except httpx.TransportError as e:
            return _replica_error(r, e)
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        states = [r.state() for r in replicas]
        live = sum(r.live for r in replicas)
        status = "ok" if live == len(replicas) else "degraded" if live else "unhealthy"
        return JSONResponse({"status": status, "replicas": states}, status_code=200 if live else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        router.key.check(request)
        texts = await router.replica_metrics(request)
        return PlainTextResponse(router_metrics_text(replicas, policy) + labelled_metrics(texts),
                                 media_type="text/plain; version=0.0.4")

    return app


class _Router:
    """The work behind the router's endpoints: routing, proxying, the replicas' health."""

    def __init__(self, replicas: list[Replica], policy: Policy, *, api_key: str | None, max_body_bytes: int, log):
        self.replicas, self.policy, self.key = replicas, policy, APIKey(api_key)
        self.max_body_bytes, self.log = max_body_bytes, log
        self.client = None  # the httpx.AsyncClient, made in the app's lifespan

    async def proxy(self, request, path: str, *, chat: bool, keyed: bool = True):
        """Route one completion to a replica and answer what it answers (a stream passed on event by event);
        `keyed` False: by load alone (a request that leaves nothing in the replica's cache)."""
        import httpx
        from fastapi.responses import Response

        self.key.check(request)
        body = await read_limited(request, self.max_body_bytes)
        key = "" if not keyed else routing_key(body, chat=chat) if len(body) < (1 << 20) else \
            await asyncio.to_thread(routing_key, body, chat=chat)
        try:
            decision = self.policy.route(key, [r.in_flight for r in self.replicas], [r.live for r in self.replicas])
        except NoReplica as e:
            raise APIError(503, f"{e}: every replica of this server has stopped", type_="server_error") from e
        r = self.replicas[decision.replica]
        r.in_flight += 1
        r.routed += 1
        start, status = time.monotonic(), 502
        streaming = False
        try:
            upstream_request = self.client.build_request("POST", r.url + path, content=body,
                                                         headers=_forwarded(request))
            upstream = await _unless_client_leaves(request, self.client.send(upstream_request, stream=True))
            if upstream is None:
                status = 499
                return Response(status_code=499)
            status = upstream.status_code
            headers = {"x-meshlm-replica": str(r.index)}
            media_type = upstream.headers.get("content-type", "application/json")
            if media_type.startswith("text/event-stream"):
                streaming = True
                return self._stream(r, upstream, path, start, headers)
            try:
                content = await _unless_client_leaves(request, upstream.aread())
            finally:
                await upstream.aclose()
            if content is None:
                status = 499
                return Response(status_code=499)
            return Response(content, status_code=status, media_type=media_type, headers=headers)
        except httpx.TransportError as e:
            status = 502
            return _replica_error(r, e)
        finally:
            if not streaming:
                self._done(r, path, status, start)

    def _stream(self, r: Replica, upstream, path: str, start: float, headers: dict):
        """The replica's event stream, passed on whole events at a time, then an error event if the replica
        fails mid-way. The upstream is closed and the request counted done however the response ends: finished,
        failed, or cut short by the client (maybe before its body started)."""
        import httpx
        from fastapi.responses import StreamingResponse

        outcome = {"status": upstream.status_code}
        router = self

        async def events():
            pending = b""
            try:
                async for chunk in upstream.aiter_raw():
                    pending += chunk
                    cut = pending.rfind(b"\n\n") + 2
                    if cut >= 2:
                        yield pending[:cut]
                        pending = pending[cut:]
                if pending:
                    yield pending
            except httpx.TransportError as e:
                outcome["status"] = 502
                r.failed += 1
                yield b"data: " + json.dumps(_replica_error_body(r, e)).encode() + b"\n\ndata: [DONE]\n\n"

        class Relayed(StreamingResponse):
            async def __call__(self, scope, receive, send):
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    await upstream.aclose()
                    router._done(r, path, outcome["status"], start)

        return Relayed(events(), status_code=upstream.status_code, media_type=upstream.headers["content-type"],
                       headers=headers)

    async def replica_metrics(self, request) -> dict[int, str]:
        """Each live replica's /metrics text (those that answer within a few seconds), by index."""
        import httpx

        async def one(r: Replica):
            try:
                answer = await self.client.get(r.url + "/metrics", headers=_forwarded(request), timeout=5.0)
            except httpx.HTTPError:
                return None
            return answer.text if answer.status_code == 200 else None

        live = [r for r in self.replicas if r.live]
        texts = await asyncio.gather(*(one(r) for r in live))
        return {r.index: text for r, text in zip(live, texts) if text is not None}

    def _done(self, r: Replica, path: str, status: int, start: float) -> None:
        r.in_flight -= 1
        if self.log is not None:
            self.log(f"POST {path} {status} replica={r.index} {time.monotonic() - start:.3f}s")

    async def watch(self) -> None:
        """Forever: note replicas that exit, and ask the live ones' /health (a 503 takes one out of routing
        until it answers 200 again)."""
        import httpx

        reported: set[int] = set()
        while True:
            for r in self.replicas:
                if r.exit_code is not None and r.index not in reported:
                    reported.add(r.index)
                    live = sum(x.live for x in self.replicas)
                    print(f"meshlm serve: {r.name()} exited with code {r.exit_code}; {live} of "
                          f"{len(self.replicas)} replicas serving", flush=True)
                elif r.exit_code is None:
                    try:
                        answer = await self.client.get(r.url + "/health", timeout=5.0)
                        r.unhealthy = None if answer.status_code != 503 else answer.text[:500]
                    except httpx.HTTPError:
                        pass  # busy, or exiting: the process says which
            await asyncio.sleep(HEALTH_EVERY_S)


async def _unless_client_leaves(request, work):
    """`await work`, or None (`work` cancelled) if the client hangs up first."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None
    finally:
        watcher.cancel()


def _forwarded(request) -> dict:
    return {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}


def _replica_error_body(r: Replica, error: Exception) -> dict:
    code = r.proc.poll()
    why = f"exited with code {code}" if code is not None else f"failed: {type(error).__name__}: {error}"
    return {"error": {"message": f"{r.name()} {why}; the request was not retried on another replica",
                      "type": "server_error", "param": None, "code": "replica_failed",
                      "replica": r.index, "port": r.port}}


def _replica_error(r: Replica, error: Exception):
    from fastapi.responses import JSONResponse

    r.failed += 1
    return JSONResponse(_replica_error_body(r, error), status_code=502)


def labelled_metrics(texts: dict[int, str]) -> str:
    """The replicas' /metrics (Prometheus text, by replica index) as one text: every sample labelled
    replica="INDEX", each family's HELP and TYPE lines once, its samples from every replica after them."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # family -> (HELP/TYPE lines, samples)
    for index, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith("#"):
                words = line.split(maxsplit=3)
                if len(words) >= 3 and words[1] in ("HELP", "TYPE"):
                    family = words[2]
                    head = families.setdefault(family, ([], []))[0]
                    if line not in head:
                        head.append(line)
                continue
            if not line.strip() or family is None:
                continue
            name, brace, rest = line.partition("{")
            if not brace:
                name, _, rest = line.partition(" ")
                rest = "} " + rest
            families[family][1].append(f'{name}{{replica="{index}"{"," if brace else ""}{rest}')
    return "".join(line + "\n" for head, samples in families.values() for line in (*head, *samples))


def router_metrics_text(replicas: list[Replica], policy: Policy) -> str:
    """GET /metrics of the router: each replica's state and load, the prefix hit rate (Prometheus text)."""
    lines = []
    for name, kind, help_text, value in (
        ("meshlm_router_replica_up", "gauge", "1 while the replica runs and its /health is not 503", lambda r: int(r.live)),
        ("meshlm_router_requests_in_flight", "gauge", "requests the replica is answering", lambda r: r.in_flight),
        ("meshlm_router_requests_routed_total", "counter", "requests routed to the replica", lambda r: r.routed),
        ("meshlm_router_replica_failures_total", "counter", "requests that ended with the replica failing",
         lambda r: r.failed),
    ):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{replica="{r.index}",port="{r.port}"}} {value(r)}' for r in replicas]
    lines += [f"# HELP meshlm_router_requests_total requests routed (policy {policy.name})",
              "# TYPE meshlm_router_requests_total counter", f"meshlm_router_requests_total {policy.requests}",
              "# HELP meshlm_router_prefix_hits_total requests sent to a replica already sent at least "
              f"{policy.threshold:g} of their prompt", "# TYPE meshlm_router_prefix_hits_total counter",
              f"meshlm_router_prefix_hits_total {policy.hits}",
              "# HELP meshlm_router_prefix_hit_rate prefix hits / requests routed",
              "# TYPE meshlm_router_prefix_hit_rate gauge", f"meshlm_router_prefix_hit_rate {policy.hit_rate}"]
    return "\n".join(lines) + "\n"
