"""`meshlm serve --replicas R`: the routing policies alone (cache-aware, round robin, the bounded prefix record),
then two real replicas behind the router over HTTP: the same greedy tokens as one server, streams, the prefix
hit rates of both policies on a shared-prefix trace, a replica killed mid-stream, no replica left behind."""

import json
import os
import signal
import time

import pytest

from meshlm.infer.router import (CacheAwarePolicy, NoReplica, PrefixRecord, RoundRobinPolicy, make_policy,
                                 prefix_digests, routing_key)

LIVE = [True, True, True]


# ---------------------------------------------------------------------------------------------
# The policies
# ---------------------------------------------------------------------------------------------


def test_cache_aware_sends_a_shared_prefix_where_it_went_before():
    policy = CacheAwarePolicy(3, chunk=4)
    system = "you are a helpful assistant. " * 4
    first = policy.route(system + "what is 2+2?", [0, 0, 0], LIVE)
    assert not first.hit
    # Another prefix goes elsewhere (the least loaded replica with the smallest record).
    other = policy.route("a different document entirely, nothing shared " * 2, [1, 0, 0], LIVE)
    assert other.replica != first.replica and not other.hit
    for loads in ([0, 0, 0], [1, 2, 3], [3, 1, 0]):  # balanced enough: the prefix wins over the load
        again = policy.route(system + "and 3+3?", loads, LIVE)
        assert again.replica == first.replica and again.hit and again.matched >= len(system) - 4, loads
    # A short shared start (under the threshold) is no hit: least loaded.
    loads = [0, 0, 0]
    loads[first.replica] = 1
    short = policy.route(system[:8] + "x" * 100, loads, LIVE)
    assert short.replica != first.replica and not short.hit
    assert policy.requests == 6 and policy.hits == 3 and policy.hit_rate == 0.5
    # Token-id prompts work the same way.
    tokens = tuple(range(100))
    a = policy.route(tokens, [0, 0, 0], LIVE)
    assert policy.route(tokens[:80] + (7, 7), [0, 0, 0], LIVE).replica == a.replica


def test_cache_aware_falls_back_to_the_least_loaded_when_imbalanced():
    policy = CacheAwarePolicy(2, chunk=4, balance_abs=4, balance_rel=1.5)
    prompt = "the same long prompt, shared by every request " * 3
    home = policy.route(prompt, [0, 0], [True, True]).replica
    loads = [0, 0]
    loads[home] = 4  # 4 against 0: within the absolute bound, the prefix wins
    assert policy.route(prompt, loads, [True, True]).replica == home
    loads[home] = 10  # 10 against 0: over both bounds
    away = policy.route(prompt, loads, [True, True])
    assert away.replica != home and not away.hit
    # A replica that is not alive gets nothing, whatever it holds; none alive is an error.
    live = [True, True]
    live[home] = False
    assert policy.route(prompt, [0, 0], live).replica != home
    with pytest.raises(NoReplica):
        policy.route(prompt, [0, 0], [False, False])


def test_round_robin_cycles_over_the_live_replicas():
    policy = RoundRobinPolicy(3, chunk=4)
    assert [policy.route("same prompt " * 5, [9, 0, 0], LIVE).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [policy.route("x", [0, 0, 0], [True, False, True]).replica for _ in range(4)] == [0, 2, 0, 2]
    # It keeps the records too, so its hit rate compares with cache-aware's: after one round, every repeat hits.
    assert policy.hits == 3 and policy.requests == 10
    assert make_policy("round_robin", 2).name == "round_robin"
    with pytest.raises(ValueError, match="unknown router"):
        make_policy("random", 2)
    with pytest.raises(ValueError, match="at least one replica"):
        CacheAwarePolicy(0)


def test_prefix_record_is_bounded_and_evicts_least_recently_used_branches_first():
    record = PrefixRecord(capacity=10)
    a, b = prefix_digests("a" * 24, 4), prefix_digests("b" * 24, 4)  # 6 chunks each
    record.insert(a)
    assert len(record) == 6 and record.match(a) == 6
    record.insert(b)
    assert len(record) == 10  # the bound
    # a's longest chunks went first; its start stays matchable.
    assert record.match(b) == 6 and record.match(a) == 4
    record.insert(a[:2])  # a's start is now the freshest
    record.insert(prefix_digests("c" * 16, 4))
    assert len(record) == 10 and record.match(a) == 2 and record.match(b) < 6
    assert prefix_digests("abcdefgh", 4) == prefix_digests("abcdefghij", 4)  # whole chunks only
    assert prefix_digests("abc", 4) == []
    assert prefix_digests("abcd", 4) != prefix_digests((97, 98, 99, 100), 4)


def test_routing_key_reads_prompts_and_messages():
    assert routing_key(b'{"prompt": "hello"}', chat=False) == "hello"
    assert routing_key(b'{"prompt": ["first", "second"]}', chat=False) == "first"
    assert routing_key(b'{"prompt": [1, 2, 3]}', chat=False) == (1, 2, 3)
    assert routing_key(b'{"prompt": [[4, 5], [6]]}', chat=False) == (4, 5)
    chat = routing_key(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}]}).encode(), chat=True)
    assert chat == "<|system|>\nbe brief\n<|user|>\nhi\n"
    # a Responses request routes as the chat it asks for
    assert routing_key(json.dumps({"instructions": "be brief", "input": "hi"}).encode(), chat=True) == chat
    assert routing_key(json.dumps({"input": [{"role": "user", "content": "hi"}]}).encode(), chat=True) == \
        "<|user|>\nhi\n"
    for junk in (b"{not json", b"[1]", b'{"prompt": 3}', b'{"prompt": [1, "a"]}', b"\xff"):
        assert routing_key(junk, chat=False) == "" and routing_key(junk, chat=True) == ""


def test_bad_replica_values_are_refused_before_anything_starts(tmp_path, capsys):
    from meshlm.cli import main

    model = str(tmp_path / "no-model-here")
    assert main(["serve", "--model", model, "--replicas", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replicas=0 must be >= 1" in err[0], err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", model, "--replicas", "2", "--router", "random"])
    assert e.value.code == 2 and "invalid choice: 'random'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Two replicas behind the router, over HTTP
# ---------------------------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from test_server import HEADERS, KEY, make_model_dir, running, serve_args, serve_argv, server_process, \
    sse_events  # noqa: E402

from meshlm.processes import alive, descendants, free_port  # noqa: E402

PROMPTS = ["the quick brown fox", "hello world, this is", "def add(a, b):", "continuous batching with"]
# Three documents, each asked about three times, interleaved: an odd number of groups, so round robin sends a
# group's requests to alternating replicas.
DOCUMENTS = [("the quick brown fox jumps over the lazy dog " * 4, "what jumps?"),
             ("hello world, this is meshlm serving tokens " * 4, "who serves?"),
             ("continuous batching with a paged kv cache " * 4, "what is paged?")]
TRACE = [doc + f" question {rep}: {q}" for rep in range(3) for doc, q in DOCUMENTS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny-llama"), max_len=512)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy completions of PROMPTS by one ordinary server."""
    from meshlm.cli.serve import build_server

    port = free_port()
    srv, engine = build_server(serve_args(model_dir, port))
    with running(srv, engine):
        return [complete(f"http://127.0.0.1:{port}", p)[1]["choices"][0] for p in PROMPTS]


def complete(url: str, prompt: str, **kw) -> tuple[httpx.Response, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **kw}
    r = httpx.post(url + "/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r, r.json()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def engine_metric(url: str, name: str) -> float:
    """A metric of the replicas' engines, summed (their ports from the router's /health)."""
    ports = [r["port"] for r in httpx.get(url + "/health").json()["replicas"]]
    return sum(metric(httpx.get(f"http://127.0.0.1:{p}/metrics", headers=HEADERS).text, name) for p in ports)


def run_trace(url: str) -> tuple[float, float]:
    """TRACE through a fresh router: (its prefix hit rate, the engines' prefix-cache hit tokens)."""
    for prompt in TRACE:
        complete(url, prompt, max_tokens=2)
    text = httpx.get(url + "/metrics", headers=HEADERS).text
    assert metric(text, "meshlm_router_requests_total") == len(TRACE)
    hits = engine_metric(url, "meshlm_prefix_cache_hit_tokens_total")
    # the router's /metrics carries the replicas' own, each labelled with its replica
    assert metric(text, "meshlm_prefix_cache_hit_tokens_total") == hits
    assert {line.split("}")[0] for line in text.splitlines() if line.startswith("meshlm_requests_total{")} == \
        {'meshlm_requests_total{replica="0"', 'meshlm_requests_total{replica="1"'}, text
    return metric(text, "meshlm_router_prefix_hit_rate"), hits


def replica_pids(router_pid: int) -> dict[int, int]:
    """{port: pid} of the replicas below the router process (from /proc)."""
    found = {}
    for pid in descendants(router_pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().rstrip("\0").split("\0")
        except OSError:
            continue
        if argv[-7:-1] == ["--replicas", "1", "--host", "127.0.0.1", "--port", argv[-2]] and argv[-1] == "--quiet":
            found[int(argv[-2])] = pid
    return found


def running_pids(pids) -> list[int]:
    return [pid for pid in pids if alive(pid)]


@pytest.fixture(scope="module")
def trace_results():
    """Each policy's (router prefix hit rate, engines' prefix-cache hit tokens) on TRACE, filled by the tests."""
    return {}


def test_cache_aware_router_serves_like_one_server_and_stops_its_replicas(model_dir, reference, trace_results):
    port = free_port()
    with server_process(serve_argv(model_dir, port, "--replicas", "2", "--api-key", KEY), port) as (proc, url):
        pids = replica_pids(proc.pid)
        assert len(pids) == 2, pids
        trace_results["cache_aware"] = run_trace(url)  # first: on fresh replicas, as round robin's
        # The key: refused by the router itself, before any routing.
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 401 and "x-meshlm-replica" not in r.headers
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/v1/models", headers=HEADERS).json()["data"][0]["id"] == "tiny"
        used = set()
        for prompt, expected in zip(PROMPTS, reference):
            r, data = complete(url, prompt)
            used.add(r.headers["x-meshlm-replica"])
            got = data["choices"][0]
            assert got["text"] == expected["text"] and got["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
        assert used == {"0", "1"}  # distinct prompts spread over both replicas
        # Streams pass through event by event, completions and chat; errors of the replica come back unchanged.
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == reference[0]["text"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}
        whole = httpx.post(url + "/v1/chat/completions", json=chat, headers=HEADERS, timeout=60).json()
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, headers=HEADERS,
                          timeout=60) as r:
            events = sse_events(r)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == \
            whole["choices"][0]["message"]["content"]
        # vLLM's /tokenize and /detokenize pass through too: the chat's prompt as the replica counts it
        tokens = httpx.post(url + "/tokenize", json={k: chat[k] for k in ("model", "messages")}, headers=HEADERS).json()
        assert tokens["count"] == whole["usage"]["prompt_tokens"] == len(tokens["tokens"]), tokens
        text = httpx.post(url + "/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}, headers=HEADERS)
        assert "hello world" in text.json()["prompt"], text.text
        answer = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "hello world", "temperature": 0,
                                                         "max_output_tokens": 6}, headers=HEADERS, timeout=60)
        assert answer.json()["object"] == "response" and answer.json()["usage"]["input_tokens"] == tokens["count"]
        r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, headers=HEADERS)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # A client that leaves mid-stream: the router closes its replica's stream, which aborts the request there.
        with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 400}, headers=HEADERS,
                          timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.monotonic() + 20
        while metric(httpx.get(url + "/metrics", headers=HEADERS).text, "meshlm_router_requests_in_flight") or \
                engine_metric(url, "meshlm_requests_running"):
            assert time.monotonic() < deadline, "an abandoned request kept running"
            time.sleep(0.05)
        # SIGTERM to the router: it stops, and so does every replica.
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while running_pids(pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running_pids(pids.values()) == []


def test_round_robin_router_and_a_replica_killed_mid_stream(model_dir, trace_results):
    port = free_port()
    with server_process(serve_argv(model_dir, port, "--replicas", "2", "--router", "round_robin", "--api-key", KEY),
                        port) as (proc, url):
        pids = replica_pids(proc.pid)
        trace_results["round_robin"] = run_trace(url)
        ports = {s["replica"]: s["port"] for s in httpx.get(url + "/health").json()["replicas"]}
        # A long stream; its replica is killed once it has started.
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
            victim = int(r.headers["x-meshlm-replica"])
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            victim_port = ports[victim]
            os.kill(pids[victim_port], signal.SIGKILL)
            events = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                      for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "replica_failed" and error["replica"] == victim and error["port"] == victim_port
        assert f"replica {victim} (127.0.0.1:{victim_port})" in error["message"]
        assert "not retried" in error["message"]
        # The other replica answers everything now; /health says degraded.
        for _ in range(3):
            r, _ = complete(url, "the quick brown fox")
            assert r.headers["x-meshlm-replica"] == str(1 - victim)
        health = httpx.get(url + "/health")
        states = {s["replica"]: s for s in health.json()["replicas"]}
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert states[victim]["status"] == "exited" and states[1 - victim]["status"] == "ok"
        metrics = httpx.get(url + "/metrics", headers=HEADERS).text
        assert f'meshlm_router_replica_failures_total{{replica="{victim}",port="{victim_port}"}} 1' in metrics
        assert f'meshlm_router_replica_up{{replica="{victim}",port="{victim_port}"}} 0' in metrics
        # The last one gone too: 503, for /health and for requests.
        os.kill(pids[states[1 - victim]["port"]], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "the router did not notice its last replica exit"
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=HEADERS)
        assert r.status_code == 503 and "no replica is alive" in r.json()["error"]["message"]
        assert proc.poll() is None  # the router itself stays up, saying so


def test_cache_aware_beats_round_robin_on_a_shared_prefix_trace(trace_results):
    if set(trace_results) != {"cache_aware", "round_robin"}:
        pytest.skip("needs both router tests of this file")
    (ca_rate, ca_tokens), (rr_rate, rr_tokens) = trace_results["cache_aware"], trace_results["round_robin"]
    print(f"router prefix hit rate: cache_aware {ca_rate:.3f}, round_robin {rr_rate:.3f}; engines' prefix-cache "
          f"hit tokens: {ca_tokens:.0f} vs {rr_tokens:.0f}")
    assert ca_rate > rr_rate and ca_tokens > rr_tokens
