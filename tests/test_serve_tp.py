"""Serving on several ranks -- tensor parallel (`LLM(..., tp=2)`), KV split over ranks (`cp=2`) and both
(tp=2 x cp=2), and `meshlm generate --tp 2 / --cp 2` -- gives the single-process engine's greedy tokens,
for tiny random Llama, Qwen2, Mixtral and Qwen2-MoE checkpoints, with continuous batching, chunked
prefill, prefix-cache hits and forced preemption in the same run. Under tp each rank's cache holds half
the kv heads and each rank holds half the experts of every MoE layer; under cp each holds every other
block of each sequence, and a sequence longer than one rank's whole cache is served. Under cp a prefill
moves exactly the ring's keys/values (no all-gather), 36 sequences at once (decodes in two length
buckets, mixed with prefill chunks) give one process's tokens too, and the cp attention context alone
equals dense causal attention on a mixed step."""

import random
import time

import pytest
import torch

from dist import run_distributed
from meshlm import LLM, SamplingParams
from meshlm.cli import main as cli_main
from meshlm.models.moe import MoE

transformers = pytest.importorskip("transformers")
from test_engine import tiny_hf  # noqa: E402 -- after the importorskip

KINDS = ["llama", "qwen2", "mixtral", "qwen2_moe"]
MOE_KINDS = ("mixtral", "qwen2_moe")
MAX_NEW = 8
# chunked prefill (16 tokens a step), a KV budget so small that sequences are preempted, prefix caching on
ENGINE = dict(block_size=4, num_blocks=14, max_num_seqs=6, max_num_batched_tokens=16, dtype=torch.float64)


LONG_PROMPT = [(7 * i) % 90 + 2 for i in range(30)]  # + 12 new tokens = 42 tokens = 11 blocks of 4
RING_PROMPT = [(5 * i) % 89 + 3 for i in range(14)]  # 14 tokens: blocks of 4, 4, 4 and 2 tokens
MANY_PROMPTS = [[(11 * i + 3 * j) % 89 + 2 for j in range(1 + (7 * i) % 23)] for i in range(36)]
MANY_ENGINE = dict(block_size=4, num_blocks=256, max_num_seqs=40, max_num_batched_tokens=128, dtype=torch.float64)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    prefix = [rng.randrange(2, 90) for _ in range(13)]
    return [([] if i % 2 else prefix) + [rng.randrange(2, 90) for _ in range(n)]
            for i, n in enumerate((3, 17, 1, 22, 8, 12, 5))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for kind in KINDS:
        torch.manual_seed(0)
        paths[kind] = tmp_path_factory.mktemp(kind)
        tiny_hf(kind).save_pretrained(paths[kind])
    return paths


def _generate(llm: LLM) -> tuple[list[list[int]], dict]:
    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [o.token_ids for o in outs], llm.engine.stats()


LAYOUTS = {"tp2": (2, 1), "cp2": (1, 2), "tp2_cp2": (2, 2)}  # name: (tp, cp)


def _cp_attention_error(rank, world_size):
    """`ContextParallelAttention` at cp=world_size on one step with a prefill chunk after a cached prefix, a
    prefill from scratch and decodes (the ring in tiles of 2 query rows, split-KV) against attention over
    each sequence's keys up to the token's position: (max error of this rank's tokens, how many it owns)."""
    from meshlm.infer.llm import serving_mesh
    from meshlm.infer.attention import new_kv_cache, write_kv
    from meshlm.infer.model_runner import StepInput
    from meshlm.infer.parallel import ContextParallelAttention

    cp, bs, kv, groups, dim = world_size, 4, 2, 2, 8
    mesh = serving_mesh(1, "cpu", cp=cp)
    g = torch.Generator().manual_seed(0)  # the same data on every rank
    # (cached tokens, new tokens): a prefill chunk after a cached prefix, decodes, a prefill from scratch
    seqs = [(7, 9), (9, 1), (0, 13), (0, 1), (5, 1)]
    K = [torch.randn(kv, c + n, dim, generator=g, dtype=torch.float64) for c, n in seqs]
    V = [torch.randn(kv, c + n, dim, generator=g, dtype=torch.float64) for c, n in seqs]
    Q = [torch.randn(kv * groups, n, dim, generator=g, dtype=torch.float64) for _, n in seqs]
    k_cache, v_cache = new_kv_cache(kv, 16, bs, dim, dtype=torch.float64)
    step, handed = StepInput([], [], [], [], [], [], []), [0] * cp
    for s, (cached, n) in enumerate(seqs):
        table = []
        for j in range(-(-(cached + n) // bs)):  # block j from rank j % cp (global id: local * cp + rank)
            table.append(handed[j % cp] * cp + j % cp)
            handed[j % cp] += 1
        for pos in range(cached + n):
            b = table[pos // bs]
            if pos >= cached:
                step.token_ids.append(0)
                step.positions.append(pos)
                step.slot_mapping.append(b * bs + pos % bs)
            elif b % cp == rank:  # this rank's blocks hold their cached keys; attend writes the new ones
                write_kv(k_cache, v_cache, torch.tensor([b // cp * bs + pos % bs]), K[s][:, pos:pos + 1],
                         V[s][:, pos:pos + 1])
        step.query_lens.append(n)
        step.context_lens.append(cached + n)
        step.block_tables.append(table)
    ctx = ContextParallelAttention([k_cache], [v_cache], step, bs, dtype=torch.float64, mesh=mesh,
                                   tile_rows=2)
    q, k, v = (torch.cat(x, dim=1)[None] for x in (Q, [K[s][:, c:] for s, (c, _) in enumerate(seqs)],
                                                     [V[s][:, c:] for s, (c, _) in enumerate(seqs)]))
    rows = ctx.local_rows
    out = ctx.attend(0, q[:, :, rows], k[:, :, rows], v[:, :, rows])[0]
    want = []  # every new token's query over its sequence's keys up to its position
    for s, (cached, n) in enumerate(seqs):
        for i in range(n):
            keys = K[s][:, :cached + i + 1].repeat_interleave(groups, 0)
            values = V[s][:, :cached + i + 1].repeat_interleave(groups, 0)
            weights = torch.softmax(Q[s][:, i:i + 1] @ keys.transpose(-1, -2) / dim ** 0.5, dim=-1)
            want.append((weights @ values)[:, 0])
    return (out - torch.stack(want, dim=1)[:, rows]).abs().max().item(), rows.numel()


def _parallel_ranks(rank, world_size, paths, layouts):
    out = {"dense": _cp_attention_error(rank, world_size)}
    for name, (tp, cp) in layouts.items():
        for kind, path in paths.items():
            if tp * cp != world_size:
                continue
            # cp: each rank gets half the blocks, so the block manager sees the single process's number
            llm = LLM(path, tp=tp, cp=cp, device="cpu", **{**ENGINE, "num_blocks": ENGINE["num_blocks"] // cp})
            if not llm.is_driver:
                assert llm.engine is None
                continue
            out[name, kind] = _generate(llm)
            out[name, kind, "kv_heads"] = llm.engine.runner.runner.k_caches[0].shape[0]
            out[name, kind, "blocks_per_rank"] = llm.engine.runner.runner.num_blocks
            out[name, kind, "experts"] = [m.experts.w_gate.shape[0] for m in llm.model.modules() if isinstance(m, MoE)]
            out[name, kind, "ep_bytes"] = llm.engine.runner.mesh.stats.total(axis="ep").bytes
            llm.close()
    # one sequence longer than a rank's whole cache (11 blocks of 4 tokens): 6 blocks a rank at cp=2, 3 at cp=4
    llm = LLM(paths["llama"], cp=world_size, device="cpu", block_size=4, num_blocks=12 // world_size,
              dtype=torch.float64)
    if llm.is_driver:
        out["long"] = llm.generate([LONG_PROMPT], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
        # one prefill step alone (one token sampled): what the cp axis moved for it, on rank 0
        stats = llm.engine.runner.mesh.stats
        stats.reset()
        out["ring"] = llm.generate([RING_PROMPT], SamplingParams(temperature=0.0, max_tokens=1))[0].token_ids
        out["ring_bytes"] = {op: stats.total(op=op, axis="cp").bytes for op in ("send", "recv", "all_gather")}
        llm.close()
    # every prompt position's logits (a completion's echo with logprobs), over tp (and cp at world 4)
    llm = LLM(paths["llama"], tp=2, cp=world_size // 2, device="cpu", block_size=4, num_blocks=32 // (world_size // 2),
              dtype=torch.float64)
    if llm.is_driver:
        out["prompt_logprobs"] = llm.generate([LONG_PROMPT], SamplingParams(temperature=0.0, max_tokens=1,
                                                                            prompt_logprobs=2))[0].prompt_logprobs
        llm.close()
    # 36 sequences at once: decodes in two length buckets, alongside prefill chunks in the same steps
    llm = LLM(paths["qwen2"], cp=world_size, device="cpu", **{**MANY_ENGINE, "num_blocks": 256 // world_size})
    if llm.is_driver:
        out["many"] = [o.token_ids for o in llm.generate(MANY_PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))]
        llm.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_greedy_tokens_equal_one_process(checkpoints, world):
    single = {kind: _generate(LLM(path, device="cpu", **ENGINE)) for kind, path in checkpoints.items()}
    layouts = {n: tc for n, tc in LAYOUTS.items() if tc[0] * tc[1] == world}
    results = run_distributed(_parallel_ranks, world, {k: str(v) for k, v in checkpoints.items()}, layouts,
                              timeout=240)
    assert all(set(r) == {"dense"} for r in results[1:])
    # every token of the step computed once, by its owner, as dense causal attention computes it
    assert sum(r["dense"][1] for r in results) == 9 + 1 + 13 + 1 + 1 and all(r["dense"][1] for r in results)
    assert max(r["dense"][0] for r in results) < 1e-12, [r["dense"] for r in results]
    for name, (tp, cp) in layouts.items():
        for kind in KINDS:
            tokens, stats = results[0][name, kind]
            assert tokens == single[kind][0], (name, kind)
            assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, (name, kind, stats)
            assert stats["kv_blocks_total"] == ENGINE["num_blocks"]  # all cp ranks together
            assert results[0][name, kind, "kv_heads"] == 2 // tp  # 2 kv heads over tp
            assert results[0][name, kind, "blocks_per_rank"] == ENGINE["num_blocks"] // cp
            if kind in MOE_KINDS:  # 4 experts, split over the tp ranks (whole on every cp rank)
                experts = results[0][name, kind, "experts"]
                assert experts and set(experts) == {4 // tp}, (name, kind, experts)
                assert (results[0][name, kind, "ep_bytes"] > 0) == (tp > 1), (name, kind)
    alone = LLM(checkpoints["llama"], device="cpu", block_size=4, num_blocks=32, dtype=torch.float64)
    want = alone.generate([LONG_PROMPT], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
    assert results[0]["long"] == want and len(want) == 12
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    assert results[0]["ring"] == alone.generate([RING_PROMPT], greedy)[0].token_ids
    scored = alone.generate([LONG_PROMPT], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    got = results[0]["prompt_logprobs"]
    assert got[0] is None and scored.prompt_logprobs[0] is None and len(got) == len(LONG_PROMPT)
    for mine, theirs in zip(got[1:], scored.prompt_logprobs[1:]):
        assert mine["token"] == theirs["token"] and list(mine["top"]) == list(theirs["top"])
        assert abs(mine["logprob"] - theirs["logprob"]) < 1e-9, (mine, theirs)
    many = LLM(checkpoints["qwen2"], device="cpu", **MANY_ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    assert results[0]["many"] == [o.token_ids for o in many.generate(MANY_PROMPTS, greedy)]
    # The prefill's keys/values go round the cp ring: block j lives on rank j % cp, so rank r holds the keys of
    # its blocks; over cp - 1 hops rank 0 sends its own, then those of ranks cp-1, cp-2, ..., 2, and receives
    # those of ranks cp-1, ..., 1. Per key: K and V of 2 kv heads x head_dim 16 in float64, in each of 2 layers.
    # No query or partial is all-gathered (that is the decodes' split-KV).
    keys = [sum(min(4, len(RING_PROMPT) - 4 * j) for j in range(4) if j % world == r) for r in range(world)]
    per_key = 2 * 2 * 16 * 8 * 2
    assert results[0]["ring_bytes"] == {"send": per_key * sum(keys[-s % world] for s in range(world - 1)),
                                        "recv": per_key * sum(keys[-(s + 1) % world] for s in range(world - 1)),
                                        "all_gather": 0}, (keys, results[0]["ring_bytes"])
    with pytest.raises(ValueError, match="KV blocks"):  # what one rank's cache alone refuses
        LLM(checkpoints["llama"], device="cpu", block_size=4, num_blocks=12 // world).generate(
            [LONG_PROMPT], SamplingParams(max_tokens=12))


def test_experts_must_split_evenly_over_tp():
    from meshlm.config import ModelConfig
    from meshlm.infer.parallel import shard_for_serving
    from meshlm.mesh import Mesh, ParallelDims
    from meshlm.models import build_model

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      num_experts=3)
    mesh = Mesh(ParallelDims(tp=2, dp_shard=1), device_type="cpu", rank=0)  # checked before any group is used
    with pytest.raises(ValueError, match=r"num_experts=3 is not divisible by tp=2.*choose tp in \{1,3\}"):
        shard_for_serving(build_model(cfg, seed=0), mesh)


def test_tp_needs_its_ranks():
    with pytest.raises(ValueError, match="start 2 ranks"):
        LLM(torch.nn.Linear(1, 1), tp=2)


def test_generate_tp2_from_the_cli(tmp_path, capfd):
    pytest.importorskip("tokenizers")
    from tiny_hf import make_model_dir

    path = str(make_model_dir(tmp_path))
    argv = ["generate", "--hf", path, "--prompt", "hello world", "--max-new-tokens", "6"]
    capfd.readouterr()  # what building the model printed
    assert cli_main(argv) == 0
    one = capfd.readouterr().out
    assert cli_main([*argv, "--tp", "2"]) == 0  # two ranks through torch's launcher (--cp: the serve test)
    two = capfd.readouterr().out
    assert one.startswith("hello world") and len(one) > len("hello world\n") and two == one, (one, two)


def test_a_lost_rank_makes_the_server_unhealthy_and_requests_503(tmp_path):
    """What rank 0 sees when another rank dies: a step raises CollectiveError. Every request in flight and
    every later one gets 503 (none hangs), /health says unhealthy; one process standing in for the ranks."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from tiny_hf import make_model_dir

    from meshlm.comm import CollectiveError
    from meshlm.infer.server import AsyncEngine, create_app

    llm = LLM(str(make_model_dir(tmp_path)), device="cpu", block_size=8)
    steps = {"n": 0}
    real_step = llm.engine.step

    def step():
        steps["n"] += 1
        if steps["n"] > 2:
            raise CollectiveError("rank 0: all_gather on mesh axis 'tp' (global ranks [0, 1]) failed: "
                                  "Connection closed by peer")
        return real_step()

    llm.engine.step = step
    engine = AsyncEngine(llm.engine)
    try:
        client = TestClient(create_app(engine, model_name="tiny"))
        assert client.get("/health").status_code == 200
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 20, "temperature": 0}
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 503 and "Connection closed by peer" in first.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert client.post("/v1/completions", json=body).status_code == 503  # refused at once, not queued
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 503
    finally:
        engine.stop()


IDLE_TIMEOUT_S, IDLE_S = 6, 12  # the collective timeout (6x the keepalive's period), an idle time twice it (issue 30)


def test_serve_cp2_idle_past_its_timeout_answers_reports_per_rank_and_a_killed_rank_gives_503(tmp_path):
    """`meshlm serve --cp 2 --collective-timeout 6` (ranks through torch's launcher, gloo): a greedy completion
    equals one process's, /metrics has the KV blocks of each cp rank and the bytes the cp axis moved, the banner
    the capacity. Idle for 12 s, it still answers the same (the worker rank waits for rank 0's next step inside a
    collective, which the keepalive renews while idle). Then rank 1 is SIGKILLed: the next request gets 503 at
    once (rank 0's collective fails on the closed connection), /health says unhealthy, and the launcher stops the
    server and names the rank that died."""
    import os
    import signal

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import make_model_dir, rank_pid, serve_argv, server_process

    from meshlm.processes import free_port

    model_dir = make_model_dir(tmp_path)
    want = LLM(str(model_dir), device="cpu", block_size=8).generate(
        ["hello world"], SamplingParams(temperature=0.0, max_tokens=6))[0].text
    port = free_port()
    argv = [a for a in serve_argv(model_dir, port, "--cp", "2", "--collective-timeout", str(IDLE_TIMEOUT_S))
            if a != "--quiet"]
    with server_process(argv, port) as (proc, url):
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 6, "temperature": 0}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want, got.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        value = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line[:1] not in "#"}
        per_rank = [value[f'meshlm_kv_blocks_used_per_rank{{cp_rank="{r}"}}']
                    + value[f'meshlm_kv_blocks_free_per_rank{{cp_rank="{r}"}}'] for r in range(2)]
        assert per_rank == [value["meshlm_kv_blocks_used"] / 2 + value["meshlm_kv_blocks_free"] / 2] * 2, per_rank
        comm = [line for line in metrics.splitlines() if line.startswith('meshlm_comm_bytes_total{axis="cp"}')]
        assert comm and float(comm[0].split()[-1]) > 0
        time.sleep(IDLE_S)
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == want, again.text
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 503, r.text
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        except httpx.TransportError:
            pass  # the launcher already stopped the server: a refused connection, not a hang
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "rank 1 failed first (killed by SIGKILL)" in out, out[-2000:]
        assert "KV cache of" in out and "over 2 ranks" in out, out[-2000:]
