"""Disaggregated prefill and decode (`infer/disaggregated.py`, `meshlm serve --prefill/--decode`).

In two launched worlds (3 ranks: prefill tp2 -> decode tp1, then prefill tp1 -> decode cp2; 6 ranks: prefill tp2
-> decode tp2 x cp2), dense and MoE, with chunked prefill and a decode cache small enough to preempt: greedy tokens
equal one engine's. The KV bytes on the "kv" axis (summed over the prefill ranks' sends, and over the decode ranks'
receives) equal 2 x layers x kv_heads x head_dim x transferred tokens x 8 (float64), computed from the config:
for one request alone its whole prompt, and for a second request sharing two blocks with it only the rest (the
decode side's prefix cache holds the two). The request alone asks for its prompt's logprobs and its tokens': they
equal one engine's within 1e-9. The traffic of a run replays clean under NCCL's ordering rules. A bad
layout is refused with one line before any rank starts, and a `meshlm serve` whose decode instance is SIGKILLed
mid-stream ends that stream with an error naming the decode instance while its front keeps answering (503)."""

import os
import random
import signal
import time

import pytest
import torch

from dist import run_distributed
from meshlm import LLM, SamplingParams
from meshlm.cli import main as cli_main
from meshlm.comm_stats import CommStats
from meshlm.config import ModelConfig
from meshlm.nccl_order import replay

CONFIG = dict(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
              max_seq_len=128)
# what one token's KV weighs on the "kv" axis: K and V x layers x kv heads x head_dim x float64
KV_BYTES_PER_TOKEN = 2 * CONFIG["num_layers"] * CONFIG["num_kv_heads"] * (CONFIG["hidden_size"] // CONFIG["num_heads"]) * 8
MAX_NEW = 8
SCORED = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, prompt_logprobs=2)
BLOCK = 4
# chunked prefill (16 tokens a step) on the prefill side; a decode cache of 14 blocks in all: decodes are preempted
PREFILL = dict(num_blocks=32, max_num_batched_tokens=16)
DECODE_BLOCKS = 10
REFERENCE = dict(block_size=BLOCK, num_blocks=14, max_num_batched_tokens=8, dtype=torch.float64)
A = [(5 * i) % 89 + 3 for i in range(13)]  # 13 tokens: blocks of 4, 4, 4 and 1
B = A[:8] + [7, 11, 13]  # its first two blocks are A's


def _model(kind: str):
    from meshlm.models.transformer import build_model

    cfg = ModelConfig(**CONFIG, **({"num_experts": 4} if kind == "moe" else {}))
    return build_model(cfg, seed=0, dtype=torch.float64)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    prefix = [rng.randrange(2, 90) for _ in range(13)]
    return [([] if i % 2 else prefix) + [rng.randrange(2, 90) for _ in range(n)]
            for i, n in enumerate((3, 17, 1, 22, 8, 12, 5))]


def _kv_bytes(stats: CommStats) -> dict:
    return {op: stats.total(op=op, axis="kv").bytes for op in ("send", "recv")}


def _engine(kind, prefill, decode, stats, **decode_options):
    from meshlm.infer.disaggregated import disaggregated_engine
    from meshlm.infer.instances import InstanceLayout

    return disaggregated_engine(_model(kind), InstanceLayout(*prefill), InstanceLayout(*decode), device="cpu",
                                dtype=torch.float64, comm_stats=stats, block_size=BLOCK, prefill_options=PREFILL,
                                decode_options=decode_options)


def _cases(rank, world_size, cases, *, exact: bool):
    """Each (prefill, decode) layout of `cases`, dense and MoE: the mixed run's tokens, stats and every rank's KV
    bytes; with `exact`, a request alone, then two sharing a prefix (their counts and bytes); the dense mixed run's
    NCCL trace."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    out = {}
    for name, (prefill, decode) in cases.items():
        for kind in ("dense", "moe"):
            stats = CommStats(keep_trace=kind == "dense")
            engine = _engine(kind, prefill, decode, stats, num_blocks=DECODE_BLOCKS // decode[1])
            if engine is not None:
                out[name, kind] = [o.token_ids for o in engine.generate(_prompts(), greedy)], engine.stats()
                engine.close()
            out[name, kind, "bytes"] = _kv_bytes(stats)
            if kind == "dense":
                out[name, "trace"] = list(stats.trace)
        if not exact:
            continue
        for phase, requests in (("alone", [A]), ("shared", [A, B])):
            stats = CommStats()
            engine = _engine("dense", prefill, decode, stats, num_blocks=32)
            if engine is not None:
                counts = []
                for prompt in requests:  # one after the other: B finds A's blocks in the decode side's cache
                    # alone, A asks for its prompt's logprobs too (computed by the prefill side, answered by decode's)
                    got = engine.generate([prompt], SCORED if phase == "alone" else greedy)[0]
                    counts.append(engine.stats()["kv_transferred_tokens"])
                    if phase == "alone":
                        out[name, "scored"] = got.token_ids, got.logprobs, got.prompt_logprobs
                out[name, phase] = counts
                engine.close()
            out[name, phase, "bytes"] = _kv_bytes(stats)
    return out


def _logprob_entries_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert g["token"] == w["token"] and list(g["top"]) == list(w["top"])
            assert abs(g["logprob"] - w["logprob"]) < 1e-9
            assert all(abs(g["top"][t] - w["top"][t]) < 1e-9 for t in w["top"])


def _check(results, cases, world_size):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    for kind in ("dense", "moe"):
        want = [o.token_ids for o in LLM(_model(kind), device="cpu", **REFERENCE).generate(_prompts(), greedy)]
        for name, (prefill, _) in cases.items():
            tokens, stats = results[0][name, kind]
            assert tokens == want, (name, kind)
            assert stats["decode"]["num_preemptions"] > 0, (name, kind, stats["decode"])  # decodes were preempted
            # steps of 16 tokens at most: the 22-token prompt went in two chunks; the shared prefix hit both caches
            assert max(map(len, _prompts())) > PREFILL["max_num_batched_tokens"]
            assert stats["prefill"]["prefix_cache_hit_tokens"] > 0 and stats["decode"]["prefix_cache_hit_tokens"] > 0
            sent = sum(results[r][name, kind, "bytes"]["send"] for r in range(prefill[0] * prefill[1]))
            received = sum(results[r][name, kind, "bytes"]["recv"] for r in range(prefill[0] * prefill[1], world_size))
            assert sent == received == KV_BYTES_PER_TOKEN * stats["kv_transferred_tokens"] > 0, (name, kind)
            assert stats["kv_transferred_bytes"] == sent  # what /metrics reports: every prefill rank's, from rank 0
            # never more sent than handed off (tokens the decode side's prefix cache held stay home)
            assert stats["kv_handed_off_tokens"] >= stats["kv_transferred_tokens"]
        for name in cases:
            traces = {rank: results[rank][name, "trace"] for rank in range(world_size)}
            assert any(op.axis == "kv" for op in traces[0] if hasattr(op, "axis")), name
            assert replay(traces) == [], name


def _sent(results, name, phase, cases):
    prefill = cases[name][0]
    return sum(results[r][name, phase, "bytes"]["send"] for r in range(prefill[0] * prefill[1]))


THREE = {"tp2_to_tp1": ((2, 1), (1, 1)), "tp1_to_cp2": ((1, 1), (1, 2))}  # name: ((tp, cp) prefill, decode)
SIX = {"tp2_to_tp2cp2": ((2, 1), (2, 2))}


def test_disaggregated_tokens_equal_one_engine_and_kv_bytes_are_exact():
    results = run_distributed(_cases, 3, THREE, exact=True, timeout=240)
    _check(results, THREE, 3)
    want = LLM(_model("dense"), device="cpu", **REFERENCE).generate([A], SCORED)[0]
    for name in THREE:
        tokens, logprobs, prompt_logprobs = results[0][name, "scored"]
        assert tokens == want.token_ids, name
        _logprob_entries_close(logprobs, want.logprobs)
        _logprob_entries_close(prompt_logprobs, want.prompt_logprobs)
        assert prompt_logprobs[0] is None and all(e is not None for e in prompt_logprobs[1:])
        # A alone: its whole prompt crosses; then B: only its tokens past the two blocks the decode side holds
        assert results[0][name, "alone"] == [len(A)]
        assert results[0][name, "shared"] == [len(A), len(A) + len(B) - 2 * BLOCK]
        assert _sent(results, name, "alone", THREE) == KV_BYTES_PER_TOKEN * len(A)
        assert _sent(results, name, "shared", THREE) == KV_BYTES_PER_TOKEN * (len(A) + len(B) - 2 * BLOCK)


def test_prefill_tp2_to_decode_tp2_cp2_tokens_equal_one_engine():
    results = run_distributed(_cases, 6, SIX, exact=False, timeout=240)
    _check(results, SIX, 6)


@pytest.mark.parametrize("spec, message", [
    (["--prefill", "tp=4", "--decode", "tp=1"], "--prefill tp=4,cp=1: model.num_kv_heads=2 is not divisible by tp=4"),
    (["--prefill", "tp=1", "--decode", "tp=1,pp=2"], "--decode 'tp=1,pp=2': unknown key 'pp'"),
    (["--prefill", "tp=1", "--decode", "cp=two"], "'cp=two' needs a whole number >= 1"),
    (["--prefill", "tp=1"], "--prefill and --decode go together"),
])
def test_a_bad_layout_is_refused_before_any_rank_starts(tmp_path, capfd, spec, message):
    import json

    from meshlm.hf_config import hf_config_of

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    # 8 heads: tp=4 divides them, not the 2 kv heads; a config alone, the check reads nothing else
    config = hf_config_of(ModelConfig(**{**CONFIG, "num_heads": 8}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli_main(["serve", "--model", str(tmp_path), "--device", "cpu", *spec]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_sigkill_of_the_decode_instance_mid_stream_ends_the_request_naming_it_and_the_front_answers(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import make_model_dir, rank_pid, serve_argv, server_process

    from meshlm.processes import free_port

    port = free_port()
    argv = serve_argv(make_model_dir(tmp_path), port, "--prefill", "tp=1", "--decode", "tp=1")
    with server_process(argv, port) as (proc, url):
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in filter(None, r.iter_lines()):
                events.append(line)
                if len(events) == 3:  # the decode instance (rank 1 of the launch) is streaming: kill it
                    os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
        assert events[-1] == "data: [DONE]" and "decode instance (tp=1,cp=1, ranks 1-1) failed" in events[-2], events[-3:]
        assert 3 < len(events) < 100
        again = httpx.post(url + "/v1/completions", json=body, timeout=30)  # refused clearly, at once
        assert again.status_code == 503 and again.json()["error"]["message"], again.text
        for _ in range(100):  # the front asks its server's /health once a second
            health = httpx.get(url + "/health", timeout=10)
            if health.json()["status"] != "ok":
                break
            time.sleep(0.1)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy", health.text
        assert proc.poll() is None  # the front still runs

