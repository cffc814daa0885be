"""`meshlm serve` over real HTTP (httpx) on 127.0.0.1: completions and chat, streamed and not,
concurrency, metrics, and every kind of bad input answered with a 4xx while a good request completes."""

import asyncio
import contextlib
import json
import threading
import time
from pathlib import Path

import pytest

from meshlm.processes import descendants, free_port, stop_tree

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

KEY = "secret-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
from tiny_hf import make_model_dir  # noqa: E402,F401 -- others import it from here


@contextlib.contextmanager
def server_process(argv: list[str], port: int):
    """`meshlm <argv>` in a session of its own, without the launcher variables of any enclosing launch;
    yields (the process, its URL) once GET /health answers 200; kills it and its ranks on the way out."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, proc)
        yield proc, url
    finally:
        stop_tree(proc, 10)


def wait_until_up(url: str, proc) -> None:
    """Wait until the server `proc` started answers GET /health with 200 (the test fails after 120 s, or at
    once if it exits, with the end of what it printed where its output is a pipe: it and its ranks are stopped
    first, so that the pipe ends)."""
    from meshlm.infer.client import ServerNotReady, wait_until_healthy

    try:
        wait_until_healthy(url, timeout_s=120, proc=proc)
    except ServerNotReady as e:
        said = ""
        if proc.stdout is not None:
            stop_tree(proc, 10)
            said = "; it printed:\n" + proc.stdout.read()[-4000:]
        pytest.fail(f"the server did not come up: {e}{said}")


def rank_pid(root: int, local_rank: int) -> int:
    """The pid of the process with LOCAL_RANK=`local_rank` among the descendants of `root`."""
    found = []
    for pid in descendants(root):
        try:
            if f"LOCAL_RANK={local_rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            continue
    assert len(found) == 1, found
    return found[0]


def serve_argv(model_dir, port: int, *flags: str) -> list[str]:
    """The command line of a tiny CPU `meshlm serve`."""
    return ["serve", "--model", str(model_dir), "--port", str(port), "--device", "cpu", "--served-model-name", "tiny",
            "--block-size", "8", "--kv-cache-mb", "4", "--max-num-seqs", "8", "--quiet", *flags]


def serve_args(model_dir, port: int, *flags: str):
    """`serve_argv`, parsed by the CLI's own parser."""
    from meshlm.cli import build_parser

    return build_parser().parse_args(serve_argv(model_dir, port, *flags))


@contextlib.contextmanager
def running(srv, engine):
    """A uvicorn server on a thread, from started to stopped (and its engine with it)."""
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.stop()


@contextlib.contextmanager
def launched(model_dir, port: int, *flags: str):
    """`meshlm serve` in a subprocess of its own session (it starts its own ranks with --tp/--cp); its URL
    once /health answers. On exit it is stopped as a server is stopped (and as a front stops its `--no-front`
    launch): SIGTERM to the launcher, which stops its ranks and says so in one line -- no traceback, none of
    torch's lines -- and exits 128 + 15; then the whole process group, whatever is left."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    argv = serve_argv(model_dir, port, *flags)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", *argv], env=env, stdout=subprocess.DEVNULL,
                                stderr=log, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(url, proc)
            yield url
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            log.seek(0)
            err = log.read()
            assert proc.returncode == 143 and "Traceback" not in err and "closing signal" not in err, err[-3000:]
            assert err.rstrip().splitlines()[-1] == "meshlm serve: stopped by SIGTERM; the launcher stopped every rank"
        finally:
            stop_tree(proc, 10)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, tmp_path_factory):
    """The same tests against one process and against `meshlm serve --tp 2` (two ranks, torch's launcher)."""
    from meshlm.cli.serve import build_server

    model_dir = make_model_dir(tmp_path_factory.mktemp("tiny-llama"))
    port = free_port()
    flags = ("--api-key", KEY, "--max-num-batched-tokens", "64")
    if request.param == 1:
        srv, engine = build_server(serve_args(model_dir, port, *flags))
        with running(srv, engine):
            yield f"http://127.0.0.1:{port}"
    else:
        with launched(model_dir, port, *flags, "--tp", "2") as url:
            yield url


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, headers=HEADERS, timeout=60, **kw)


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_models_and_key(server):
    assert httpx.get(server + "/health").status_code == 200
    r = httpx.get(server + "/v1/models", headers=HEADERS)
    assert r.json()["data"][0]["id"] == "tiny"
    # The key guards every endpoint but /health.
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(server + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": []},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_completion_stream_and_not(server):
    body = {"model": "tiny", "prompt": "the quick brown", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["usage"]["completion_tokens"] == 12
    text = data["choices"][0]["text"]
    assert data["choices"][0]["finish_reason"] == "length"
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, headers=HEADERS,
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # A stop string cuts the text before it, streamed or not.
    stop = text[4:7]
    assert len(stop) == 3
    r = post(server, "/v1/completions", {**body, "stop": [stop]})
    assert r.json()["choices"][0]["text"] == text[:text.index(stop)]
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stop": stop, "stream": True},
                      headers=HEADERS, timeout=60) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:text.index(stop)]
    # Token-id prompts and logprobs.
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 2,
                                         "temperature": 0, "ignore_eos": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 3 and all(len(t) == 2 for t in lp["top_logprobs"])


def test_chat_stream_and_not(server):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello world"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion"
    msg = data["choices"][0]["message"]
    assert msg["role"] == "assistant" and data["usage"]["completion_tokens"] == 8
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "stream": True}, headers=HEADERS,
                      timeout=60) as r:
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == msg["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_and_bad_input(server):
    async def main():
        async with httpx.AsyncClient(base_url=server, headers=HEADERS, timeout=60) as client:
            good = [client.post("/v1/completions", json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 16,
                                                         "temperature": 0.7, "seed": i, "ignore_eos": True})
                    for i in range(6)]
            long_prompt = "the quick brown fox " * 200
            bad = [
                client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                client.post("/v1/completions", json={"model": "nope", "prompt": "hi"}),
                client.post("/v1/completions", json={"model": "tiny"}),
                client.post("/v1/completions", json={"prompt": "hi"}),
                client.post("/v1/chat/completions", json={"model": "tiny"}),
                client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": -1}),
                client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 10**9}),
                client.post("/v1/completions", json={"model": "tiny", "prompt": long_prompt, "max_tokens": 4}),
                client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "temperature": "hot"}),
                client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "hi", "max_tokens": Infinity}',
                            headers={"content-type": "application/json"}),
                # A seed torch cannot take: must be refused up front, not fail the step of everyone.
                client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "seed": 2**64}),
                client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "temperature": 10**400}),
                client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": True,
                                                     "stream_options": "usage please"}),
            ]
            return await asyncio.gather(*good, *bad)

    responses = asyncio.run(main())
    good, bad = responses[:6], responses[6:]
    for r in good:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
    for r in bad:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
    assert bad[1].status_code == 404
    # The server still serves after all that, and its metrics saw the traffic.
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "again", "max_tokens": 2})
    assert r.status_code == 200
    metrics = httpx.get(server + "/metrics", headers=HEADERS).text
    for name in ("meshlm_requests_running", "meshlm_requests_waiting", "meshlm_kv_blocks_used",
                 "meshlm_kv_blocks_free", "meshlm_prefix_cache_hit_rate", "meshlm_generated_tokens_total",
                 "meshlm_time_to_first_token_seconds_count", "meshlm_time_per_output_token_seconds_bucket"):
        assert name in metrics
    assert "meshlm_kv_blocks_used 0" in metrics


def test_client_disconnect_frees_blocks(server):
    with httpx.stream("POST", server + "/v1/completions", headers=HEADERS, timeout=60,
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 100, "stream": True,
                            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event
    deadline = time.monotonic() + 20
    while "meshlm_requests_running 0" not in httpx.get(server + "/metrics", headers=HEADERS).text:
        assert time.monotonic() < deadline, "an abandoned request kept running"
        time.sleep(0.05)


def test_a_template_renders_as_transformers_renders_it():
    """The jinja transformers (and vLLM) renders chat templates with: tojson keeping keys in order and text as it is
    (jinja's own sorts and escapes: a review found tools written otherwise than the model was trained with),
    {% break %}, strftime_now, {% generation %}."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Raw
    from tokenizers import models

    from meshlm.tokenizer import HFTokenizer

    template = ("{% for t in tools %}{{ t | tojson }}|{{ t | tojson(indent=2) }}{% endfor %}"
                "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% if m['role'] == 'assistant' %}{% generation %}<{{ m['content'] }}>{% endgeneration %}"
                "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{{ strftime_now('%Y') }}")
    raw = Raw(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=template)
    msgs = [{"role": "user", "content": "héllo <b> & 'q'"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "dropped by the break"}]
    tools = [{"type": "function", "function": {"name": "zed", "description": "é <&>", "parameters": {"b": 1, "a": 2}}}]
    mine = HFTokenizer(raw, chat_template=template).apply_chat_template(msgs, tools, add_generation_prompt=False)
    assert mine == theirs.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert '"zed", "description": "é <&>"' in mine and "dropped" not in mine


def test_chat_templates():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from meshlm.tokenizer import HFTokenizer as Tokenizer

    raw = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert Tokenizer(raw).apply_chat_template(msgs) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = Tokenizer(raw, chat_template=template, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    assert tok.apply_chat_template(msgs) == "<s>[system]be brief</s>[user]hi</s>[assistant]"
    # a template that lists the tools gets them as the request sent them
    listing = Tokenizer(raw, chat_template="{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
                                           "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "add"}}, {"type": "function", "function": {"name": "now"}}]
    assert listing.apply_chat_template(msgs, tools) == "<add><now>be briefhi"
    assert listing.apply_chat_template(msgs) == "be briefhi"
    # a request's template variables (Qwen3's enable_thinking: off, its template closes an empty think block) and
    # an earlier reply's reasoning (Qwen3's template reads reasoning_content)
    qwen = Tokenizer(raw, chat_template="{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}"
                                        "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|end|>"
                                        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% if enable_thinking"
                                        " is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
    assert qwen.apply_chat_template(msgs[1:]) == "<|user|>hi<|end|><|assistant|>"
    assert qwen.apply_chat_template(msgs[1:], variables={"enable_thinking": False}) == \
        "<|user|>hi<|end|><|assistant|><think></think>"
    from meshlm.infer.requests import chat_messages

    said = chat_messages({"messages": [*msgs[1:], {"role": "assistant", "content": "yo", "reasoning": "greet"}]})
    assert qwen.apply_chat_template(said, add_generation_prompt=False) == \
        "<|user|>hi<|end|><|assistant|><think>greet</think>yo<|end|>"
    # what the template writes of the reply (the generation prompt, or the continued message): where a reasoning
    # parser looks for an open <think>, never in the messages' own text
    assert qwen.reply_opening(msgs[1:]) == "<|assistant|>"
    assert qwen.reply_opening(msgs[1:], variables={"enable_thinking": False}) == "<|assistant|><think></think>"
    asks = [{"role": "user", "content": "what is <think>?"}]
    assert qwen.reply_opening(asks) == "<|assistant|>" and "<think>" in qwen.apply_chat_template(asks)
    assert qwen.reply_opening(said, add_generation_prompt=False, continue_final_message=True) == "yo"
    assert qwen.reply_opening(said, add_generation_prompt=False) == ""
    # continue_final_message: the prompt ends inside the last (assistant's) message, where the reply goes on
    assert qwen.apply_chat_template(said, add_generation_prompt=False, continue_final_message=True) == \
        "<|user|>hi<|end|><|assistant|><think>greet</think>yo"
    # ... where the message ends, not where its text last appears (a review: a prefill "im" ended inside the
    # template's own <|im_end|>)
    chatml = Tokenizer(raw, chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                                          "<|im_end|>\n{% endfor %}")
    assert chatml.apply_chat_template([*msgs[1:], {"role": "assistant", "content": "im"}],
                                      add_generation_prompt=False, continue_final_message=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nim"
    assert listing.apply_chat_template([{"role": "assistant", "content": ""}], continue_final_message=True) == ""
    silent = Tokenizer(raw, chat_template="{% for m in messages %}[{{ m.role }}]{% endfor %}")
    with pytest.raises(ValueError, match="does not write the last message's content") as e:
        silent.apply_chat_template([{"role": "assistant", "content": "x"}], continue_final_message=True)
    assert e.value.field == "continue_final_message"


def test_chat_template_errors_are_4xx():
    from types import SimpleNamespace

    from meshlm.infer.requests import chat_messages

    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from meshlm.infer.server import create_app
    from meshlm.tokenizer import HFTokenizer as Tokenizer

    raw = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok = Tokenizer(raw, chat_template="{{ raise_exception('Conversation roles must alternate') }}")
    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok, max_model_len=16))  # never reached
    client = TestClient(create_app(engine, model_name="tiny"))
    for template_bug in (False, True):
        if template_bug:  # a template that is broken itself, not one that refuses the messages
            tok.chat_template, tok._template = "{{ messages[0].content | no_such_filter }}", None
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    # A template that iterates a call's arguments (as Qwen3-Coder's does): the API's JSON text reaches it as the
    # object it encodes; a value it still cannot iterate is a 400, not a 500 (found by a fuzz pass)
    tok.chat_template, tok._template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                                        "{% for k, v in c.function.arguments | items %}{{ k }}={{ v }};{% endfor %}"
                                        "{% endfor %}{% endfor %}"), None
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert tok.apply_chat_template(chat_messages({"messages": [
        {"role": "assistant", "content": None, "tool_calls": calls}]})) == "x=1;"
    calls[0]["function"]["arguments"] = "[1]"
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "assistant", "content": None, "tool_calls": calls}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    # text that is not valid Unicode inside a call is refused as the messages' own is
    calls[0]["function"]["name"] = "\ud800"  # sent as JSON's escape, which json.loads turns into a lone surrogate
    r = client.post("/v1/chat/completions", headers={"content-type": "application/json"}, content=json.dumps(
        {"model": "tiny", "messages": [{"role": "assistant", "content": None, "tool_calls": calls}]}))
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text


def _keyed_client(api_key=KEY):
    """A TestClient of an app with `api_key` over an engine that no request here reaches."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from meshlm.infer.server import create_app

    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=None, max_model_len=16), broken=None)
    return TestClient(create_app(engine, model_name="tiny", api_key=api_key))


def test_the_api_schema_needs_the_key_and_there_are_no_docs_pages():
    client = _keyed_client()
    r = client.get("/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    schema = client.get("/openapi.json", headers=HEADERS).json()
    assert "/v1/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):  # not served, with the key or without
        assert client.get(path).status_code == 404 and client.get(path, headers=HEADERS).status_code == 404, path
    assert _keyed_client(None).get("/openapi.json").status_code == 200  # no key set: open, as before


def test_the_bearer_scheme_is_case_insensitive_and_malformed_headers_are_401(monkeypatch):
    import hmac

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    client = _keyed_client()
    for auth in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR   {KEY}"):
        assert client.get("/v1/models", headers={"Authorization": auth}).status_code == 200, auth
    assert compared and all(b == KEY.encode() for _, b in compared)  # constant time, never `!=`
    for auth in ("", "Bearer", "Bearer ", f"Basic {KEY}", KEY, f"Bearer{KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}",
                 f"Bearer {KEY} {KEY}", "Bearer wrong", f"Token {KEY}", "bearer\t" + KEY):
        r = client.get("/v1/models", headers={"Authorization": auth})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (auth, r.text)
    for raw in (b"Bearer \xff\xfe\x80", b"\xc3\xa9 " + KEY.encode(), b"Bearer " + b"\xff" * 5000):
        r = client.post("/v1/completions", headers={"Authorization": raw}, json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401, (raw, r.text)
    # A key outside ASCII: the client sends its UTF-8 bytes.
    client = _keyed_client("cl\u00e9-\u00fc")
    ok = client.get("/v1/models", headers={"Authorization": "Bearer cl\u00e9-\u00fc".encode()})
    assert ok.status_code == 200, ok.text
    assert client.get("/v1/models", headers={"Authorization": "Bearer cle-u"}).status_code == 401


def test_api_key_file(tmp_path, capsys):
    from meshlm.cli import main
    from meshlm.cli.serve import build_llm, build_server

    missing, empty, key_file = tmp_path / "missing.key", tmp_path / "empty.key", tmp_path / "api.key"
    empty.write_text("\n  \nsecond\n")
    key_file.write_text("  s3cret-from-a-file \nnot this line\n")
    model = str(tmp_path)
    for flags, expected in ((["--api-key-file", str(missing)], f"'{missing}': no such file"),
                            (["--api-key-file", str(empty)], f"'{empty}': its first line is empty"),
                            (["--api-key-file", str(key_file), "--api-key", "k"], "not both"),
                            (["--api-key", " "], "--api-key is empty")):
        assert main(["serve", "--model", model, *flags]) == 2  # refused before any model is read
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (flags, err)
    (tmp_path / "tiny").mkdir()
    model_dir = make_model_dir(tmp_path / "tiny")
    args = serve_args(model_dir, free_port(), "--api-key-file", str(key_file), "--host", "0.0.0.0")
    llm = build_llm(args)
    srv, engine = build_server(args, llm)
    try:
        from fastapi.testclient import TestClient

        client = TestClient(srv.config.app)
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret-from-a-file"}).status_code == 200
        assert client.get("/v1/models").status_code == 401
        assert srv.meshlm_warning is None  # a key: binding every address is fine
    finally:
        engine.stop()
    srv, engine = build_server(serve_args(model_dir, free_port(), "--host", "0.0.0.0"), llm)
    engine.stop()
    assert srv.meshlm_warning.startswith("meshlm serve: warning: listening on 0.0.0.0") and "\n" not in srv.meshlm_warning


def test_binding_beyond_loopback_without_a_key_warns():
    from meshlm.infer.auth import exposure_warning

    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert exposure_warning(host, None) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com", ""):
        assert "without an API key" in exposure_warning(host, None), host
        assert exposure_warning(host, "k") is None
