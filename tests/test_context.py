"""Context parallelism: the load-balanced split, ring, all-gather and Ulysses attention against dense causal SDPA
on the whole sequence (output and every gradient), and the exact bytes of each (meshlm.parallel.context).

Each rank holds its two chunks of q, k, v (`shard_sequence`), attends across the cp ranks and
backpropagates a fixed output gradient; the parent puts the pieces back in sequence order and
compares with one process's SDPA. In float64 to FP64_TOL, and in float32 to the issue's 1e-5.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.parallel.context import (
    allgather_attention,
    hybrid_attention,
    hybrid_mesh,
    local_positions,
    merge_partials,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from parity import FP64_TOL


def _qkv(*, batch, heads, kv_heads, seq, dim, dtype):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _dense(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


METHODS = ("ring", "allgather", "ulysses")
ATTEND = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
DTYPES = (torch.float64, torch.float32)


def attention_worker(rank, world_size, shape):
    """Every (method, dtype) on this rank's chunks: the whole output and gradients, and the bytes moved."""
    mesh = build_mesh(ParallelDims(cp=world_size), device_type="cpu")
    counts = lambda snap: {f"{op}/{axis}": (s.calls, s.bytes) for (op, axis), s in snap.items()}  # noqa: E731
    results = {}
    usp2 = hybrid_mesh(mesh, 2) if world_size == 4 else None
    for method in _methods(shape["heads"], world_size):
        attend = ATTEND[method] if method != "usp2" else (lambda q, k, v, _: hybrid_attention(q, k, v, usp2))
        for dtype in DTYPES:
            q, k, v, dout = _qkv(**shape, dtype=dtype)
            mine = [shard_sequence(t, cp=world_size, cp_rank=rank, dim=2).requires_grad_(True) for t in (q, k, v)]
            mesh.stats.reset()
            out = attend(*mine, mesh)
            fwd = counts(mesh.stats.snapshot())
            mesh.stats.reset()
            out.backward(shard_sequence(dout, cp=world_size, cp_rank=rank, dim=2))
            bwd = counts(mesh.stats.snapshot())
            full = [unshard_sequence(t, mesh, dim=2) for t in (out.detach(), *(m.grad for m in mine))]
            results[method, str(dtype)] = (full, fwd, bwd)
    return results


def _methods(heads: int, cp: int) -> list[str]:
    """Ulysses splits the heads over cp: only where cp divides them; the hybrid "usp2" (Ulysses over pairs of
    cp ranks, the ring across the pairs) at cp = 4."""
    return [m for m in METHODS if m != "ulysses" or heads % cp == 0] + (["usp2"] if cp == 4 else [])


SHAPES = {
    "gqa": dict(batch=2, heads=4, kv_heads=2, seq=16, dim=8),  # at cp=4 Ulysses replicates the 2 kv heads
    # chunks of 3 tokens (seq 12 over 2*cp=4, or 24 over 8): boundaries that are no power of two
    "odd_chunks": dict(batch=1, heads=2, kv_heads=1, seq=12, dim=4),
    "mha": dict(batch=1, heads=2, kv_heads=2, seq=24, dim=4),
}


@functools.lru_cache(maxsize=None)
def launched(cp: int, shape: str) -> list[dict]:
    """One multi-rank launch per (cp, shape), shared by the tests below."""
    return run_distributed(attention_worker, cp, SHAPES[shape])


@pytest.mark.parametrize("cp,shape", [(2, "gqa"), (2, "odd_chunks"), (4, "gqa"), (4, "mha")])
def test_attention_equals_dense_causal_sdpa(cp, shape):
    results = launched(cp, shape)
    for method in _methods(SHAPES[shape]["heads"], cp):
        for dtype in DTYPES:
            q, k, v, dout = _qkv(**SHAPES[shape], dtype=dtype)
            want = _dense(q, k, v, dout)
            tol = FP64_TOL if dtype == torch.float64 else 1e-5
            for rank, result in enumerate(results):
                got = result[method, str(dtype)][0]
                for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                    diff = (g - w).abs().max().item()
                    assert diff <= tol, f"rank {rank} {method} {dtype} cp={cp}: {name} differs by {diff:.3g} (> {tol})"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_equal_the_analytic_volume(method, cp):
    shape = SHAPES["gqa"]
    # One block: this rank's K or V, [batch, kv_heads, seq / cp, dim] in fp32.
    block = shape["batch"] * shape["kv_heads"] * shape["seq"] // cp * shape["dim"] * 4
    for result in launched(cp, "gqa"):
        _, fwd, bwd = result[method, str(torch.float32)]
        if method == "ring":
            # forward: (cp-1) blocks of K+V sent (and received); backward: the same K+V again plus
            # (cp-1) partial dK+dV sums.
            assert fwd == {"send/cp": (cp - 1, (cp - 1) * 2 * block), "recv/cp": (cp - 1, (cp - 1) * 2 * block)}
            assert bwd["send/cp"] == (2 * (cp - 1), (cp - 1) * 2 * block * 2)
            assert bwd["recv/cp"] == (2 * (cp - 1), (cp - 1) * 2 * block * 2)
        elif method == "allgather":
            # all_gather counts its output (cp blocks of K+V); reduce_scatter its input (the same).
            assert fwd == {"all_gather/cp": (1, cp * 2 * block)}
            assert bwd == {"reduce_scatter/cp": (1, cp * 2 * block)}
        else:
            # all_to_all counts its whole input: q, k, v (kv heads replicated to g = lcm(kv_heads, cp)) of this
            # rank's tokens, then the output; backward the inverse exchanges of the same sizes.
            head = block // shape["kv_heads"]  # one head of this rank's tokens
            h, g = shape["heads"], math.lcm(shape["kv_heads"], cp)
            assert fwd == bwd == {"all_to_all/cp": (2, head * (h + 2 * g) + head * h)}


def test_hybrid_bytes_equal_the_analytic_volume():
    cp, shape = 4, SHAPES["gqa"]
    block = shape["batch"] * shape["kv_heads"] * shape["seq"] // cp * shape["dim"] * 4  # as above
    # the hybrid (U = 2): Ulysses' all-to-alls over the pair (kv heads as they are: g = lcm(2, U) = 2), then
    # the ring over cp / U = 2 pairs, one step, whose K (or V) block is the pair's U x seq / cp tokens at
    # g / U kv heads: head x g bytes; backward K+V and dK+dV (fp32)
    h, g = shape["heads"], 2
    head = block // shape["kv_heads"]
    kv = 2 * head * g
    for result in launched(cp, "gqa"):
        _, fwd, bwd = result["usp2", str(torch.float32)]
        a2a = (2, head * (h + 2 * g) + head * h)
        assert fwd == {"all_to_all/cp_ulysses": a2a, "send/cp_ring": (1, kv), "recv/cp_ring": (1, kv)}
        assert bwd == {"all_to_all/cp_ulysses": a2a, "send/cp_ring": (2, 2 * kv), "recv/cp_ring": (2, 2 * kv)}


def test_split_is_load_balanced_and_positions_are_true():
    seq, cp = 16, 4
    tokens = torch.arange(seq)[None]
    pieces = [shard_sequence(tokens, cp=cp, cp_rank=r) for r in range(cp)]
    assert pieces[0].tolist() == [[0, 1, 14, 15]] and pieces[3].tolist() == [[6, 7, 8, 9]]
    for r, piece in enumerate(pieces):
        assert piece[0].tolist() == local_positions(seq, cp=cp, cp_rank=r).tolist()
        # causal work: each token attends to position + 1 keys; every rank gets the same total
        assert int((piece + 1).sum()) == (seq * (seq + 1) // 2) // cp
    assert sorted(torch.cat(pieces, 1)[0].tolist()) == list(range(seq))
    with pytest.raises(ValueError, match="multiple of 8"):
        local_positions(12, cp=4, cp_rank=0)


def test_merge_partials_is_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 10, generator=g, dtype=torch.float64)
    v = torch.randn(10, 4, generator=g, dtype=torch.float64)
    parts = []
    for cols in (slice(0, 4), slice(4, 10)):
        lse = torch.logsumexp(s[:, cols], -1)
        parts.append((torch.softmax(s[:, cols], -1) @ v[cols], lse))
    out, lse = merge_partials(*parts[0], *parts[1])
    assert torch.allclose(out, torch.softmax(s, -1) @ v, atol=1e-14)
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-14)


MEMORY_MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                    max_seq_len=256)


def saved_bytes_worker(rank, world_size, seq, method):
    """Bytes autograd keeps for backward in one forward + loss of this rank's part of a batch of 2 sequences."""
    from meshlm.config import ModelConfig
    from meshlm.models.transformer import build_model
    from meshlm.parallel.context import apply_context_parallel
    from meshlm.parallel.recompute import SavedTensorMeter

    model = build_model(ModelConfig(**MEMORY_MODEL), seed=0)
    tokens = torch.randint(0, 64, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y, positions = tokens[:, :-1], tokens[:, 1:], None
    if world_size > 1:
        handle = apply_context_parallel(model, build_mesh(ParallelDims(cp=world_size), device_type="cpu"),
                                        method=method)
        x, y, positions = handle.shard(x), handle.shard(y), handle.positions(seq)
    with SavedTensorMeter(model) as meter:
        loss = F.cross_entropy(model(x, positions=positions).flatten(0, 1), y.flatten(), reduction="sum")
    loss.backward()
    return meter.bytes


def test_activation_bytes_per_rank_fall_as_one_over_cp():
    seq = 256
    series = {1: saved_bytes_worker(0, 1, seq, "ring")}
    for cp in (2, 4):
        per_rank = run_distributed(saved_bytes_worker, cp, seq, "ring")
        assert len(set(per_rank)) == 1, per_rank  # the balanced split: every rank keeps the same
        series[cp] = per_rank[0]
    print("activation bytes per rank at seq", seq, {cp: f"{b / 2**20:.3f} MiB" for cp, b in series.items()})
    # Everything a rank keeps is per local token: cp=4 keeps half of cp=2 (up to a few bytes of int64
    # positions); against cp=1, whose dense SDPA keeps a little more than the ring's q, k, v, out, lse,
    # within 6%.
    assert abs(series[4] * 2 - series[2]) <= 16, series
    for cp in (2, 4):
        assert 0.94 <= series[cp] * cp / series[1] <= 1.0, series


def test_ulysses_refuses_heads_that_cp_does_not_divide():
    from meshlm.parallel.context import check_ulysses, ulysses_kv_heads

    check_ulysses(8, 2, cp=4)  # kv heads fewer than cp: replicated, not refused
    assert ulysses_kv_heads(2, 4) == 4 and ulysses_kv_heads(6, 4) == 12 and ulysses_kv_heads(8, 4) == 8
    with pytest.raises(ValueError, match=r"parallel.cp=4 with model.num_heads=6: .*parallel.cp in \{2,3,6\}"):
        check_ulysses(6, 2, cp=4)
    with pytest.raises(ValueError, match=r"num_heads=8 / parallel.tp=4 = 2 per tp rank"):
        check_ulysses(8, 4, cp=4, tp=4)
