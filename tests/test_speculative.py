"""Speculative decoding in the engine: exact, counted, refused where it cannot run.

- Greedy tokens equal plain decoding's for tiny random Llama, Qwen2 and Mixtral checkpoints, with n-gram lookup
  and with a draft model, on one process and at tp2, cp2 and tp2 x cp2, with chunked prefill, prefix-cache hits
  and forced preemption in the same run (float64).
- Sampling: on a vocabulary of 8, the empirical distribution of the 2nd and 3rd emitted tokens matches the target's
  exact one (chi-square at a fixed seed), with n-gram proposals and with a draft model; the same test fails a
  deliberately wrong acceptance rule (resampling from p without removing the rejected token; always accepting).
- Counted: target forwards per emitted token, and collectives per emitted token per mesh axis, with and
  without speculation.
- Bad input: K < 1, K beyond the context, a draft with another vocabulary or tokenizer: one line each, before
  serving starts; per request, a 400.
"""

import dataclasses
import random

import pytest
import torch

from dist import run_distributed
from meshlm import LLM, SamplingParams
from meshlm.config import ModelConfig
from meshlm.infer import sampling
from meshlm.infer.engine import Engine
from meshlm.models import build_model
from meshlm.models.generation import sampling_probs

transformers = pytest.importorskip("transformers")
from test_engine import tiny_hf  # noqa: E402 -- after the importorskip

KINDS = ["llama", "qwen2", "mixtral"]
MAX_NEW = 12
# chunked prefill (16 tokens a step), a KV budget so small that sequences are preempted, prefix caching on
ENGINE = dict(block_size=4, num_blocks=14, max_num_seqs=6, max_num_batched_tokens=16, dtype=torch.float64)
NGRAM = dict(method="ngram", num_speculative_tokens=3, ngram=(1, 3))
LAYOUTS = {"tp2": (2, 1), "cp2": (1, 2), "tp2_cp2": (2, 2)}  # name: (tp, cp)
# Under each layout, both methods and a dense and an MoE model; over tp2 and cp2 together, every kind with both
COMBOS = {"tp2": [("llama", "ngram"), ("qwen2", "draft"), ("mixtral", "ngram")],
          "cp2": [("llama", "draft"), ("qwen2", "ngram"), ("mixtral", "draft")],
          "tp2_cp2": [("llama", "draft"), ("mixtral", "ngram")]}


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (n-gram lookup finds continuations), half of them after a shared prefix."""
    rng = random.Random(3)
    prefix = [rng.randrange(2, 90) for _ in range(9)]
    out = []
    for i, n in enumerate((3, 6, 1, 7, 4, 5, 2)):
        motif = [rng.randrange(2, 90) for _ in range(n)]
        out.append(([] if i % 2 else prefix) + (motif * 3)[:22])
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each kind's target, and its draft: the target's weights with noise (it agrees with the target often, not
    always, so proposals are both accepted and rejected)."""
    paths = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = tiny_hf(kind)
        paths[kind] = tmp_path_factory.mktemp(kind)
        model.save_pretrained(paths[kind])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        paths[kind, "draft"] = tmp_path_factory.mktemp(f"{kind}-draft")
        model.save_pretrained(paths[kind, "draft"])
    return {k: str(v) for k, v in paths.items()}


def _generate(llm: LLM) -> tuple[list[list[int]], dict]:
    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [o.token_ids for o in outs], llm.engine.stats()


def _speculative(paths, kind: str, method: str) -> dict:
    return NGRAM if method == "ngram" else dict(method="draft", num_speculative_tokens=3, model=paths[kind, "draft"])


def _check_run(tokens, stats, want, where) -> None:
    assert tokens == want, where
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, (where, stats)
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], \
        (where, stats)
    assert stats["tokens_per_target_forward"] > 1 and stats["kv_blocks_used"] == 0, (where, stats)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_tokens_equal_plain_decoding(checkpoints, method):
    for kind in KINDS:
        want, plain = _generate(LLM(checkpoints[kind], device="cpu", **ENGINE))
        assert plain["tokens_per_target_forward"] == 1.0 and plain["spec_proposed_tokens"] == 0
        llm = LLM(checkpoints[kind], device="cpu", speculative=_speculative(checkpoints, kind, method), **ENGINE)
        tokens, stats = _generate(llm)
        _check_run(tokens, stats, want, (kind, method))
        if method == "draft":
            assert stats["spec_draft_forwards"] > 0 and llm.engine.proposer.block_manager.num_used_blocks == 0
        # logprobs come from the target's distribution at each emitted token's position
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2)
        got = llm.generate(_prompts()[:2], params)
        ref = LLM(checkpoints[kind], device="cpu", **ENGINE).generate(_prompts()[:2], params)
        for g, r in zip(got, ref):
            assert g.token_ids == r.token_ids and [x["token"] for x in g.logprobs] == g.token_ids
            assert [x["logprob"] for x in g.logprobs] == pytest.approx([x["logprob"] for x in r.logprobs], abs=1e-9)


def _parallel_ranks(rank, world_size, paths, layouts):
    out = {}
    for name, (tp, cp) in layouts.items():
        for kind, method in COMBOS[name]:
            # cp: each rank gets half the blocks, so the block manager sees the single process's number
            llm = LLM(paths[kind], tp=tp, cp=cp, device="cpu", speculative=_speculative(paths, kind, method),
                      **{**ENGINE, "num_blocks": ENGINE["num_blocks"] // cp})
            if llm.is_driver:
                out[name, kind, method] = _generate(llm)
                llm.close()
        # collectives per emitted token, without and with n-gram speculation (one long sequence)
        for method in ("plain", "ngram"):
            llm = LLM(paths["llama"], tp=tp, cp=cp, device="cpu", dtype=torch.float64, block_size=4,
                      speculative=NGRAM if method == "ngram" else None)
            if llm.is_driver:
                [o] = llm.generate([[5, 6, 7, 8] * 4], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
                out[name, "counted", method] = o.token_ids, llm.engine.stats()
                llm.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_greedy_tokens_equal_one_process(checkpoints, world):
    layouts = {n: tc for n, tc in LAYOUTS.items() if tc[0] * tc[1] == world}
    single = {kind: _generate(LLM(checkpoints[kind], device="cpu", **ENGINE))[0]
              for kind in {k for n in layouts for k, _ in COMBOS[n]}}
    results = run_distributed(_parallel_ranks, world, checkpoints, layouts, timeout=400)
    assert all(r == {} for r in results[1:])
    for name in layouts:
        for kind, method in COMBOS[name]:
            _check_run(*results[0][name, kind, method], single[kind], (name, kind, method))
        (plain, p_stats), (spec, s_stats) = results[0][name, "counted", "plain"], results[0][name, "counted", "ngram"]
        assert spec == plain and s_stats["num_steps"] < p_stats["num_steps"], (name, p_stats, s_stats)
        for axis, calls in p_stats["comm_calls_per_token"].items():  # fewer forwards: fewer collectives a token
            assert s_stats["comm_calls_per_token"][axis] < calls, (name, axis, p_stats, s_stats)


def test_forwards_per_emitted_token_are_counted():
    """One sequence whose output repeats: every step is one target forward; with n-gram lookup it emits the same
    tokens in fewer forwards."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_seq_len=128, init_std=0.2)
    model = build_model(cfg, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    counts = {}
    for name, spec in (("plain", None), ("ngram", dict(num_speculative_tokens=4))):
        engine = Engine(model, block_size=4, speculative=spec)
        calls = []
        execute = engine.runner.execute
        engine.runner.execute = lambda step: calls.append(len(step.token_ids)) or execute(step)  # noqa: B023
        [out] = engine.generate([[3, 4, 5, 6] * 3], params)
        counts[name] = (out.token_ids, len(calls), engine.stats())
    (plain, plain_forwards, _), (spec, spec_forwards, stats) = counts["plain"], counts["ngram"]
    assert spec == plain and plain_forwards == 48  # a prefill, then a decode for each token but the first
    assert spec_forwards < plain_forwards
    assert stats["tokens_per_target_forward"] == pytest.approx(48 / spec_forwards)
    assert stats["spec_accepted_tokens"] == 48 - spec_forwards


def test_the_draft_prefills_in_the_step_that_prefills_the_prompt():
    """As vLLM's drafter: the step that samples a request's first token also runs the draft over its prompt and that
    token and drafts the next step's k proposals -- the first gap between tokens holds no draft prefill -- and each
    later step drafts the next one's."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_seq_len=128, init_std=0.2)
    model, draft = build_model(cfg, seed=0), build_model(dataclasses.replace(cfg, num_layers=1), seed=1)
    engine = Engine(model, block_size=4, speculative=dict(method="draft", model="draft", num_speculative_tokens=3),
                    draft_model=draft)
    fed = []
    execute = engine.proposer.runner.execute
    engine.proposer.runner.execute = lambda step: fed.append(len(step.token_ids)) or execute(step)
    prompt = [3, 4, 5, 6] * 3
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20))
    [out] = engine.step()
    [seq] = engine.scheduler.running
    assert len(out.new_token_ids) == 1 and fed == [len(prompt) + 1, 1, 1] and len(seq.spec_token_ids) == 3
    engine.step()  # verifies those three, then drafts three more from the tokens it kept
    assert len(fed) == 6 and fed[3] >= 1 and len(seq.spec_token_ids) == 3


# ---- sampling: the distribution is the target's --------------------------------------------------------------

VOCAB = 8
CHI2_DF7_P001 = 24.32  # chi-square's 0.999 quantile at 7 degrees of freedom
# Every token occurs in the prompt, so n-gram lookup proposes after any first token. The first token comes from
# the prefill (no proposals); the second and third from the decodes that verify proposals.
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
SAMPLES = 4000
TEMPERATURE = 0.9


def _small_model(seed: int, hidden: int = 32):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=hidden, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_seq_len=64, init_std=0.3)
    return build_model(cfg, seed=seed)


def _target_distributions(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact distributions of the second and the third emitted token (summed over the tokens before)."""
    def probs(continuations: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + c for c in continuations]))[:, -1]
        return sampling_probs(logits, temperature=TEMPERATURE).double()

    p1 = probs([[]])[0]
    p2 = probs([[a] for a in range(VOCAB)])  # [first, second]
    p3 = probs([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    return p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)


def _chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = probs * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def _resample_from_p(probs_nv, proposals, generator, draft_probs=None):
    """A wrong rule: a rejected proposal is replaced by a draw from p itself (the proposal not removed)."""
    out = []
    for j, x in enumerate(proposals):
        if float(torch.rand((), generator=generator)) < float(probs_nv[j, x]):
            out.append(x)
            continue
        return out + [int(torch.multinomial(probs_nv[j][None], 1, generator=generator)[0, 0])]
    return out + [int(torch.multinomial(probs_nv[len(proposals)][None], 1, generator=generator)[0, 0])]


def _always_accept(probs_nv, proposals, generator, draft_probs=None):
    """A wrong rule: every proposal is kept."""
    return list(proposals) + [int(torch.multinomial(probs_nv[len(proposals)][None], 1, generator=generator)[0, 0])]


def _empirical(model, spec, draft=None) -> tuple[list[int], list[int], dict]:
    engine = Engine(model, block_size=4, max_num_seqs=256, max_num_batched_tokens=4096, seed=1, speculative=spec,
                    draft_model=draft)
    outs = engine.generate([PROMPT] * SAMPLES, SamplingParams(temperature=TEMPERATURE, max_tokens=4))
    return [o.token_ids[1] for o in outs], [o.token_ids[2] for o in outs], engine.stats()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_distribution_is_the_targets(method):
    model = _small_model(0)
    second, third = _target_distributions(model)
    spec = dict(method=method, num_speculative_tokens=2, **({"model": "draft"} if method == "draft" else {}))
    x2, x3, stats = _empirical(model, spec, _small_model(1, hidden=16) if method == "draft" else None)
    assert stats["spec_proposed_tokens"] >= SAMPLES
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert _chi_square(x2, second) < CHI2_DF7_P001, (method, second)
    assert _chi_square(x3, third) < CHI2_DF7_P001, (method, third)


@pytest.mark.parametrize("rule", [_resample_from_p, _always_accept])
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch, rule):
    model = _small_model(0)
    second, third = _target_distributions(model)
    monkeypatch.setattr(sampling, "verify_proposals", rule)
    x2, x3, _ = _empirical(model, dict(num_speculative_tokens=2))
    assert max(_chi_square(x2, second), _chi_square(x3, third)) > CHI2_DF7_P001


# ---- bad input ------------------------------------------------------------------------------------------------

def test_refusals_before_serving(tmp_path, checkpoints):
    model = _small_model(0)
    with pytest.raises(ValueError, match="num_speculative_tokens=0 must be an integer >= 1"):
        LLM(model, device="cpu", speculative=dict(num_speculative_tokens=0))
    with pytest.raises(ValueError, match="num_speculative_tokens=63 does not fit the context length 64"):
        LLM(model, device="cpu", speculative=dict(num_speculative_tokens=63))
    with pytest.raises(ValueError, match="does not fit the context length 20"):
        LLM(model, device="cpu", max_model_len=20, speculative=dict(num_speculative_tokens=19))
    torch.manual_seed(0)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary of 80 tokens, the model 96"):
        LLM(checkpoints["llama"], device="cpu", speculative=dict(method="draft", model=str(tmp_path / "other")))
    llm = LLM(model, device="cpu", speculative=dict(num_speculative_tokens=3))
    with pytest.raises(ValueError, match="num_speculative_tokens=4 is more than this engine allows"):
        llm.generate([[1, 2, 3]], SamplingParams(num_speculative_tokens=4))
    with pytest.raises(ValueError, match="speculates on no token"):
        LLM(model, device="cpu").generate([[1, 2, 3]], SamplingParams(num_speculative_tokens=1))


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    """The same vocabulary size, two ids swapped: the same ids would be other text."""
    import json

    pytest.importorskip("tokenizers")
    from tiny_hf import make_model_dir

    target = make_model_dir(tmp_path)
    (tmp_path / "draft").mkdir()
    draft = make_model_dir(tmp_path / "draft")
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="has another tokenizer than the model"):
        LLM(str(target), device="cpu", speculative=dict(method="draft", model=str(draft)))


def test_cli_refuses_bad_k_in_one_line(tmp_path, capfd):
    from meshlm.cli import main as cli_main

    model = tmp_path / "m"
    model.mkdir()
    torch.manual_seed(0)
    tiny_hf("llama").save_pretrained(model)
    base = ["generate", "--hf", str(model), "--prompt", "x", "--speculative", "ngram"]
    for extra, message in ((["--num-speculative-tokens", "0"], "--num-speculative-tokens=0 must be >= 1"),
                           (["--num-speculative-tokens", "200"], "num_speculative_tokens=200 does not fit the context "
                                                                  "length 128; use at most 126")):
        capfd.readouterr()
        assert cli_main(base + extra) == 2
        err = capfd.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
    capfd.readouterr()
    assert cli_main(["serve", "--model", str(model), "--speculative", "draft"]) == 2
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0 and "--speculative draft needs --speculative-model DIR" in err, err


def test_server_metrics_and_per_request_400(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from tiny_hf import make_model_dir

    from meshlm.infer.server import AsyncEngine, create_app

    path = str(make_model_dir(tmp_path))
    llm = LLM(path, device="cpu", block_size=8, speculative=dict(num_speculative_tokens=3))
    engine = AsyncEngine(llm.engine)
    try:
        client = TestClient(create_app(engine, model_name="tiny"))
        body = {"model": "tiny", "prompt": "hello world hello world hello", "max_tokens": 12, "temperature": 0}
        want = LLM(path, device="cpu", block_size=8).generate([body["prompt"]], SamplingParams(
            temperature=0, max_tokens=12))[0].text
        got = client.post("/v1/completions", json=body)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want
        assert client.post("/v1/completions", json={**body, "num_speculative_tokens": 2}).status_code == 200
        for k, message in ((0, "num_speculative_tokens=0 must be an integer >= 1"),
                           (4, "num_speculative_tokens=4 is more than this engine allows"),
                           (1.5, "num_speculative_tokens=1.5 must be an integer")):
            r = client.post("/v1/completions", json={**body, "num_speculative_tokens": k})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        metrics = client.get("/metrics").text
        value = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line[:1] not in "#"}
        assert value["meshlm_spec_proposed_tokens_total"] > 0
        assert value["meshlm_spec_acceptance_rate"] == pytest.approx(
            value["meshlm_spec_accepted_tokens_total"] / value["meshlm_spec_proposed_tokens_total"])
        assert value["meshlm_spec_tokens_per_target_forward"] >= 1
    finally:
        engine.stop()


def test_a_stop_string_ends_the_tokens_where_plain_decoding_ends_them():
    """Several tokens emitted in one step: those after the one completing a stop string are dropped."""
    from test_engine import _LetterTokenizer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_seq_len=128, init_std=0.2)
    model = build_model(cfg, seed=0)
    prompt = [3, 4, 5, 6] * 3
    full = Engine(model, _LetterTokenizer(), block_size=4).generate([prompt], SamplingParams(
        temperature=0, max_tokens=40))[0]
    engine = Engine(model, _LetterTokenizer(), block_size=4, speculative=dict(num_speculative_tokens=4))
    for cut in (5, 17, 30):
        params = SamplingParams(temperature=0, max_tokens=40, stop=[full.text[cut - 3:cut]], logprobs=1)
        want = Engine(model, _LetterTokenizer(), block_size=4).generate([prompt], params)[0]
        got = engine.generate([prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
        assert len(got.logprobs) == len(got.token_ids)
    assert engine.stats()["spec_accepted_tokens"] > 0
