"""The inference engine against Hugging Face transformers and against our own contiguous-cache path.

Greedy outputs must equal transformers' `generate` token for token, for tiny random Llama, Qwen2 and
Mixtral checkpoints, for a batch of prompts of different lengths run through continuous batching:
plainly, with prefix-cache hits, with chunked prefill forced small, and under preemption.
"""

import random

import pytest
import torch

from meshlm import LLM, SamplingParams
from meshlm.config import ModelConfig
from meshlm.infer.engine import Engine
from meshlm.models import KVCache, build_model

transformers = pytest.importorskip("transformers")

MAX_NEW = 10


def tiny_hf(kind: str):
    """A tiny random transformers model: llama, qwen2, mixtral, or qwen2_moe (a shared expert with its gate
    and a dense first layer)."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
                  eos_token_id=95, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4,
                                                                         num_experts_per_tok=2))
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[0]))
    raise AssertionError(kind)


def _prompts(seed: int, prefix_len: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 90) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(2, 90) for _ in range(n)] for n in (3, 17, 1, 29, 8, 12)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral"])
def hf_case(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = tiny_hf(request.param).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    prompts = _prompts(1) + _prompts(2, prefix_len=21)
    expected = []
    with torch.no_grad():
        for p in prompts:  # one at a time: no padding in the reference
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
            expected.append(out[0, len(p):].tolist())
    return path, prompts, expected


@pytest.mark.parametrize("engine_kwargs", [
    dict(),  # continuous batching; shared prefixes give prefix-cache hits
    dict(enable_prefix_caching=False),
    dict(block_size=4, max_num_batched_tokens=7),  # chunked prefill forced small
    dict(block_size=4, num_blocks=16, max_num_seqs=8),  # tiny KV budget: preemption by recompute
    dict(native_attention=False),  # decode attention by torch ops, not the compiled kernel
], ids=["batched", "no-prefix-cache", "chunked", "preempt", "torch-decode-attention"])
def test_greedy_matches_transformers(hf_case, engine_kwargs):
    path, prompts, expected = hf_case
    llm = LLM(str(path), device="cpu", **engine_kwargs)
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == expected
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    if engine_kwargs.get("num_blocks"):
        assert stats["num_preemptions"] > 0
    if not engine_kwargs:
        # A second round hits the cache for whole prompts and still gives the same tokens.
        again = llm.generate(prompts[::-1], SamplingParams(temperature=0, max_tokens=MAX_NEW))
        assert [r.token_ids for r in again] == expected[::-1]
        assert any(r.num_cached_tokens > 0 for r in again)
        assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("engine_kwargs", [
    dict(),  # the second round finds every prompt in the prefix cache: still each position is computed
    dict(block_size=4, max_num_batched_tokens=7),  # chunked prefill forced small
    dict(block_size=4, num_blocks=16, max_num_seqs=8),  # preemption by recompute: positions computed again
], ids=["batched", "chunked", "preempt"])
def test_prompt_logprobs_are_transformers_log_softmax_of_the_prompt(hf_case, engine_kwargs, monkeypatch):
    import meshlm.infer.engine as engine_module

    monkeypatch.setattr(engine_module, "PROMPT_LOGPROB_ROWS", 5)  # a step's prompt rows in several slices
    path, prompts, _ = hf_case
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(str(path), device="cpu", **engine_kwargs)
    for _ in range(1 if engine_kwargs else 2):
        results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, prompt_logprobs=2))
        for p, r in zip(prompts, results):
            with torch.no_grad():
                want = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
            assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(p)
            for pos in range(1, len(p)):
                got = r.prompt_logprobs[pos]
                assert got["token"] == p[pos] and abs(got["logprob"] - float(want[pos - 1, p[pos]])) < 1e-4
                assert list(got["top"]) == want[pos - 1].topk(2).indices.tolist()
    if engine_kwargs.get("num_blocks"):
        assert llm.engine.stats()["num_preemptions"] > 0


def _tiny_model():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_seq_len=96, init_std=0.2)
    return build_model(cfg, seed=0)


def test_paged_attention_matches_contiguous_cache():
    model = _tiny_model()
    prompt = list(range(3, 20))
    # Reference: our contiguous KVCache path, greedy.
    cache = KVCache(model.config, 1, 64)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache)
        ref = []
        for _ in range(8):
            tok = int(logits[0, -1].argmax())
            ref.append(tok)
            logits = model(torch.tensor([[tok]]), cache=cache)
    engine = Engine(model, block_size=4, max_num_batched_tokens=6)
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    assert out.token_ids == ref and out.finish_reason == "length"


def test_decodes_of_many_lengths_match_one_sequence_at_a_time():
    """Many decodes of very different lengths in one step are one batch over the cache (no key padded):
    the tokens are those of each prompt run alone."""
    model = _tiny_model()
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 60) for _ in range(n)] for n in rng.sample(range(1, 70), 40)]
    params = SamplingParams(temperature=0, max_tokens=3)
    together = Engine(model, block_size=4).generate(prompts, params)
    engine = Engine(model, block_size=4)
    assert [o.token_ids for o in together] == [engine.generate([p], params)[0].token_ids for p in prompts]


def test_moe_serves_dropless():
    """A model trained with a capacity rule serves without it: each token reaches its top-k experts, so
    its tokens do not depend on what else is in the step."""
    def moe(capacity_factor):
        cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=64, max_seq_len=96, init_std=0.2, num_experts=4,
                          capacity_factor=capacity_factor)
        return build_model(cfg, seed=0)

    prompts = [list(range(3, 20)), [5, 6, 7], list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=6)
    want = [o.token_ids for o in Engine(moe(0.0), block_size=4).generate(prompts, params)]
    assert [o.token_ids for o in Engine(moe(0.25), block_size=4).generate(prompts, params)] == want


def test_sampling_seed_stop_tokens_logprobs():
    model = _tiny_model()
    engine = Engine(model, block_size=4)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=12)
    alone = engine.generate([[5, 6, 7]], params)[0].token_ids
    # Same seed -> same tokens, whatever else is in the batch.
    crowd = engine.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [SamplingParams(temperature=1.0, max_tokens=5), params,
                                                               SamplingParams(temperature=0, max_tokens=3)])
    assert crowd[1].token_ids == alone
    greedy = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    assert engine.generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_k=1, max_tokens=12))[0].token_ids == greedy
    stop_at = greedy[3]
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[:greedy.index(stop_at) + 1] and out.finish_reason == "stop"
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp["token"] == tok and len(lp["top"]) == 3 and lp["logprob"] == max(lp["top"].values())


def test_user_errors():
    model = _tiny_model()
    with pytest.raises(ValueError, match="tp=2"):
        LLM(model, tp=2, device="cpu")
    with pytest.raises(ValueError, match="block_size=0"):
        LLM(model, block_size=0, device="cpu")
    llm = LLM(model, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="context length"):
        llm.generate([list(range(1, 60)) * 2])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 999]])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"])
    assert not llm.engine.has_unfinished()


def test_a_bad_request_or_an_interrupted_generate_leaves_the_llm_usable(monkeypatch):
    """Found by a fuzz pass of the Python API: a prompt holding a non-integer, or an exception other than a
    ValueError while adding or stepping, left the first prompts' requests in the engine, and every later
    generate finished those and failed on a KeyError of its own."""
    import numpy as np

    llm = LLM(_tiny_model(), block_size=4, device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=3)
    want = llm.generate([[7, 8]], greedy)[0].token_ids
    for bad, says in (([[1, 2], [1.5]], r"it holds 1.5 \(float\)"), ([[1, 2], [float("inf")]], "it holds inf"),
                      ([[1, 2], [True]], r"it holds True \(bool\)"), ([[1, 2], 5], "not int")):
        with pytest.raises(ValueError, match=says):
            llm.generate(bad, greedy)
    with pytest.raises(ValueError, match="0 SamplingParams for 2 prompts"):
        llm.generate([[1], [2]], [])
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        llm.generate([[1], [2]], {"max_tokens": 2})
    step = llm.engine.step

    def interrupted():
        monkeypatch.setattr(llm.engine, "step", step)
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2], [3, 4]], greedy)
    assert not llm.engine.has_unfinished()
    assert llm.generate([[7, 8]], greedy)[0].token_ids == want
    assert llm.generate(np.array([7, 8]), greedy)[0].token_ids == want  # one prompt of numpy ids, or a tuple
    assert llm.generate((7, 8), greedy)[0].token_ids == want
    assert [r.token_ids for r in llm.generate(([7, 8] for _ in range(2)), greedy)] == [want, want]  # any iterable
    numpy_params = SamplingParams(temperature=np.float32(0), top_k=np.int64(5), max_tokens=np.int64(3),
                                  stop_token_ids=[np.int64(0)], seed=np.int64(1))  # numpy's numbers are numbers
    plain = SamplingParams(temperature=0.0, top_k=5, max_tokens=3, stop_token_ids=[0], seed=1)
    assert llm.generate([[7, 8]], numpy_params)[0].token_ids == llm.generate([[7, 8]], plain)[0].token_ids


@pytest.mark.parametrize("kw", [dict(logprobs=True), dict(prompt_logprobs=True), dict(temperature=None),
                                dict(top_p="0.5"), dict(top_k=float("inf")), dict(top_k="3"), dict(ignore_eos="no"),
                                dict(stop=[5]), dict(stop={"a": 1}), dict(stop_token_ids=[float("nan")])])
def test_sampling_params_of_the_wrong_kind_are_refused_naming_the_field(kw):
    from meshlm.infer.sequence import SamplingError

    with pytest.raises(SamplingError, match=f"^{next(iter(kw))}=") as e:
        SamplingParams(**kw)
    assert e.value.field == next(iter(kw))


@pytest.mark.parametrize("kw, says", [(dict(num_blocks=-1), "num_blocks=-1 must be >= 1"),
                                      (dict(seed="x"), "seed='x' must be a whole number"),
                                      (dict(tp=1.5), "tp=1.5 must be a whole number"),
                                      (dict(block_size=7.5), "block_size=7.5 must be a whole number"),
                                      (dict(max_model_len=2.5), "max_model_len=2.5 must be a whole number"),
                                      (dict(kv_cache_memory_bytes=float("nan")),
                                       "kv_cache_memory_bytes=nan must be a whole number")])
def test_llm_refuses_counts_that_are_not_whole_numbers(kw, says):
    """A RuntimeError or TypeError from torch before, or "start 1.5 ranks" (found by a fuzz pass of the API)."""
    with pytest.raises(ValueError, match=says):
        LLM(_tiny_model(), device="cpu", **kw)


def test_llm_loads_meshlm_checkpoint(tmp_path):
    from meshlm.config import Config
    from meshlm.checkpoint import save_checkpoint

    cfg = Config(model=ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                   intermediate_size=64, max_seq_len=64, init_std=0.2))
    model = build_model(cfg.model, seed=cfg.train.seed)
    save_checkpoint(tmp_path, step=1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    config=cfg, rank_extra={})
    llm = LLM(str(tmp_path), device="cpu")
    [out] = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ref = Engine(model, block_size=4).generate([list(b"def f(x):")], SamplingParams(temperature=0, max_tokens=6,
                                                                                    ignore_eos=True))[0]
    assert out.token_ids == ref.token_ids and isinstance(out.text, str)


class _LetterTokenizer:
    """A stand-in tokenizer: token t is the letter chr(97 + t % 26); no special tokens."""

    eos_token_ids = ()

    def encode(self, text, **_):
        return [ord(c) % 64 for c in text]

    def decode(self, ids, **_):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_strings_on_the_last_token():
    engine = Engine(_tiny_model(), _LetterTokenizer(), block_size=4)
    full = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert len(full.text) == 6
    # A stop string that never appears: the text of a length-finished request keeps its last token.
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, stop=["QQ"]))[0]
    assert (out.text, out.finish_reason) == (full.text, "length")
    # A stop string completed by the very last allowed token still cuts the text.
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, stop=[full.text]))[0]
    assert (out.text, out.finish_reason) == ("", "stop")


def test_extreme_sampling_params_do_not_fail_the_step():
    # A failed step fails every request in it (the server aborts them all), so one request's odd but
    # valid parameters must not raise: a near-zero temperature and more logprobs than the vocabulary.
    cfg = ModelConfig(vocab_size=16, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_seq_len=32, init_std=0.2)
    engine = Engine(build_model(cfg, seed=0), block_size=4)
    greedy = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    cold, wide = engine.generate([[1, 2, 3], [1, 2, 3]], [SamplingParams(temperature=1e-40, max_tokens=4, seed=1),
                                                          SamplingParams(temperature=0, max_tokens=4, logprobs=20)])
    assert cold.token_ids == greedy and wide.token_ids == greedy
    assert all(len(lp["top"]) == 16 for lp in wide.logprobs)


def _dense_attention(q, k_cache, v_cache, blocks, counts, i):
    """Softmax attention of decode i over exactly the keys it sees, in float64: (output, lse) [kv, groups(, dim)]."""
    k64, v64, q64 = k_cache.double(), v_cache.double(), q.double()
    keys = torch.cat([k64[:, b, :, :c].transpose(-1, -2) for b, c in zip(blocks[i], counts[i])], dim=1)  # [kv, n, dim]
    values = torch.cat([v64[:, b, :c] for b, c in zip(blocks[i], counts[i])], dim=1)
    scores = torch.einsum("hgd,hnd->hgn", q64[:, i], keys) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)


def test_decode_batch_matches_dense_attention_on_any_blocks():
    """`DecodeBatch` alone, in float64: decodes of any number of blocks (none too: an empty partial), each
    block seen up to any count, grouped-query heads; output and log-sum-exp equal softmax attention over
    exactly the keys each decode sees."""
    from meshlm.infer.attention import DecodeBatch, new_kv_cache

    torch.manual_seed(0)
    num_kv, groups, dim, bs, num_blocks = 2, 3, 8, 4, 12
    k_cache, v_cache = new_kv_cache(num_kv, num_blocks, bs, dim, dtype=torch.float64)
    k_cache.normal_(), v_cache.normal_()
    blocks = [[3, 7, 1], [], [5], [0, 11, 2, 9, 4]]
    counts = [[4, 4, 2], [], [1], [4, 3, 4, 4, 1]]  # not only a prefix: a middle block seen in part
    batch = DecodeBatch(torch.arange(len(blocks)), blocks, counts, block_size=bs, num_kv=num_kv,
                        num_blocks=num_blocks, dtype=torch.float64)
    q = torch.randn(num_kv, len(blocks), groups, dim, dtype=torch.float64)
    out, lse = batch.attend(q, k_cache, v_cache, with_lse=True)
    plain = batch.attend(q, k_cache, v_cache)  # the softmax path (no log-sum-exp)
    for i in range(len(blocks)):
        if not blocks[i]:
            assert (out[:, i] == 0).all() and (plain[:, i] == 0).all() and torch.isinf(lse[:, i]).all()
            continue
        want, want_lse = _dense_attention(q, k_cache, v_cache, blocks, counts, i)
        torch.testing.assert_close(out[:, i], want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(plain[:, i], out[:, i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, i], want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("groups, bs, dim", [(1, 32, 16), (3, 4, 16), (2, 48, 40), (2, 24, 32), (4, 64, 128)])
def test_native_decode_attention_matches_dense_attention_on_any_blocks(groups, bs, dim):
    """The compiled kernel (`infer/native.py`) in float32, as the engine runs it on a CPU: the same decodes as
    above (empty ones, blocks seen in part), output and log-sum-exp against float64 softmax attention; and the
    kernel, not the torch path, did the work. Block sizes and head dims that take each of its tile paths
    (pairs of 16-float tiles, one tile, the scalar rest)."""
    from meshlm.infer.attention import DecodeBatch, new_kv_cache
    from meshlm.infer.native import decode_attention_kernel

    if decode_attention_kernel() is None:
        pytest.skip("no C compiler builds the kernel here")
    torch.manual_seed(0)
    num_kv, num_blocks = 2, 12
    k_cache, v_cache = new_kv_cache(num_kv, num_blocks, bs, dim, dtype=torch.float32)
    k_cache.normal_(), v_cache.normal_()
    blocks = [[3, 7, 1], [], [5], [0, 11, 2, 9, 4]]
    counts = [[bs, bs, 2], [], [1], [bs, bs - 1, bs, bs, 1]]
    batch = DecodeBatch(torch.arange(len(blocks)), blocks, counts, block_size=bs, num_kv=num_kv,
                        num_blocks=num_blocks, dtype=torch.float32)
    q = torch.randn(num_kv, len(blocks), groups, dim)
    out, lse = batch.attend(q, k_cache, v_cache, with_lse=True)
    plain = batch.attend(q, k_cache, v_cache)
    assert batch.table is not None and batch.index is None  # the kernel ran, the torch indices were never built
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # the (kv head, decode) pairs split over threads: each computed as by one
    try:
        assert torch.equal(batch.attend(q, k_cache, v_cache), plain)
    finally:
        torch.set_num_threads(threads)
    torch_path = DecodeBatch(torch.arange(len(blocks)), blocks, counts, block_size=bs, num_kv=num_kv,
                             num_blocks=num_blocks, dtype=torch.float32, native=False)
    torch.testing.assert_close(out, torch_path.attend(q, k_cache, v_cache), rtol=1e-5, atol=1e-5)
    assert torch_path.table is None and torch_path.index is not None
    for i in range(len(blocks)):
        if not blocks[i]:
            assert (out[:, i] == 0).all() and (plain[:, i] == 0).all() and torch.isinf(lse[:, i]).all()
            continue
        want, want_lse = _dense_attention(q, k_cache, v_cache, blocks, counts, i)
        torch.testing.assert_close(out[:, i].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain[:, i], out[:, i], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, i].double(), want_lse, rtol=1e-5, atol=1e-5)


def test_decode_attention_without_a_c_compiler_takes_the_torch_path(monkeypatch):
    """Where no C compiler builds the kernel, decodes still run (by torch ops), with the same numbers."""
    from meshlm.infer import native
    from meshlm.infer.attention import DecodeBatch, new_kv_cache

    torch.manual_seed(0)
    k_cache, v_cache = new_kv_cache(2, 6, 4, 8, dtype=torch.float32)
    k_cache.normal_(), v_cache.normal_()
    q = torch.randn(2, 2, 1, 8)
    args = (torch.arange(2), [[1, 4], [2]], [[4, 3], [2]])
    kwargs = dict(block_size=4, num_kv=2, num_blocks=6, dtype=torch.float32)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native.decode_attention_kernel.cache_clear()
    try:
        assert native.decode_attention_kernel() is None
        batch = DecodeBatch(*args, **kwargs)
        out = batch.attend(q, k_cache, v_cache)
        assert batch.table is None and batch.index is not None
    finally:
        native.decode_attention_kernel.cache_clear()
    monkeypatch.undo()
    if native.decode_attention_kernel() is not None:
        torch.testing.assert_close(DecodeBatch(*args, **kwargs).attend(q, k_cache, v_cache), out)


_FAULTS = """
import resource, sys, torch
from meshlm import LLM, SamplingParams
from meshlm.config import ModelConfig
from meshlm.models import build_model
torch.set_num_threads(1)
cfg = ModelConfig(vocab_size=64, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384,
                  max_seq_len=512)
# A KV cache of just the blocks these prompts take (the first runs touch all of them), no prefix cache: the
# third run computes what the first two did, in memory they already used.
llm = LLM(build_model(cfg, seed=0), device="cpu", reuse_host_memory=sys.argv[1] == "1", num_blocks=120,
          enable_prefix_caching=False)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompts = [[2 + (7 * i + j) % 60 for j in range(100 + 10 * i)] for i in range(16)]
llm.generate(prompts, params)
llm.generate(prompts, params)
faults = []  # the fewest of three repeats: one-off faults elsewhere in the process (a lazy import) are not the steps'
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate(prompts, params)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))
"""


def test_llm_reuses_the_host_memory_steps_free():
    """`LLM(reuse_host_memory=True)` (the default on a CPU) raises malloc's thresholds: a generate that
    repeats the work of the ones before faults in a fraction of the fresh pages it faults in with malloc's
    defaults (each side's fewest over three such generates: a CI run once saw 770 faults in one of them, against
    1-4 otherwise)."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "from meshlm.host_memory import reuse_freed_host_memory as r; "
                            "print(r())"], capture_output=True, text=True, check=True)
    if probe.stdout.strip() != "True":  # not glibc: nothing to set
        pytest.skip("this C library has no glibc mallopt")
    procs = {on: subprocess.Popen([sys.executable, "-c", _FAULTS, on], stdout=subprocess.PIPE, text=True)
             for on in ("0", "1")}  # side by side: each counts its own page faults
    faults = {on: int(proc.communicate(timeout=300)[0].split()[-1]) for on, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values())
    assert faults["1"] * 5 < faults["0"], faults
