"""meshlm.models.generation.generate: greedy against a cache-free argmax loop, sampling knobs, batches, errors."""

from __future__ import annotations

import pytest
import torch

from meshlm.config import ModelConfig
from meshlm.models.generation import generate
from meshlm.models import build_model

CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
              max_seq_len=48)


@pytest.fixture(scope="module")
def model():
    model = build_model(ModelConfig(**CONFIG, num_experts=4, num_experts_per_token=2), seed=0)
    with torch.no_grad():  # init_std 0.02 leaves logits near-uniform; sharpen so argmax is robust
        model.lm_head.weight.mul_(50)
    return model.eval()


def _greedy_without_cache(model, prompt, n):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_equals_full_forward_argmax(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = generate(model, prompt, max_new_tokens=12)
    assert out == _greedy_without_cache(model, prompt, 12)
    assert generate(model, torch.tensor(prompt), max_new_tokens=12) == out
    # top_k=1 sampling is greedy, whatever the temperature.
    assert generate(model, prompt, max_new_tokens=12, temperature=2.0, top_k=1, seed=0) == out
    # A near-zero temperature is greedy too (not a nan distribution).
    assert generate(model, prompt, max_new_tokens=12, temperature=1e-40, seed=0) == out


def test_batch_equals_one_by_one(model):
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5, 5]]
    assert generate(model, prompts, max_new_tokens=6) == [generate(model, p, max_new_tokens=6) for p in prompts]
    assert generate(model, torch.tensor(prompts), max_new_tokens=6, temperature=1.0, seed=3) == \
        generate(model, prompts, max_new_tokens=6, temperature=1.0, seed=3)


def test_sampling_is_reproducible_with_a_seed(model):
    prompt = [7, 7, 7]
    a = generate(model, prompt, max_new_tokens=16, temperature=1.5, top_p=0.9, top_k=20, seed=1)
    b = generate(model, prompt, max_new_tokens=16, temperature=1.5, top_p=0.9, top_k=20, seed=1)
    others = {tuple(generate(model, prompt, max_new_tokens=16, temperature=1.5, seed=s)) for s in range(2, 6)}
    assert a == b and len(a) == 16
    assert len(others) > 1  # different seeds, different samples


def test_tiny_top_p_keeps_only_the_most_likely_token(model):
    prompt = [2, 4, 6]
    greedy = generate(model, prompt, max_new_tokens=8)
    assert generate(model, prompt, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=0) == greedy
    # min_p 1 keeps only the most likely token too (single-process generate takes it as the engine does)
    assert generate(model, prompt, max_new_tokens=8, temperature=1.0, min_p=1.0, seed=0) == greedy


def test_stop_tokens_end_rows(model):
    prompt = [3, 1, 4, 1, 5]
    free = generate(model, prompt, max_new_tokens=10)
    stop = free[3]
    first = free.index(stop)
    assert generate(model, prompt, max_new_tokens=10, stop_token_ids=[stop]) == free[:first + 1]
    # In a batch, a stopped row ends while the others go on.
    other = [9, 9, 9, 9, 9]
    rows = generate(model, [prompt, other], max_new_tokens=10, stop_token_ids=(stop,))
    assert rows[0] == free[:first + 1]
    expected_other = generate(model, other, max_new_tokens=10, stop_token_ids=(stop,))
    assert rows[1] == expected_other
    assert generate(model, prompt, max_new_tokens=0) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_ids=[], max_new_tokens=1), "empty"),
    (dict(prompt_ids=[1, 64], max_new_tokens=1), "vocab_size"),
    (dict(prompt_ids=[[1, 2], [3]], max_new_tokens=1), "equal lengths"),
    (dict(prompt_ids=[1], max_new_tokens=48), "max_seq_len=48"),
    (dict(prompt_ids=[1], max_new_tokens=1, temperature=-1.0), "temperature"),
    (dict(prompt_ids=[1], max_new_tokens=1, top_p=0.0), "top_p"),
    (dict(prompt_ids=[1], max_new_tokens=1, top_k=-1), "top_k"),
    (dict(prompt_ids=[1], max_new_tokens=-1), "max_new_tokens"),
])
def test_bad_arguments_raise(model, kwargs, match):
    prompt = kwargs.pop("prompt_ids")
    with pytest.raises(ValueError, match=match):
        generate(model, prompt, **kwargs)


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_most_likely():
    """vLLM's min_p, after temperature and before top-k / top-p: probabilities written out by hand."""
    from meshlm.models.generation import sampling_probs

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # temperature 1: p / p_max = 1, 0.6, 0.3, 0.1; min_p 0.25 keeps the first three
    assert torch.allclose(sampling_probs(logits, temperature=1.0, min_p=0.25), torch.tensor([[.5, .3, .15, 0]]) / .95)
    # temperature 2 flattens first: sqrt of the ratios, 1, 0.77, 0.55, 0.32: min_p 0.5 keeps three
    want = torch.tensor([[.5, .3, .15, 0]]).sqrt() / torch.tensor([.5, .3, .15]).sqrt().sum()
    assert torch.allclose(sampling_probs(logits, temperature=2.0, min_p=0.5), want)
    # then top-p over what min_p kept (0.5 / 0.95 < 0.6: the second token crosses it)
    assert torch.allclose(sampling_probs(logits, temperature=1.0, min_p=0.25, top_p=0.6),
                          torch.tensor([[.625, .375, 0, 0]]))
    assert torch.equal(sampling_probs(logits, temperature=1.0, min_p=1.0), torch.tensor([[1.0, 0, 0, 0]]))
    assert torch.equal(sampling_probs(logits, temperature=1.0, min_p=0.0), sampling_probs(logits, temperature=1.0))
