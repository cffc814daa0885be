"""No request can break `meshlm serve`: a fuzz corpus of malformed bodies next to good requests, numerically
extreme sampling values, one sequence failing alone, and clients that hang up (streaming or not)."""

import asyncio
import json
import random
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from test_server import make_model_dir, running  # noqa: E402 -- after the importorskips

from meshlm.processes import free_port  # noqa: E402

KEY = "k"
HEADERS = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}


class Served:
    def __init__(self, url, engine, log):
        self.url, self.engine, self.log = url, engine, log
        self.step_delay = 0.0  # > 0: the engine sleeps this long per step (a slow model, for disconnects)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", headers=HEADERS).text

    def finished(self, reason: str) -> int:
        line = next(x for x in self.metrics().splitlines() if x.startswith(f'meshlm_requests_finished_total{{reason="{reason}"}}'))
        return int(line.split()[-1])


def serving(tmp_path_factory, **app_options):
    """A served tiny Llama, until the generator is closed (each module's `served` fixture runs its own);
    `app_options`: more of create_app's arguments."""
    from meshlm.infer.llm import LLM
    from meshlm.infer.server import AsyncEngine, create_app

    model_dir = make_model_dir(tmp_path_factory.mktemp("tiny-llama"))
    llm = LLM(str(model_dir), device="cpu", block_size=8, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=64)
    engine = AsyncEngine(llm.engine)
    log: list[str] = []
    app = create_app(engine, model_name="tiny", api_key=KEY, max_body_bytes=1 << 20, log=log.append, **app_options)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    state = Served(f"http://127.0.0.1:{port}", engine, log)
    step = llm.engine.step

    def slow_step():
        if state.step_delay:
            time.sleep(state.step_delay)
        return step()

    llm.engine.step = slow_step
    with running(srv, engine):
        yield state


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serving(tmp_path_factory)


def test_sampling_is_safe_for_every_accepted_value():
    import torch

    from meshlm.models.generation import sample

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50) * 5
    logits[1, 7] = float("-inf")
    greedy = logits.argmax(-1)
    for t in (1e-300, 1e-30, 1e-6, 5e-324):
        assert torch.equal(sample(logits, temperature=t, generator=gen), greedy), t
    for p in (1e-300, 5e-324, 1e-9):
        assert torch.equal(sample(logits, temperature=1.0, top_p=p, generator=gen), greedy), p
    for kw in (dict(temperature=1e300), dict(temperature=1e300, top_p=1e-300), dict(temperature=1e-4, top_k=1),
               dict(temperature=3.0, top_k=2, top_p=0.5)):
        tokens = sample(logits, generator=gen, **kw)
        assert tokens.shape == (3,) and bool(((tokens >= 0) & (tokens < 50)).all()), kw
    # A row the model made nan falls back to argmax of what is left instead of failing the batch.
    bad = logits.clone()
    bad[0, :10] = float("nan")
    assert sample(bad, temperature=0.7, generator=gen)[0] == bad[0, 10:].argmax() + 10


def test_one_failing_sequence_fails_alone(served):
    """A sequence whose model run or sampling raises finishes with "error"; the others keep their tokens."""
    from meshlm.infer.sequence import SamplingParams

    engine = served.engine.engine
    assert not engine.has_unfinished()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    with served.engine._cv:  # the engine thread is idle; keep it off while this test drives the engine
        alone = [r.token_ids for r in engine.generate(prompts, params)]
        runner, sampler = engine.runner.execute, engine.sampler._sample_row

        def execute(step):  # the model fails on any step holding token 99 (the poisoned request)
            if 99 in step.token_ids:
                raise RuntimeError("poisoned")
            return runner(step)

        def sample_row(logits, seq, greedy):
            if seq.prompt_token_ids[0] == 98:
                raise FloatingPointError("bad row")
            return sampler(logits, seq, greedy)

        engine.runner.execute, engine.sampler._sample_row = execute, sample_row
        try:
            before = engine.stats()["finish_reasons"].get("error", 0)
            out = engine.generate([prompts[0], [99, 5, 6], prompts[1], [98, 5], prompts[2]], params)
        finally:
            engine.runner.execute, engine.sampler._sample_row = runner, sampler
    assert [o.token_ids for o in (out[0], out[2], out[4])] == alone
    assert [o.finish_reason for o in out] == ["length", "error", "length", "error", "length"]
    assert "poisoned" in out[1].error and "bad row" in out[3].error
    assert engine.stats()["finish_reasons"]["error"] == before + 2
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests


def fuzz_corpus(seed: int = 0, size: int = 640) -> list[tuple[str, bytes]]:
    """(path, body) pairs, deterministic for a seed: a few hand-made broken texts, then a valid body with one
    or two fields (or message fields) set to a weird value. Some mutations stay valid (unknown fields, a
    huge temperature): the test counts how many are refused."""
    rng = random.Random(seed)
    weird = [None, True, False, 0, -1, 1.5, -1e308, 1e308, 2**64, -(2**63) - 1, 10**4000, "", "x", "\u0000",
             "\ud800", "\udfff\ud800", "\u202e\u200b\ufeff", "💥" * 500, "a" * 100_000, [], {}, [[]], [None],
             [1, "a"], {"a": {"b": [1]}}, [True, False], [-1], [2**40], ["\ud83d"], [[1, 2], "x"], [[]] * 3,
             {"type": "text", "text": 5}, [{"type": "text", "text": 5}], [{"type": 5}], [{"text": "hi"}], ["hi"]]
    raw_numbers = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 5000, "0.0000000001e-400"]
    fields = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "stop", "seed",
              "logprobs", "stream", "stream_options", "stop_token_ids", "ignore_eos", "max_completion_tokens",
              "messages", "top_logprobs", "user", "echo"]
    base_c = {"model": "tiny", "prompt": "hello world", "max_tokens": 2}
    base_m = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    corpus: list[tuple[str, bytes]] = []
    for text in (b"", b"{", b"[", b"null", b"123", b'"s"', b"[]", b"{not json", b'{"model": "tiny",}',
                 b"\xff\xfe\x00", b"\xef\xbb\xbf{}", b'{"model": "tiny", "prompt": "a\\ud800"}',
                 b"[" * 100_000, b'{"a":' * 100_000, b"[" * 100_000 + b"]" * 100_000,
                 b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                 b'{"model": "tiny", "prompt": "' + b"x" * (2 << 20) + b'"}'):  # the last: over the body limit
        corpus += [("/v1/completions", text), ("/v1/chat/completions", text)]
    while len(corpus) < size:
        chat = rng.random() < 0.5
        body = json.loads(json.dumps(base_m if chat else base_c))
        for _ in range(rng.choice((1, 1, 2))):
            key = rng.choice(fields)
            if chat and rng.random() < 0.4:  # inside a message
                msg = body["messages"][0] if isinstance(body.get("messages"), list) and body["messages"] else {}
                msg[rng.choice(["role", "content", "name"])] = rng.choice(weird)
                body["messages"] = [msg]
            else:
                body[key] = rng.choice(weird)
        text = json.dumps(body).encode()  # ASCII-escaped: lone surrogates travel as \ud800
        if rng.random() < 0.15:  # a number JSON itself cannot hold but Python's parser accepts
            text = text[:-1] + f', "{rng.choice(fields)}": {rng.choice(raw_numbers)}}}'.encode()
        corpus.append(("/v1/chat/completions" if chat else "/v1/completions", text))
    return corpus


GOOD = [({"model": "tiny", "prompt": [5 + i, 40, 41, 42], "max_tokens": 8, "ignore_eos": True, "logprobs": 0,
          "temperature": 0.9 if i % 2 else 0, "seed": i}) for i in range(6)]
# Valid but extreme: must be served (these once put nan into the whole batch).
EXTREME = [{"model": "tiny", "prompt": "hi", "max_tokens": 3, **kw} for kw in
           (dict(temperature=1e-300), dict(top_p=1e-300), dict(temperature=1e300), dict(temperature=5e-324, top_p=5e-324),
            dict(temperature=1e300, top_k=1), dict(top_k=10**30), dict(seed=-(2**63)))]


def _tokens(r) -> list:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_fuzz_bodies_next_to_good_requests(served):
    corpus = fuzz_corpus()
    assert len(corpus) >= 600
    with httpx.Client(base_url=served.url, headers=HEADERS, timeout=60) as client:
        alone = [_tokens(client.post("/v1/completions", json=b)) for b in GOOD]

    async def main():
        sem = asyncio.Semaphore(12)
        async with httpx.AsyncClient(base_url=served.url, headers=HEADERS, timeout=120) as client:
            async def send(path, content):
                async with sem:
                    return await client.post(path, content=content)

            bad = [asyncio.ensure_future(send(path, text)) for path, text in corpus[:len(corpus) // 2]]
            # The good requests start while the fuzz bodies arrive, and run next to the rest of them.
            good = [asyncio.ensure_future(send("/v1/completions", json.dumps(b).encode())) for b in GOOD + EXTREME]
            bad += [asyncio.ensure_future(send(path, text)) for path, text in corpus[len(corpus) // 2:]]
            return await asyncio.gather(*bad), await asyncio.gather(*good)

    bad, good = asyncio.run(main())
    statuses = [r.status_code for r in bad + good]
    assert not [s for s in statuses if s >= 500], sorted(set(statuses))
    for r in bad:
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text
    assert sum(400 <= r.status_code < 500 for r in bad) >= 500  # the rest are mutations that stay valid
    assert 413 in statuses
    assert [_tokens(r) for r in good[:len(GOOD)]] == alone
    assert all(r.status_code == 200 for r in good[len(GOOD):]), [r.text for r in good[len(GOOD):]]
    # Nothing left behind: no request, stream, KV block or generator outlives its request.
    deadline = time.monotonic() + 10
    while served.engine.engine.has_unfinished() or served.engine._streams:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    eng = served.engine.engine
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests and not eng._detok
    assert not eng.sampler.generators


def _wait_for(cond, what: str):
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_disconnects_abort_and_free_blocks(served):
    """A client that leaves -- streaming or not -- aborts its request (not a natural finish) and frees its KV."""
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 100, "ignore_eos": True}
    served.step_delay = 0.02  # 100 tokens take >= 2 s: the client leaves long before the natural end
    try:
        aborts, lengths = served.finished("abort"), served.finished("length")
        with httpx.stream("POST", served.url + "/v1/completions", headers=HEADERS, timeout=60,
                          json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leave after the first event
        _wait_for(lambda: served.finished("abort") == aborts + 1, "a disconnected stream was not aborted")
        _wait_for(lambda: "meshlm_kv_blocks_used 0" in served.metrics(), "an aborted stream kept its KV blocks")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/completions", headers=HEADERS, json=body, timeout=0.5)
        _wait_for(lambda: served.finished("abort") == aborts + 2, "a non-streaming client's request ran on")
        _wait_for(lambda: "meshlm_kv_blocks_used 0" in served.metrics(), "an aborted request kept its KV blocks")
        assert served.finished("length") == lengths  # neither ran to its end
    finally:
        served.step_delay = 0.0
    # The access log has one line per request: method, path, status, tokens, latency.
    assert any(line.startswith("POST /v1/completions 499 tokens=") for line in served.log)
    assert any(line.startswith("POST /v1/completions 200 tokens=") for line in served.log)


# ---- serving gaps -------------------------------------------------------------------------------


def _post(served, path, body):
    r = httpx.post(served.url + path, headers=HEADERS, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(served, path, body) -> list:
    events = []
    with httpx.stream("POST", served.url + path, headers=HEADERS, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def test_n_and_several_prompts(served):
    body = {"model": "tiny", "prompt": [[5, 6, 7], "hello world"], "n": 3, "max_tokens": 5, "temperature": 0.9,
            "seed": 11, "ignore_eos": True}
    data = _post(served, "/v1/completions", body)
    choices = data["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    # Choice prompt * n + j is that prompt sampled alone with seed + j.
    for i, prompt in enumerate(body["prompt"]):
        for j in range(3):
            alone = _post(served, "/v1/completions", {**body, "prompt": prompt, "n": 1, "seed": 11 + j})
            assert choices[i * 3 + j]["text"] == alone["choices"][0]["text"]
    assert len({c["text"] for c in choices[:3]}) > 1  # the samples differ
    single = _post(served, "/v1/completions", {**body, "n": 1, "prompt": "hello world"})["usage"]["prompt_tokens"]
    assert {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {"prompt_tokens": 3 + single, "completion_tokens": 30, "total_tokens": 33 + single}
    # the prompt tokens the prefix cache held (OpenAI's prompt_tokens_details), once per prompt: a prompt of three
    # whole blocks sent again finds them cached
    again = {**body, "prompt": list(range(30, 55)), "n": 2}
    _post(served, "/v1/completions", again)
    assert _post(served, "/v1/completions", again)["usage"]["prompt_tokens_details"] == {"cached_tokens": 24}
    # Streamed: chunks of the six choices interleave; each choice's text is the same as above.
    texts = {}
    for e in _stream(served, "/v1/completions", body):
        c = e["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(6)] == [c["text"] for c in choices]
    chat = _post(served, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                  "n": 2, "max_tokens": 3, "temperature": 0})
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]  # greedy: the same answer twice
    for bad in ({"n": 0}, {"n": 65}, {"n": 2, "prompt": ["a"] * 40}, {"prompt": [[]]}, {"prompt": ["a", 5]},
                {"best_of": 2}):
        r = httpx.post(served.url + "/v1/completions", headers=HEADERS, json={**body, **bad}, timeout=60)
        assert r.status_code == 400, (bad, r.text)


def test_logprobs_in_streamed_chunks(served):
    body = {"model": "tiny", "prompt": "the quick", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    whole = _post(served, "/v1/completions", body)["choices"][0]["logprobs"]
    lp = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    for e in _stream(served, "/v1/completions", body):
        for key in lp:
            lp[key] += e["choices"][0].get("logprobs", {}).get(key, []) if e["choices"][0].get("logprobs") else []
    assert lp == whole and len(lp["tokens"]) == 6
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
    whole = _post(served, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    streamed = [t for e in _stream(served, "/v1/chat/completions", chat)
                for t in ((e["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert streamed == whole and len(whole) == 4
    # OpenAI's chat entries carry each token's UTF-8 bytes, the alternatives' too (the openai client reads them).
    for t in whole:
        assert t["bytes"] == list(t["token"].encode()) and len(t["top_logprobs"]) == 1
        assert all(alt["bytes"] == list(alt["token"].encode()) for alt in t["top_logprobs"])


def test_stop_strings_are_checked_incrementally(served):
    """Text and stop cuts equal those of a full decode, yet each step decodes only a few tokens."""
    from meshlm.infer.sequence import SamplingParams

    engine = served.engine.engine
    tok = engine.tokenizer
    decoded = []
    with served.engine._cv:
        plain = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
        full = tok.decode(plain.token_ids)
        assert plain.text == full
        stop = full[60:63]
        decode = tok.decode
        tok.decode = lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw)
        try:
            cut = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                                                              stop=[stop, "never-in-this-text"]))[0]
        finally:
            tok.decode = decode
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    # Re-decoding the whole output every step would decode ~n^2/2 tokens.
    assert sum(decoded) <= 6 * len(cut.token_ids), (sum(decoded), len(cut.token_ids))


def test_serve_banner_names_the_model_id():
    from meshlm.cli.serve import serve_banner

    line = serve_banner("127.0.0.1", 8000, "runs/default", "default")
    assert '"model": "default"' in line and "runs/default" in line


def test_a_request_longer_than_the_kv_cache_gets_a_4xx_and_the_server_goes_on(tmp_path):
    """One process whose KV cache (6 blocks of 4 tokens) cannot hold prompt + max_tokens refuses the request
    with a 400 naming the blocks (streamed or not) and still serves one that fits: what `--cp` lifts."""
    from fastapi.testclient import TestClient

    from meshlm.infer.llm import LLM
    from meshlm.infer.server import AsyncEngine, create_app

    llm = LLM(str(make_model_dir(tmp_path)), device="cpu", block_size=4, num_blocks=6)
    engine = AsyncEngine(llm.engine)
    try:
        client = TestClient(create_app(engine, model_name="tiny"))
        body = {"model": "tiny", "prompt": [5] * 20, "max_tokens": 8, "temperature": 0}
        for stream in (False, True):
            r = client.post("/v1/completions", json={**body, "stream": stream})
            assert r.status_code == 400, (stream, r.status_code, r.text)
            assert "7 KV blocks" in r.json()["error"]["message"] and "6 blocks" in r.json()["error"]["message"]
        fits = client.post("/v1/completions", json={**body, "prompt": [5] * 12, "max_tokens": 8})
        assert fits.status_code == 200 and fits.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert client.get("/health").status_code == 200
    finally:
        engine.stop()


def test_settings_beyond_the_machine_are_refused_in_one_line(tmp_path, capsys):
    """Found by fuzzing `meshlm serve`'s flags: each of these died in a traceback (the port when binding, the cache
    and the device when allocating)."""
    from meshlm.cli import main
    from meshlm.infer.llm import LLM

    model_dir = make_model_dir(tmp_path)
    capsys.readouterr()  # the model's writing
    for port in ("-1", "65536"):
        assert main(["serve", "--model", str(model_dir), "--port", port]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last == f"meshlm serve: error: --port={port} must be in 0..65535"
    with pytest.raises(ValueError, match=r"a KV cache of 1,000,000,000,000 MiB .*--kv-cache-mb\) is more than this "
                                         r"host's memory"):
        LLM(str(model_dir), device="cpu", kv_cache_memory_bytes=10**12 << 20)
    # and a context beyond the model's positions, which it would have served (vLLM refuses it too)
    with pytest.raises(ValueError, match=r"max_model_len=1000000000 \(--max-model-len\) must be in 1..128"):
        LLM(str(model_dir), device="cpu", max_model_len=10**9)
    assert LLM(str(model_dir), device="cpu", max_model_len=64).engine.max_model_len == 64
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' \(--device\) but no CUDA device is available here"):
            LLM(str(model_dir), device="cuda")


def test_a_tp_the_model_cannot_take_is_refused_before_any_rank_starts(tmp_path, capsys):
    """The ranks refused it too, each in the same line, after the launcher had started them all."""
    from meshlm.cli import main

    model_dir = make_model_dir(tmp_path)
    capsys.readouterr()
    assert main(["generate", "--hf", str(model_dir), "--prompt", "x", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["meshlm generate: error: model.num_heads=4 is not divisible by tp=3 (tensor parallelism splits it "
                   "evenly over the tp ranks); choose tp among the divisors {1,2,4} of 4 (it must also divide the "
                   "other sizes), or change model.num_heads to a multiple of 3"]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


@pytest.mark.parametrize("path, change, param, says", [
    ("completions", {"max_tokens": 0}, "max_tokens", "max_tokens=0 must be an integer >= 1"),
    ("chat/completions", {"max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens=0 must be an integer >= 1"),
    ("chat/completions", {"max_completion_tokens": 3}, "max_tokens", "give one of max_tokens and max_completion"),
    ("completions", {"max_completion_tokens": 3}, "max_completion_tokens", "a completion takes max_tokens"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs=21 must be"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ("completions", {"temperature": -1}, "temperature", "temperature=-1.0 must be >= 0"),
    ("completions", {"top_p": 2}, "top_p", "top_p=2.0 must be in (0, 1]"),
    ("completions", {"top_k": -5}, "top_k", "top_k=-5 must be an integer >= 1"),
    ("completions", {"stop": ""}, "stop", "stop strings must be non-empty"),
    ("completions", {"seed": 2**64}, "seed", "seed=18446744073709551616 must be an integer in"),
    ("completions", {"stop_token_ids": [10**9]}, "stop_token_ids", "outside the vocabulary"),
    ("completions", {"stop_token_ids": [True]}, "stop_token_ids", "must be a list of integers"),
    ("completions", {"n": 1e308}, "n", "n=1e+308 is out of range"),
    ("chat/completions", {"echo": True}, "echo", "echo=True is not supported by this server"),
    ("completions", {"min_p": 1.5}, "min_p", "min_p=1.5 must be in [0, 1] (0 is off)"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty", "presence_penalty=2.5 must be in [-2, 2]"),
    ("chat/completions", {"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty=0.0 must be > 0"),
    ("completions", {"logit_bias": {"1": 101}}, "logit_bias", "must map token ids to biases in [-100, 100]"),
    ("completions", {"logit_bias": {"a": 1}}, "logit_bias", "logit_bias key 'a' is not a token id"),
    ("completions", {"logit_bias": {"1": "x"}}, "logit_bias", "logit_bias['1']='x' must be a number"),
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias", "logit_bias [99999] are outside the vocabulary"),
    ("completions", {"logit_bias": {"5": 1, "05": 2}}, "logit_bias", "logit_bias names token 5 twice"),
    ("completions", {"echo": True, "max_tokens": 0, "min_tokens": 2}, "min_tokens", "min_tokens asks for tokens"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                          "stop": ["\""]}, "stop", "stop would cut a tool call short"),
    ("completions", {"suffix": "!"}, "suffix", "is not supported"),
    ("completions", {"bad_words": ["x"]}, "bad_words", "bad_words=list is not supported by this server"),
    ("chat/completions", {"skip_special_tokens": False}, "skip_special_tokens", "is not supported"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs", "is not supported"),
    ("completions", {"allowed_token_ids": [99999]}, "allowed_token_ids",
     "allowed_token_ids [99999] are outside the vocabulary"),
    ("completions", {"allowed_token_ids": "5"}, "allowed_token_ids", "allowed_token_ids must be a list of integers"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids", "must be a non-empty list of token ids"),
    ("completions", {"include_stop_str_in_output": 1}, "include_stop_str_in_output", "must be true or false"),
    ("completions", {"guided_json": {"type": "object"}}, "guided_json",
     "guided_json is vLLM's older name: give structured_outputs {\"json\": ...}"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     "tool_choice \"auto\" (the default with tools) needs a parser of the model's own tool-call format: start the "
     "server with --tool-call-parser"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "with N one of 'f'"),
    ("chat/completions", {"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "tools must be a list"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice", "tool_choice needs tools to choose from"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "stream": True,
                          "tool_choice": {"type": "function", "function": {"name": "f"}}, "stop_token_ids": [5]},
     "stop_token_ids", "stop_token_ids would cut a tool call short: leave it out with tool_choice naming a function"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "tool_choice", "a tool call is JSON of its own"),
    ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "is not supported"),
    ("chat/completions", {"chat_template_kwargs": "x"}, "chat_template_kwargs", "chat_template_kwargs must be an object"),
    ("chat/completions", {"chat_template_kwargs": {"tools": [], "a": 1}}, "chat_template_kwargs",
     "chat_template_kwargs sets tools, which the server sets from the request"),
    ("chat/completions", {"continue_final_message": True}, "continue_final_message",
     "give add_generation_prompt false with it"),
    ("chat/completions", {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     "continue_final_message continues an assistant's message; the last message's role is 'user'"),
    ("chat/completions", {"add_generation_prompt": "yes"}, "add_generation_prompt", "must be true or false"),
    ("chat/completions", {"chat_template": "{{ x }}"}, "chat_template", "is not supported by this server"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format", "response_format json does not compile: Invalid type: nonsense"),
    ("completions", {"structured_outputs": {"regex": "("}}, "structured_outputs", "structured_outputs regex does not"),
    ("completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs", "choice must be a non-empty list"),
    ("completions", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "give one of response_format and structured_outputs"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "give stream: true with it"),
    ("completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage",
     "include_usage='yes' must be true or false"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages", "each message needs a 'role' and a 'content'"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages",
     "message role 'wizard' is not one of system, developer, user, assistant, tool, function"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "a content part of type 'image_url': this model reads text only"),
    ("completions", {"prompt": "x " * 2000}, "prompt", "but the context length is"),
])
def test_a_request_is_refused_naming_the_parameter_it_sent(served, path, change, param, says):
    body = {**(CHAT if path.startswith("chat") else COMPLETION), **change}
    r = httpx.post(f"{served.url}/v1/{path}", headers=HEADERS, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_parameters_that_ask_for_nothing_are_served(served):
    plain = {"echo": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [],
             "tool_choice": "none", "response_format": {"type": "text"}, "user": "u1", "max_completion_tokens": 2}
    r = httpx.post(f"{served.url}/v1/chat/completions", headers=HEADERS, json={**CHAT, **plain}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_chat_without_max_tokens_may_run_to_the_end_of_the_context(served):
    """OpenAI's chat default (no max_tokens: up to the context), where a completion's is 16 tokens."""
    body = {**CHAT, "ignore_eos": True, "temperature": 0}
    del body["max_tokens"]
    r = httpx.post(f"{served.url}/v1/chat/completions", headers=HEADERS, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    context = served.engine.engine.max_model_len
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == context
    assert out["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{served.url}/v1/completions", headers=HEADERS, timeout=30,
                   json={"model": "tiny", "prompt": "hello", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16


def test_unknown_paths_and_methods_answer_in_the_api_error_shape(served):
    r = httpx.get(f"{served.url}/v1/nope", headers=HEADERS, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such path '/v1/nope'", r.text
    r = httpx.get(f"{served.url}/v1/completions", headers=HEADERS, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"] == "GET is not allowed on '/v1/completions'"


def test_a_client_that_leaves_while_sending_its_body_is_logged_as_gone_not_as_an_error(served):
    import logging
    import socket
    from urllib.parse import urlparse

    body = json.dumps(COMPLETION).encode()
    url = urlparse(served.url)
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    server_log = logging.getLogger("uvicorn.error")  # where an exception the app lets out is written
    server_log.addHandler(handler)
    try:
        before = len(served.log)
        with socket.create_connection((url.hostname, url.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body) + 10).encode()
                      + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while len(served.log) == before and not errors:
            assert time.monotonic() < deadline, "the request was never logged"
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        server_log.removeHandler(handler)
    assert not errors, [r.getMessage() for r in errors]
    assert " 499 " in served.log[-1] or served.log[-1].split()[2] == "499", served.log[-1]
    assert httpx.get(f"{served.url}/health", timeout=10).json() == {"status": "ok"}
