"""Tensor (+ sequence) parallelism reproduces the single-process reference, and moves exactly the bytes
documented in meshlm.parallel.tensor.

Each rank builds the reference model (same seed), applies `apply_tensor_parallel`, runs one
forward + backward with `vocab_parallel_cross_entropy` and one AdamW step, and returns its loss,
local gradients and updated local weights; the parent concatenates the shards along their
`_meshlm_shard` dim and compares them with the one-process run.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from meshlm.comm import CommStats
from meshlm.config import ModelConfig
from meshlm.mesh import Mesh, ParallelDims, build_mesh
from meshlm.models.transformer import build_model, rope_cos_sin
from meshlm.parallel.tensor import (
    apply_tensor_parallel,
    full_state_dict,
    load_full_state_dict,
    tensor_parallel_grad_norm,
    vocab_parallel_cross_entropy,
)

SEED = 3
BATCH, SEQ = 2, 8
DENSE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=64, max_seq_len=16)
# Qwen2-style q/k/v bias, Qwen3-style q/k norm and tied embeddings in one tiny model.
BIAS = dict(DENSE, attention_bias=True, qk_norm=True, tie_embeddings=True)
# tp=4 needs kv heads divisible by 4.
WIDE = dict(DENSE, num_heads=8, num_kv_heads=4)
CONFIGS = {"dense": DENSE, "bias_qknorm_tied": BIAS, "dense_8_heads": WIDE}


def _batch(vocab: int):
    g = torch.Generator().manual_seed(11)
    seqs = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return seqs[:, :-1], seqs[:, 1:]


def _optimizer(model):
    # Adam's first step is lr * g / (|g| + eps): with the default eps=1e-8 a gradient entry of ~1e-9
    # (there are some) turns a harmless 1e-11 summation-order difference into a 1e-5 weight
    # difference. eps=1e-4 bounds that amplification; the step is still sign-like for real gradients.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4, foreach=False)


def _make_bias_nonzero(model):
    # The reference initialises biases to zero, which would hide a bias sharded wrongly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)


def _reference(cfg_kwargs):
    cfg = ModelConfig(**cfg_kwargs)
    model = build_model(cfg, seed=SEED)
    _make_bias_nonzero(model)
    inputs, targets = _batch(cfg.vocab_size)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    opt = _optimizer(model)
    opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), grads, params, float(grad_norm), model.state_dict()


def _tp_rank(rank, world_size, variants):
    """One spawn for several (config, sequence_parallel) variants: process start-up dominates the cost."""
    mesh = build_mesh(ParallelDims(tp=world_size), device_type="cpu")
    out = []
    for config, sequence_parallel in variants:
        cfg = ModelConfig(**CONFIGS[config])
        model = build_model(cfg, seed=SEED)
        _make_bias_nonzero(model)
        apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
        inputs, targets = _batch(cfg.vocab_size)
        logits = model(inputs)
        assert logits.shape == (BATCH, SEQ, cfg.vocab_size // world_size)
        loss = vocab_parallel_cross_entropy(logits, targets, mesh)
        loss.backward()
        spec = {n: getattr(p, "_meshlm_shard", None) for n, p in model.named_parameters()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        grad_norm = tensor_parallel_grad_norm(list(model.parameters()), mesh)
        _optimizer(model).step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        # Checkpoint round trip: gather the full tensors, load them into a differently initialised copy.
        full = full_state_dict(model, mesh)
        fresh = apply_tensor_parallel(build_model(cfg, seed=SEED + 1), mesh, sequence_parallel=sequence_parallel)
        load_full_state_dict(fresh, full, mesh)
        for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(a, b), name
        out.append((loss.item(), spec, grads, params, float(grad_norm), full))
    return out


def _assemble(results, index):
    """name -> full tensor: shards concatenated along their dim; replicated ones must agree on every rank."""
    spec = results[0][1]
    out = {}
    for name, s in spec.items():
        parts = [r[index][name] for r in results]
        if s is None:
            for p in parts[1:]:
                torch.testing.assert_close(p, parts[0], rtol=0, atol=0, msg=f"{name} differs across tp ranks")
            out[name] = parts[0]
        else:
            assert s[0] == "tp"
            out[name] = torch.cat(parts, dim=s[1])
    return out


VARIANTS = {2: [("dense", True), ("dense", False), ("bias_qknorm_tied", True), ("bias_qknorm_tied", False)],
            4: [("dense_8_heads", True)]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_matches_reference(world_size):
    """Loss, every gradient (shards concatenated) and the weights after one AdamW step."""
    variants = VARIANTS[world_size]
    per_rank = run_distributed(_tp_rank, world_size, variants)
    for i, (config, sequence_parallel) in enumerate(variants):
        what = f"{config} tp={world_size} sequence_parallel={sequence_parallel}"
        results = [r[i] for r in per_rank]
        ref_loss, ref_grads, ref_params, ref_norm, ref_state = _reference(CONFIGS[config])
        for r in results:
            assert r[0] == pytest.approx(ref_loss, rel=1e-5), what
        grads, params = _assemble(results, 2), _assemble(results, 3)
        assert set(grads) == set(ref_grads), what
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}: grad {name}: {m}")
            torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}: param {name}: {m}")
        for r in results:
            assert r[4] == pytest.approx(ref_norm, rel=1e-5), what  # tensor_parallel_grad_norm
            assert set(r[5]) == set(ref_state), what  # full_state_dict: the reference's keys and tensors
            for name, t in ref_state.items():
                torch.testing.assert_close(r[5][name], t, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {name}: {m}")
        # Everything but the norms (replicated) is sharded, in the layout the docstring promises.
        spec = results[0][1]
        assert spec["layers.0.attn.wq.weight"] == ("tp", 0) and spec["layers.0.attn.wo.weight"] == ("tp", 1)
        assert spec["layers.0.mlp.w_down.weight"] == ("tp", 1) and spec["embed.weight"] == ("tp", 0)
        assert all(s is not None for n, s in spec.items() if "norm" not in n), what


LAYER_VARIANTS = [(True, False), (False, False), (True, True)]  # (sequence_parallel, qk_norm)


def _layer_bytes_rank(rank, world_size):
    stats = CommStats(keep_events=True)
    mesh = build_mesh(ParallelDims(tp=world_size), device_type="cpu", stats=stats)
    out = []
    for sequence_parallel, qk_norm in LAYER_VARIANTS:
        cfg = ModelConfig(**dict(DENSE, num_layers=1, qk_norm=qk_norm))
        model = apply_tensor_parallel(build_model(cfg, seed=SEED), mesh, sequence_parallel=sequence_parallel)
        block = model.layers["0"]
        x = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
        if sequence_parallel:
            x = x.chunk(world_size, dim=1)[rank]
        x.requires_grad_(True)
        cos, sin = rope_cos_sin(model.inv_freq, torch.arange(SEQ), x.dtype)
        stats.reset()
        block(x, cos, sin).sum().backward()
        out.append(Counter((e.op, e.axis, e.bytes) for e in stats.events))
    return out


def test_layer_comm_bytes():
    """One block, forward + backward, fp32: the formula of the tensor.py docstring, exactly."""
    per_rank = run_distributed(_layer_bytes_rank, 2)
    act = 4 * BATCH * SEQ * DENSE["hidden_size"]
    head_dim = DENSE["hidden_size"] // DENSE["num_heads"]
    for i, (sequence_parallel, qk_norm) in enumerate(LAYER_VARIANTS):
        if sequence_parallel:
            want = Counter({("all_gather", "tp", act): 4, ("reduce_scatter", "tp", act): 4,
                            ("all_reduce", "tp", 4 * DENSE["hidden_size"]): 2})
        else:
            want = Counter({("all_reduce", "tp", act): 4})
        if qk_norm:
            want[("all_reduce", "tp", 4 * head_dim)] += 2
        for r in per_rank:
            assert r[i] == want, (sequence_parallel, qk_norm)


def _cross_entropy_rank(rank, world_size):
    stats = CommStats(keep_events=True)
    mesh = build_mesh(ParallelDims(tp=world_size), device_type="cpu", stats=stats)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 5, 12, generator=g) * 4
    targets = torch.randint(0, 12, (3, 5), generator=g)
    targets[0, 1] = -100
    out = {}
    for reduction in ("mean", "sum", "none"):
        local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, targets, mesh, reduction=reduction)
        (loss * torch.arange(1, loss.numel() + 1).reshape(loss.shape)).sum().backward()
        out[reduction] = (loss.detach(), local.grad)
    return out, Counter((e.op, e.axis, e.bytes) for e in stats.events), logits, targets


def test_vocab_parallel_cross_entropy():
    results = run_distributed(_cross_entropy_rank, 2)
    _, events, logits, targets = results[0]
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_(True)
        want = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction=reduction)
        want = want.reshape(targets.shape) if reduction == "none" else want
        (want * torch.arange(1, want.numel() + 1).reshape(want.shape)).sum().backward()
        grad = torch.cat([r[0][reduction][1] for r in results], dim=-1)
        for r in results:
            torch.testing.assert_close(r[0][reduction][0], want.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, full.grad, rtol=1e-6, atol=1e-6)
    # max, sum of exponentials, target logit: one float per token each, per call.
    assert events == Counter({("all_reduce", "tp", 4 * 15): 9})


def test_one_rank_cross_entropy_is_plain():
    mesh = build_mesh(ParallelDims(tp=1), device_type="cpu")
    logits, targets = torch.randn(4, 7), torch.tensor([0, 6, 3, -100])
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, targets, mesh), F.cross_entropy(logits, targets))


def _fake_mesh(tp: int) -> Mesh:
    # Validation runs before any collective, so a mesh without process groups is enough.
    return Mesh(ParallelDims(tp=tp, dp_shard=1), device_type="cpu", rank=0)


@pytest.mark.parametrize("overrides,tp,name", [
    (dict(num_heads=6, num_kv_heads=2, hidden_size=48), 4, "num_heads=6"),
    (dict(num_heads=4, num_kv_heads=1), 2, "num_kv_heads=1"),
    (dict(vocab_size=63), 2, "vocab_size=63"),
])
def test_bad_sizes_raise_clear_error(overrides, tp, name):
    model = build_model(ModelConfig(**dict(DENSE, **overrides)), seed=0)
    with pytest.raises(ValueError, match=rf"model\.{name} is not divisible by tp={tp}.*choose tp"):
        apply_tensor_parallel(model, _fake_mesh(tp))
    assert "_meshlm_shard" not in vars(model.layers["0"].attn.wq.weight)  # nothing was changed


def test_moe_is_refused():
    cfg = ModelConfig(**dict(DENSE, num_experts=4, num_experts_per_token=2))
    with pytest.raises(ValueError, match="MoE.*parallel.ep"):
        apply_tensor_parallel(build_model(cfg, seed=0), _fake_mesh(2))


def test_sequence_parallel_needs_divisible_sequence():
    model = apply_tensor_parallel(build_model(ModelConfig(**DENSE), seed=0), _fake_mesh(2))
    with pytest.raises(ValueError, match="sequence length 7 is not divisible by tp=2"):
        model(torch.zeros(1, 7, dtype=torch.long))


def test_applying_twice_is_refused():
    model = apply_tensor_parallel(build_model(ModelConfig(**DENSE), seed=0), _fake_mesh(2))
    with pytest.raises(ValueError, match="already"):
        apply_tensor_parallel(model, _fake_mesh(2))
