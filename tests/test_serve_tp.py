"""Tensor-parallel serving (`LLM(..., tp=2)`, `meshlm generate --tp 2`) gives the single-process engine's
greedy tokens, for tiny random Llama, Qwen2 and Mixtral checkpoints, with continuous batching, chunked
prefill, prefix-cache hits and forced preemption in the same run; each rank's KV cache holds half the kv
heads, so the same per-rank budget holds twice the blocks."""

import random

import pytest
import torch

from dist import run_distributed
from meshlm import LLM, SamplingParams
from meshlm.cli import main as cli_main

transformers = pytest.importorskip("transformers")

KINDS = ["llama", "qwen2", "mixtral"]
MAX_NEW = 8
# chunked prefill (16 tokens a step), a KV budget so small that sequences are preempted, prefix caching on
ENGINE = dict(block_size=4, num_blocks=14, max_num_seqs=6, max_num_batched_tokens=16, dtype=torch.float64)


def _tiny_hf(kind: str):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
                  eos_token_id=95, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4,
                                                                     num_experts_per_tok=2))


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
        _tiny_hf(kind).save_pretrained(paths[kind])
    return paths


def _generate(llm: LLM) -> tuple[list[list[int]], dict]:
    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [o.token_ids for o in outs], llm.engine.stats()


def _tp_ranks(rank, world_size, paths):
    out = {}
    for kind, path in paths.items():
        llm = LLM(path, tp=world_size, device="cpu", **ENGINE)
        if not llm.is_driver:
            assert llm.engine is None
            continue
        out[kind] = _generate(llm)
        out[kind, "kv_heads"] = llm.engine.runner.runner.k_caches[0].shape[2]
        llm.close()
    return out


def test_tp2_greedy_tokens_equal_one_process(checkpoints):
    single = {kind: _generate(LLM(path, device="cpu", **ENGINE)) for kind, path in checkpoints.items()}
    results = run_distributed(_tp_ranks, 2, {k: str(v) for k, v in checkpoints.items()}, timeout=180)
    assert results[1] == {}
    for kind in KINDS:
        tokens, stats = results[0][kind]
        assert tokens == single[kind][0], kind
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, (kind, stats)
        assert results[0][kind, "kv_heads"] == 1  # 2 kv heads over tp=2


def test_tp_needs_its_ranks():
    with pytest.raises(ValueError, match="start 2 ranks"):
        LLM(torch.nn.Linear(1, 1), tp=2)


def test_generate_tp2_from_the_cli(tmp_path, capfd):
    pytest.importorskip("tokenizers")
    from test_server import make_model_dir

    path = str(make_model_dir(tmp_path))
    argv = ["generate", "--hf", path, "--prompt", "hello world", "--max-new-tokens", "6"]
    capfd.readouterr()  # what building the model printed
    assert cli_main(argv) == 0
    one = capfd.readouterr().out
    assert cli_main([*argv, "--tp", "2"]) == 0  # two ranks through torch's launcher
    two = capfd.readouterr().out
    assert one.startswith("hello world") and len(one) > len("hello world\n") and two == one, (one, two)
