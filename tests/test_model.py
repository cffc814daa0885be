"""Unit tests of the reference model: initialisation, KV cache, MoE routing and loss, tied weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshlm.config import ModelConfig
from meshlm.models import KVCache, MoE, build_model
from meshlm.models.transformer import init_param, param_generator

DENSE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
             max_seq_len=64)
MOE = dict(DENSE, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
           shared_expert_gate=True, first_dense_layers=1)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_init_is_deterministic_per_seed_and_name():
    config = ModelConfig(**MOE)
    a, b, c = (_params(build_model(config, seed=s)) for s in (1, 1, 2))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq.weight"], c["layers.0.attn.wq.weight"])
    # Each name has its own stream: two layers of the same shape do not start equal.
    assert not torch.equal(a["layers.0.attn.wq.weight"], a["layers.1.attn.wq.weight"])
    draw = lambda name: torch.randn(4, generator=param_generator(0, name))  # noqa: E731
    assert torch.equal(draw("x.weight"), draw("x.weight"))
    assert not torch.equal(draw("x.weight"), draw("y.weight"))


def test_init_values_follow_the_rules():
    config = ModelConfig(**DENSE, attention_bias=True)
    model = build_model(config, seed=0)
    assert torch.equal(model.norm.weight, torch.ones(32))
    assert torch.equal(model.layers["0"].attn.wk.bias, torch.zeros(16))
    # A parameter's value depends only on (seed, name, shape): a shard can rebuild its slice alone.
    assert torch.equal(model.layers["1"].mlp.w_down.weight,
                       init_param("layers.1.mlp.w_down.weight", (32, 48), config, seed=0))
    assert model.layers["1"].mlp.w_down.weight.std() < model.layers["1"].mlp.w_up.weight.std()


def test_any_rows_of_an_initial_value_are_the_whole_values_rows(monkeypatch):
    """Random initial values come in blocks of rows, each from its own stream: rows [a, b) drawn alone (what a
    rank holding them draws) equal the whole value's, across block boundaries, for 1-, 2- and 3-d parameters."""
    from meshlm.models import transformer

    monkeypatch.setattr(transformer, "INIT_BLOCK_ELEMENTS", 100)  # blocks of 2 rows of 48, 4 of 24, ...
    config = ModelConfig(**DENSE)
    for name, shape in (("layers.0.mlp.w_down.weight", (32, 48)), ("embed.weight", (7, 24)),
                        ("layers.0.moe.w_up", (4, 8, 12)), ("layers.0.attn.wq.weight", (3, 200))):
        whole = init_param(name, shape, config, seed=3)
        assert whole.shape == shape
        for a, b in ((0, 1), (1, 2), (1, 6), (5, shape[0]), (0, shape[0]), (2, 2)):
            a, b = min(a, shape[0]), min(b, shape[0])
            assert torch.equal(init_param(name, shape, config, seed=3, rows=(a, b)), whole[a:b]), (name, a, b)


def test_tied_embeddings_share_one_tensor():
    config = ModelConfig(**DENSE, tie_embeddings=True)
    model = build_model(config, seed=0, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.embed.weight
    untied = build_model(ModelConfig(**DENSE), seed=0)
    assert model.num_params() == untied.num_params() - 64 * 32
    with torch.no_grad():
        model.embed.weight[0, 0] = 5.0
    assert model.lm_head.weight[0, 0] == 5.0


@pytest.mark.parametrize("preset", [DENSE, MOE], ids=["dense", "moe"])
def test_kv_cache_decoding_equals_full_forward(preset):
    config = ModelConfig(**preset, qk_norm=True)
    model = build_model(config, seed=0).eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(config, batch_size=2, max_len=12)
        parts = [model(tokens[:, :5], cache=cache)]  # prefill
        parts.append(model(tokens[:, 5:8], cache=cache))  # a chunk after a cached prefix
        parts += [model(tokens[:, i:i + 1], cache=cache) for i in range(8, 12)]  # one token at a time
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="KV cache holds 12 tokens"):
        model(tokens[:, :1], cache=cache)


def _naive_moe(moe: MoE, x_td: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over experts, top-k, optional renormalisation, weighted sum + shared."""
    outs = []
    for x in x_td:
        probs = F.softmax(moe.router(x), dim=-1)
        weights, experts = torch.topk(probs, moe.top_k)
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        y = sum(w * moe.experts.expert(int(e), x) for w, e in zip(weights, experts))
        if moe.shared is not None:
            shared = moe.shared(x)
            y = y + (torch.sigmoid(moe.shared_gate(x)) * shared if moe.shared_gate is not None else shared)
        outs.append(y)
    return torch.stack(outs)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("shared", [0, 1])
def test_moe_dropless_equals_naive_loop(norm_topk_prob, shared):
    config = ModelConfig(**{**MOE, "num_shared_experts": shared, "shared_expert_gate": bool(shared)},
                         norm_topk_prob=norm_topk_prob)
    model = build_model(config, seed=1)
    moe = model.layers["1"].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _naive_moe(moe, x.reshape(-1, 32)).reshape(3, 7, 32),
                                   rtol=1e-5, atol=1e-6)


def test_aux_loss_is_one_for_uniform_routing():
    config = ModelConfig(**{**MOE, "first_dense_layers": 0}, router_aux_loss_coef=0.1)
    model = build_model(config, seed=0)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for block in model.layers.values():
            block.mlp.router.weight.zero_()  # every expert equally likely
        model(tokens)
        for block in model.layers.values():
            assert block.mlp.last_aux_loss.item() == pytest.approx(1.0, abs=1e-6)
        assert float(model.aux_loss()) == pytest.approx(0.1 * 2, abs=1e-6)
        # Small random routers spread many tokens about evenly: close to 1, never below ~1.
        for block in model.layers.values():
            block.mlp.router.weight.normal_(0, 1e-3)
        model(torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(1)))
        for block in model.layers.values():
            assert 0.95 < block.mlp.last_aux_loss.item() < 1.2
    assert build_model(ModelConfig(**DENSE)).aux_loss() == 0.0


def test_rope_keeps_q_and_k_in_the_autocast_dtype(monkeypatch):
    """Under bf16 autocast the projections give bf16 q/k; RoPE's fp32 cos/sin must not promote them to fp32 (the
    attention, and the K/V context parallelism ships, would run in fp32)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_seq_len=16)
    model, seen, sdpa = build_model(cfg), [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 16)))
    assert seen == [(torch.bfloat16,) * 3]
