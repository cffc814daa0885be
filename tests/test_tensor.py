"""Tensor (+ sequence) parallelism reproduces the single-process reference, and moves exactly the bytes
documented in meshlm.parallel.tensor.

Each rank builds the reference model (same seed), applies `apply_tensor_parallel`, runs one
forward + backward with `vocab_parallel_cross_entropy` and one AdamW step, and returns its loss,
local gradients and updated local weights; the parent concatenates the shards along their
`_meshlm_shard` dim and compares them with the one-process run: in float64 everything (loss, grad
norm, every gradient, the updated weights, the gathered checkpoint) to FP64_TOL; in float32, the
real dtype, the loss and the grad norm to FP32_REL (tests/parity.py says why).
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from meshlm.comm_stats import CommStats
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
from parity import FP32_REL, FP64_TOL, assert_close_seq, assert_state_close

SEED = 3
BATCH, SEQ = 2, 8
DENSE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=64, max_seq_len=16)
# Qwen2-style q/k/v bias, Qwen3-style q/k norm and tied embeddings in one tiny model.
BIAS = dict(DENSE, attention_bias=True, qk_norm=True, tie_embeddings=True)
# tp=4 needs kv heads divisible by 4.
WIDE = dict(DENSE, num_heads=8, num_kv_heads=4)
CONFIGS = {"dense": DENSE, "bias_qknorm_tied": BIAS, "dense_8_heads": WIDE}
DTYPES = (torch.float32, torch.float64)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(11)
    seqs = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return seqs[:, :-1], seqs[:, 1:]


def _optimizer(model):
    # Adam's first step is lr * g / (|g| + eps): sign-like, so it would magnify an fp32 rounding
    # difference of a tiny gradient entry to ~lr; the weights are compared in fp64 only.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _make_bias_nonzero(model):
    # The reference initialises biases to zero, which would hide a bias sharded wrongly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)


def _reference(cfg_kwargs, dtype):
    cfg = ModelConfig(**cfg_kwargs)
    model = build_model(cfg, seed=SEED, dtype=dtype)
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
    """One spawn for several (config, sequence_parallel, dtype) variants: process start-up dominates the cost."""
    mesh = build_mesh(ParallelDims(tp=world_size), device_type="cpu")
    out = []
    for config, sequence_parallel, dtype in variants:
        cfg = ModelConfig(**CONFIGS[config])
        model = build_model(cfg, seed=SEED, dtype=dtype)
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
        fresh = apply_tensor_parallel(build_model(cfg, seed=SEED + 1, dtype=dtype), mesh,
                                      sequence_parallel=sequence_parallel)
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


VARIANTS = {2: [(c, sp, dtype) for c in ("dense", "bias_qknorm_tied") for sp in (True, False) for dtype in DTYPES],
            4: [("dense_8_heads", True, dtype) for dtype in DTYPES]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_matches_reference(world_size):
    """Loss, grad norm, every gradient (shards concatenated), the weights after one AdamW step and the
    gathered checkpoint: fp64 all of them, to FP64_TOL; fp32 the loss and the grad norm, to FP32_REL."""
    variants = VARIANTS[world_size]
    per_rank = run_distributed(_tp_rank, world_size, variants)
    for i, (config, sequence_parallel, dtype) in enumerate(variants):
        what = f"{config} tp={world_size} sequence_parallel={sequence_parallel} {dtype}"
        exact = dtype == torch.float64
        tol = FP64_TOL if exact else FP32_REL
        results = [r[i] for r in per_rank]
        ref_loss, ref_grads, ref_params, ref_norm, ref_state = _reference(CONFIGS[config], dtype)
        grads, params = _assemble(results, 2), _assemble(results, 3)  # replicated tensors: equal on every rank
        for rank, r in enumerate(results):
            assert_close_seq([r[0]], [ref_loss], rtol=tol, what=f"{what} rank {rank}: loss")
            assert_close_seq([r[4]], [ref_norm], rtol=tol, what=f"{what} rank {rank}: tensor_parallel_grad_norm")
            if exact:  # full_state_dict: the reference's names and tensors
                assert_state_close(r[5], ref_state, atol=tol, what=f"{what} rank {rank}: full_state_dict")
        if exact:
            assert_state_close(grads, ref_grads, atol=tol, what=f"{what}: grads")
            assert_state_close(params, ref_params, atol=tol, what=f"{what}: weights after AdamW")
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
    logits = torch.randn(3, 5, 12, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(0, 12, (3, 5), generator=g)
    targets[0, 1] = -100
    out = {}
    for dtype in DTYPES:
        stats.reset()
        for reduction in ("mean", "sum", "none"):
            local = logits.to(dtype).chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(local, targets, mesh, reduction=reduction)
            (loss * torch.arange(1, loss.numel() + 1).reshape(loss.shape)).sum().backward()
            out[dtype, reduction] = (loss.detach(), local.grad)
        out[dtype, "events"] = Counter((e.op, e.axis, e.bytes) for e in stats.events)
    return out, logits, targets


def test_vocab_parallel_cross_entropy():
    """fp64: per-token losses and the logits' gradient to FP64_TOL; fp32: the mean and summed loss to
    FP32_REL. Both: the bytes."""
    results = run_distributed(_cross_entropy_rank, 2)
    _, logits, targets = results[0]
    for dtype in DTYPES:
        for reduction in ("mean", "sum", "none"):
            what = f"{dtype} reduction={reduction}"
            full = logits.to(dtype).clone().requires_grad_(True)
            want = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction=reduction)
            want = want.reshape(targets.shape) if reduction == "none" else want
            (want * torch.arange(1, want.numel() + 1).reshape(want.shape)).sum().backward()
            grad = torch.cat([r[0][dtype, reduction][1] for r in results], dim=-1)
            for rank, r in enumerate(results):
                loss = r[0][dtype, reduction][0]
                if dtype == torch.float64:
                    assert_state_close({"loss": loss}, {"loss": want.detach()}, atol=FP64_TOL,
                                       what=f"{what} rank {rank}")
                elif reduction != "none":  # per-token fp32 losses near 0 have no meaningful relative error
                    assert_close_seq([loss], [want.detach()], rtol=FP32_REL, what=f"{what} rank {rank}")
            if dtype == torch.float64:
                assert_state_close({"logits": grad}, {"logits": full.grad}, atol=FP64_TOL, what=f"{what}: grad")
        # max, sum of exponentials, target logit: one float per token each, per call.
        size = torch.finfo(dtype).bits // 8
        for r in results:
            assert r[0][dtype, "events"] == Counter({("all_reduce", "tp", size * 15): 9}), dtype


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


def test_a_capacity_factor_under_sequence_parallelism_is_refused():
    # Dropless MoE layers run under SP on each rank's chunk (parity: tests/test_train_ep.py); a capacity is a
    # share of the whole micro-batch's tokens, which no rank sees.
    cfg = ModelConfig(**dict(DENSE, num_experts=4, num_experts_per_token=2, capacity_factor=1.0))
    with pytest.raises(ValueError, match="capacity_factor=1.0 with tensor parallelism.*capacity_factor=0"):
        apply_tensor_parallel(build_model(cfg, seed=0), _fake_mesh(2))


def test_sequence_parallel_needs_divisible_sequence():
    model = apply_tensor_parallel(build_model(ModelConfig(**DENSE), seed=0), _fake_mesh(2))
    with pytest.raises(ValueError, match="sequence length 7 is not divisible by tp=2"):
        model(torch.zeros(1, 7, dtype=torch.long))


def test_applying_twice_is_refused():
    model = apply_tensor_parallel(build_model(ModelConfig(**DENSE), seed=0), _fake_mesh(2))
    with pytest.raises(ValueError, match="already"):
        apply_tensor_parallel(model, _fake_mesh(2))
