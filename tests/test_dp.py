"""Data parallelism reproduces the single-process run, and all-reduces exactly the gradient bytes.

A self-contained loop (tiny model, AdamW, global-norm clipping): the same global batch each step,
rank r takes the r-th contiguous slice, loss = sum(token losses) / tokens in the global batch.
Each layout runs in fp64 (losses, grad norms, the first step's gradients and the final weights to
FP64_TOL), two of them also in fp32 (the real dtype: losses and grad norms to FP32_REL); tests/parity.py
says why.
"""

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from meshlm.comm_stats import CommEvent, CommStats
from meshlm.config import ModelConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models.transformer import build_model
from meshlm.parallel.data import apply_data_parallel
from parity import FP32_REL, FP64_TOL, assert_close_seq, assert_state_close

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 8
SEED = 7
BUCKET_MB = 0.01  # ~10 KB: several buckets even for the tiny model
CFG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
           intermediate_size=64, max_seq_len=16)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    seqs = torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    return seqs[:, :-1], seqs[:, 1:]


def _loss(model, inputs, targets, global_tokens: int) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / global_tokens


def _grad_norm(grads):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _step(model, opt, norm_fn) -> float:
    """Clip, step, zero; returns the gradient norm before clipping.

    The norm is what shows a gradient scaled by a constant (e.g. reduced twice): AdamW's update
    and the clipping are nearly invariant to that scale, so the weights alone would not.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = norm_fn(grads)
    factor = torch.clamp(1.0 / (total + 1e-6), max=1.0)  # clip at global norm 1.0
    for g in grads:
        g.mul_(factor)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _config(tied: bool) -> ModelConfig:
    return ModelConfig(**CFG, tie_embeddings=tied)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def reference(accum: int, dtype=torch.float32, tied: bool = False) -> dict:
    model = build_model(_config(tied), seed=SEED, dtype=dtype)
    opt = _optimizer(model)
    losses, norms, first_grads = [], [], None
    for step in range(STEPS):
        inputs, targets = _batch(step)
        total = 0.0
        for mi, mt in zip(inputs.chunk(accum), targets.chunk(accum)):
            loss = _loss(model, mi, mt, targets.numel())
            loss.backward()
            total += loss.item()
        losses.append(total)
        first_grads = first_grads or _grads(model)
        norms.append(_step(model, opt, _grad_norm))
    return {"losses": losses, "norms": norms, "grads": first_grads,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def dp_worker(rank, world_size, accum: int, drift: bool, tied: bool, dtypes: list):
    """Every dtype in one launch: process start-up costs more than the few steps of the tiny model."""
    return {dtype: _train(rank, world_size, accum, drift, tied, dtype) for dtype in dtypes}


def _train(rank, world_size, accum: int, drift: bool, tied: bool, dtype) -> dict:
    mesh = build_mesh(ParallelDims(), device_type="cpu", stats=CommStats(keep_events=True))
    assert mesh.size("dp") == world_size
    # A replica built with another seed must be brought back by the initial broadcast.
    model = build_model(_config(tied), seed=SEED + (rank if drift else 0), dtype=dtype)
    dp = apply_data_parallel(model, mesh, bucket_size_mb=BUCKET_MB)
    assert [e.op for e in mesh.stats.events] == ["broadcast"] * len(dp.buckets)
    opt = _optimizer(model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # = the gradient bytes
    assert sum(dp.bucket_bytes) == grad_bytes and len(dp.buckets) > 1
    partial_losses, norms, per_step_events, first_grads = [], [], [], None
    for step in range(STEPS):
        mesh.stats.reset()
        inputs, targets = _batch(step)
        local = GLOBAL_BATCH // world_size
        mine_in, mine_tg = inputs[rank * local:(rank + 1) * local], targets[rank * local:(rank + 1) * local]
        total = 0.0
        micro = list(zip(mine_in.chunk(accum), mine_tg.chunk(accum)))
        for i, (mi, mt) in enumerate(micro):
            last = i == len(micro) - 1
            with dp.no_sync() if not last else torch.enable_grad():
                loss = _loss(model, mi, mt, targets.numel())
                loss.backward()
            if not last:
                assert mesh.stats.events == []  # accumulation steps communicate nothing
            total += loss.item()
        dp.finish_grad_sync()  # already done at the end of backward: must be a no-op
        per_step_events.append(list(mesh.stats.events))
        partial_losses.append(total)
        first_grads = first_grads or _grads(model)
        norms.append(_step(model, opt, dp.grad_norm_fn))
    expected = [CommEvent("all_reduce", "dp", n) for n in dp.bucket_bytes]
    assert all(events == expected for events in per_step_events), per_step_events[0]
    # buckets hold whole tensors in reverse registration order (the order backward produces them)
    names = [n for b in dp.buckets for n in b.names]
    assert names == [n for n, _ in model.named_parameters()][::-1]  # (named_parameters skips tied repeats)
    return {"losses": partial_losses, "norms": norms, "grads": first_grads,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


BOTH = [torch.float32, torch.float64]


@pytest.mark.parametrize("world_size,accum,drift,tied,dtypes",
                         [(2, 1, True, False, [torch.float64]), (2, 2, False, True, BOTH),
                          (4, 1, False, False, [torch.float64]), (4, 2, True, False, BOTH)],
                         ids=["2-1-drift-fp64", "2-2-tied", "4-1-fp64", "4-2-drift"])
def test_dp_matches_single_process(world_size, accum, drift, tied, dtypes):
    """fp64, every layout: losses, grad norms, the first step's gradients and the final weights to
    FP64_TOL (exactness, on any CPU). fp32 (the real dtype), both world sizes: losses and grad norms
    to FP32_REL.

    drift: replicas start from different weights and the initial broadcast must repair that;
    tied: the embedding is also the output head (one parameter, two uses, one gradient hook).
    """
    results = run_distributed(dp_worker, world_size, accum, drift, tied, dtypes, timeout=90)
    for dtype in dtypes:
        ref = reference(accum, dtype, tied)
        exact = dtype == torch.float64
        tol = FP64_TOL if exact else FP32_REL
        where = f"dp={world_size} accum={accum} drift={drift} tied={tied} {dtype}"
        # each rank holds its slice's share of the global mean loss: the sum over ranks is the loss
        global_losses = [sum(r[dtype]["losses"][s] for r in results) for s in range(STEPS)]
        assert_close_seq(global_losses, ref["losses"], rtol=tol, what=f"{where}: loss")
        for rank, r in enumerate(results):  # every rank holds the summed gradient: the single-process norm
            assert_close_seq(r[dtype]["norms"], ref["norms"], rtol=tol, what=f"{where} rank {rank}: grad norm")
            if exact:
                assert_state_close(r[dtype]["grads"], ref["grads"], atol=tol, what=f"{where} rank {rank}: step-0 grads")
                assert_state_close(r[dtype]["weights"], ref["weights"], atol=tol, what=f"{where} rank {rank}: weights")
        # the weights moved: parity is not trivially satisfied
        initial = build_model(_config(tied), seed=SEED, dtype=dtype).state_dict()
        assert not torch.allclose(ref["weights"]["layers.0.attn.wq.weight"], initial["layers.0.attn.wq.weight"])


def test_one_rank_dp_is_a_no_op():
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    model = build_model(ModelConfig(**CFG), seed=SEED)
    dp = apply_data_parallel(model, mesh)
    inputs, targets = _batch(0)
    _loss(model, inputs, targets, targets.numel()).backward()
    dp.finish_grad_sync()
    assert mesh.stats.total().calls == 0 and all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="bucket_size_mb"):
        apply_data_parallel(model, mesh, bucket_size_mb=0)


class TwoBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        return self.b(self.a(x)) if use_b else self.a(x)


def unused_worker(rank, world_size):
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    torch.manual_seed(0)
    model = TwoBranch().double()  # fp64: the sum is compared to FP64_TOL
    dp = apply_data_parallel(model, mesh, bucket_size_mb=1e-5)  # one bucket per tensor
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    model(x, use_b=rank == 0).sum().backward()  # rank 1 never touches b
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(dp.buckets)


def test_parameter_unused_on_one_rank_still_gets_the_sum():
    results = run_distributed(unused_worker, 2, timeout=60)
    torch.manual_seed(0)
    model = TwoBranch().double()
    for rank in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        model(x, use_b=rank == 0).sum().backward()
    for rank, (grads, num_buckets) in enumerate(results):
        assert num_buckets == 4
        assert_state_close(grads, {n: p.grad for n, p in model.named_parameters()}, atol=FP64_TOL,
                           what=f"rank {rank}: grads")
