"""Expert parallelism reproduces the single-process MoE and moves exactly the bytes documented in
meshlm.parallel.expert.

Each rank builds the reference model (same seed), attaches the ep groups (`expert_mesh`), applies
`apply_expert_parallel` and feeds its OWN tokens (a different number per rank, so splits are uneven).
The parent runs the dense reference on every rank's tokens and compares, in float64 to FP64_TOL:
outputs per rank; router / shared-expert gradients summed over ranks; expert gradients summed over
"ep_dp" (the ranks holding the same experts) against the dense gradient's slice.
"""

import pytest
import torch

from dist import run_distributed
from meshlm import comm
from meshlm.comm_stats import CommStats
from meshlm.config import ModelConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.models.moe import MoE, drop_over_capacity
from meshlm.parallel.expert import (
    apply_expert_parallel,
    ep_dp_group_ranks,
    ep_group_ranks,
    expert_load_stats,
    expert_mesh,
    update_router_biases,
)
from parity import FP64_TOL, assert_close_seq, assert_state_close

SEED = 7
HIDDEN = 16
MOE = dict(vocab_size=64, hidden_size=HIDDEN, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=32,
           max_seq_len=32, num_experts=8, num_experts_per_token=2, moe_intermediate_size=8, num_shared_experts=1,
           shared_expert_gate=True, first_dense_layers=1)
LAYOUTS = {  # name: (world size, ParallelDims kwargs, ep)
    "w2_ep2": (2, dict(dp_shard=2), 2),
    "w4_ep2": (4, dict(dp_shard=4), 2),
    "w4_ep4": (4, dict(dp_shard=4), 4),
    "w4_rep2_ep2": (4, dict(dp_replicate=2, dp_shard=2), 2),  # ep_dp spans the replicas
    "w4_cp2_ep4": (4, dict(dp_shard=2, cp=2), 4),  # experts spread over dp_shard x cp
}
EXPERT_PARAMS = ("experts.w_gate", "experts.w_up", "experts.w_down")


def _num_tokens(rank):
    return 5 + 3 * rank


def _tokens(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(_num_tokens(rank), HIDDEN, generator=g, dtype=torch.float64)
    cotangent = torch.randn(_num_tokens(rank), HIDDEN, generator=g, dtype=torch.float64)
    return x, cotangent


def _moe(**overrides) -> MoE:
    return build_model(ModelConfig(**{**MOE, **overrides}), seed=SEED, dtype=torch.float64).layers["1"].mlp


# --------------------------------------------------------------------------------------------
# Placement (pure rank arithmetic, no processes)
# --------------------------------------------------------------------------------------------


def test_ep_groups_are_runs_of_dp_shard_cp_and_ep_dp_holds_the_same_experts():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2).resolve(8)  # dp_shard_cp groups {0,1,2,3}, {4,5,6,7}
    assert ep_group_ranks(dims, 5, 2) == [4, 5]
    assert ep_group_ranks(dims, 6, 4) == [4, 5, 6, 7]
    assert ep_dp_group_ranks(dims, 5, 2) == [1, 3, 5, 7]  # position 1 of every ep group, both replicas
    assert ep_dp_group_ranks(dims, 6, 4) == [2, 6]
    assert ep_dp_group_ranks(dims, 0, 1) == [0, 1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"parallel.ep=3 does not divide dp_shard x cp = 2 x 2 = 4 .*; choose ep in"):
        ep_group_ranks(dims, 0, 3)


def _duplicate_rank(rank, world_size):
    import torch.distributed as dist

    mesh = expert_mesh(build_mesh(ParallelDims(dp_shard=4, ep=2), device_type="cpu"), 2)
    twin = mesh.duplicate("ep", "ep_dp")
    out = {}
    for axis in ("ep", "ep_dp"):
        assert twin.group(axis) is not mesh.group(axis)
        out[axis] = (dist.get_process_group_ranks(twin.group(axis)), twin.ranks(axis),
                     comm.all_reduce(torch.tensor([rank]), twin, axis).item())
    bare = mesh.with_axes({"bare": (mesh.ranks("ep"), mesh.group("ep"))})  # no `every`: cannot be created again
    with pytest.raises(ValueError, match="without `every`"):
        bare.duplicate("bare")
    return out


def test_the_ep_axes_can_be_duplicated():
    """`Mesh.duplicate` creates the ep and ep_dp groups again (ZeRO-3 gathers the experts on its own groups)."""
    for rank, got in enumerate(run_distributed(_duplicate_rank, 4)):
        dims = ParallelDims(dp_shard=4, ep=2).resolve(4)
        for axis, members in (("ep", ep_group_ranks(dims, rank, 2)), ("ep_dp", ep_dp_group_ranks(dims, rank, 2))):
            assert got[axis] == (members, members, sum(members)), (rank, axis)


def test_one_process_ep1_is_the_reference_and_refuses_misuse():
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    with pytest.raises(ValueError, match="needs a mesh with an 'ep' axis"):
        apply_expert_parallel(_moe(), mesh)
    emesh = expert_mesh(mesh)
    assert (emesh.size("ep"), emesh.local_rank("ep"), emesh.group("ep"), emesh.ranks("ep_dp")) == (1, 0, None, [0])
    ref, moe = _moe(), apply_expert_parallel(_moe(), emesh)
    with pytest.raises(ValueError, match="applied to this model already"):
        apply_expert_parallel(moe, emesh)
    assert moe.experts.w_gate._meshlm_shard == ("ep", 0)
    x, _ = _tokens(0)
    torch.testing.assert_close(moe(x), ref(x), rtol=0, atol=0)


def test_grouped_mm_path_equals_the_loop():
    """torch's grouped matmul runs on CPU for float32 (not float64): both paths, same numbers."""
    emesh = expert_mesh(build_mesh(ParallelDims(), device_type="cpu"))
    moes = [build_model(ModelConfig(**MOE), seed=SEED).layers["1"].mlp for _ in range(2)]
    try:
        apply_expert_parallel(moes[0], emesh, grouped_mm=True)
    except ValueError as e:
        pytest.skip(f"no grouped matmul here: {e}")
    apply_expert_parallel(moes[1], emesh, grouped_mm=False)
    x = _tokens(0)[0].float()
    outs = [m(x) for m in moes]
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for name in EXPERT_PARAMS:
        torch.testing.assert_close(moes[0].get_parameter(name).grad, moes[1].get_parameter(name).grad,
                                   rtol=1e-5, atol=1e-6)


def test_capacity_drops_lowest_weight_first():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    w = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.6, 0.4], [0.7, 0.3]])
    # capacity = ceil(0.5 * 4 * 2 / 4) = 1: expert 0 keeps token 1 (0.9); expert 1 keeps token 0 (tie: earlier)
    kept, dropped = drop_over_capacity(idx, w, num_experts=4, capacity_factor=0.5)
    assert kept.tolist() == [[-1, 1], [0, 2], [-1, -1], [3, -1]] and int(dropped) == 4


def test_router_bias_steers_selection_only_and_counts_training_forwards():
    moe = _moe(router_bias_update_rate=0.01)
    x, _ = _tokens(0)
    moe.router_bias[3] = 10.0
    idx, weight, _ = moe.route(x)
    assert (idx == 3).any(dim=1).all()
    want = torch.softmax(moe.router(x), dim=-1).gather(-1, idx)
    torch.testing.assert_close(weight, want / want.sum(-1, keepdim=True), rtol=0, atol=1e-15)
    with torch.no_grad():
        moe(x)  # evaluation: not a load that steers the bias
    assert moe.load_since_update is None and moe.last_tokens_per_expert.sum() == x.shape[0] * 2
    moe(x), moe(x)
    load = moe.load_since_update.clone()
    assert load.sum() == 2 * x.shape[0] * 2
    update_router_biases(moe)
    assert moe.load_since_update is None
    torch.testing.assert_close(moe.router_bias - torch.tensor([0, 0, 0, 10.0, 0, 0, 0, 0]),
                               0.01 * torch.sign(load.float().mean() - load.float()))


# --------------------------------------------------------------------------------------------
# One MoE layer: parity, bytes, capacity
# --------------------------------------------------------------------------------------------


def _layer_rank(rank, world_size, dims_kw, ep, capacity_factor):
    stats = CommStats(keep_events=True)
    mesh = expert_mesh(build_mesh(ParallelDims(**dims_kw, ep=ep), device_type="cpu", stats=stats), ep)
    moe = apply_expert_parallel(_moe(capacity_factor=capacity_factor), mesh)
    x, cotangent = _tokens(rank)
    x.requires_grad_(True)
    stats.reset()
    out = moe(x)
    forward_events = [(e.op, e.axis, e.bytes) for e in stats.events]
    stats.reset()
    out.backward(cotangent)
    backward_events = [(e.op, e.axis, e.bytes) for e in stats.events]
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    for name in EXPERT_PARAMS:  # every rank's tokens contribute: sum over the holders of these experts
        grads[name] = comm.all_reduce(grads[name], mesh, "ep_dp")
    return dict(out=out.detach(), x_grad=x.grad, grads=grads, expert_range=moe.experts.expert_range,
                ep_ranks=mesh.ranks("ep"), ep_dp_ranks=mesh.ranks("ep_dp"), dropped=int(moe.last_dropped),
                forward_events=forward_events, backward_events=backward_events)


def _check_layer(layout, capacity_factor):
    world_size, dims_kw, ep = LAYOUTS[layout]
    per_rank = run_distributed(_layer_rank, world_size, dims_kw, ep, capacity_factor)
    dims = ParallelDims(**dims_kw, ep=ep).resolve(world_size)
    ref = _moe(capacity_factor=capacity_factor)
    routed, dropped = [], []  # per rank: the reference's kept expert ids and drop count
    for rank, got in enumerate(per_rank):
        x, cotangent = _tokens(rank)
        x.requires_grad_(True)
        out = ref(x)
        out.backward(cotangent)  # gradients accumulate over ranks: the dense gradient of the sum
        torch.testing.assert_close(got["out"], out.detach(), rtol=0, atol=FP64_TOL)
        torch.testing.assert_close(got["x_grad"], x.grad, rtol=0, atol=FP64_TOL)
        assert got["ep_ranks"] == ep_group_ranks(dims, rank, ep)
        assert got["ep_dp_ranks"] == ep_dp_group_ranks(dims, rank, ep)
        with torch.no_grad():
            kept, weight, _ = ref.route(x)
            if capacity_factor:
                kept = drop_over_capacity(kept, weight, num_experts=8, capacity_factor=capacity_factor)[0]
        routed.append(kept[kept >= 0])
        dropped.append(int(ref.last_dropped))
        assert got["dropped"] == dropped[-1]
    want = {name: p.grad for name, p in ref.named_parameters()}
    summed = {name: sum(r["grads"][name] for r in per_rank) for name in want if name not in EXPERT_PARAMS}
    assert_state_close(summed, {k: v for k, v in want.items() if k not in EXPERT_PARAMS}, atol=FP64_TOL,
                       what=f"{layout}: router + shared gradients summed over ranks")
    for rank, got in enumerate(per_rank):
        lo, hi = got["expert_range"]
        assert (lo, hi) == (got["ep_ranks"].index(rank) * 8 // ep, (got["ep_ranks"].index(rank) + 1) * 8 // ep)
        assert_state_close({n: got["grads"][n] for n in EXPERT_PARAMS}, {n: want[n][lo:hi] for n in EXPERT_PARAMS},
                           atol=FP64_TOL, what=f"{layout}: rank {rank} experts {lo}..{hi - 1}, summed over ep_dp")
        # Bytes: S rows out (this rank's kept assignments), R rows back (what its experts received).
        sent = routed[rank].numel()
        received = sum(int(((routed[r] >= lo) & (routed[r] < hi)).sum()) for r in got["ep_ranks"])
        row = HIDDEN * 8
        print(f"{layout} rank {rank}: {_num_tokens(rank)} tokens, sends S={sent} rows, its experts {lo}..{hi - 1} "
              f"receive R={received}; forward bytes {[e[2] for e in got['forward_events']]}, "
              f"backward {[e[2] for e in got['backward_events']]}")
        assert got["forward_events"] == [("all_to_all", "ep", 8 * 8), ("all_to_all", "ep", sent * row),
                                         ("all_to_all", "ep", received * row)], f"rank {rank}"
        assert got["backward_events"] == [("all_to_all", "ep", sent * row), ("all_to_all", "ep", received * row)]
        if not capacity_factor:
            assert sent == _num_tokens(rank) * 2  # dropless: tokens x top_k
    loads = torch.bincount(torch.cat(routed), minlength=8)
    assert loads.min() < loads.max(), f"{layout}: routing came out even {loads.tolist()}; pick other tokens"
    return dropped


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layer_matches_reference(layout):
    _check_layer(layout, capacity_factor=0.0)


@pytest.mark.parametrize("layout", ["w2_ep2", "w4_ep4"])
def test_capacity_factor_matches_reference(layout):
    dropped = _check_layer(layout, capacity_factor=0.75)
    assert sum(dropped) > 0, dropped
    print(f"{layout}: dropped per rank {dropped}")


def _one_sided_rank(rank, world_size):
    mesh = expert_mesh(build_mesh(ParallelDims(dp_shard=2, ep=2), device_type="cpu"), 2)
    moe = _one_sided(apply_expert_parallel(_moe(), mesh))
    x, cotangent = _tokens(rank)
    x[:, 0] = x[:, 0].abs() + 5
    out = moe(x)
    out.backward(cotangent)
    return out.detach(), {n: moe.get_parameter(n).grad for n in EXPERT_PARAMS}


def _one_sided(moe):
    with torch.no_grad():  # every token picks experts 0 and 1 (both on ep rank 0) when x[:, 0] > 0
        moe.router.weight.zero_()
        moe.router.weight[:2, 0] = 1.0
    return moe


def test_a_rank_whose_experts_get_no_tokens():
    """ep rank 1 receives nothing: no hang, and its experts' gradients are zeros rather than None."""
    (out0, grads0), (out1, grads1) = run_distributed(_one_sided_rank, 2)
    ref = _one_sided(_moe())
    for rank, out in enumerate((out0, out1)):
        x, _ = _tokens(rank)
        x[:, 0] = x[:, 0].abs() + 5
        torch.testing.assert_close(out, ref(x).detach(), rtol=0, atol=FP64_TOL)
    assert all(g is not None and not g.any() for g in grads1.values())
    assert all(g[:2].any() and not g[2:].any() for g in grads0.values())


# --------------------------------------------------------------------------------------------
# The whole model
# --------------------------------------------------------------------------------------------


def _model_tokens(rank):
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(200 + rank))


def _model_loss(model, tokens, global_count):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1),
                                             reduction="sum") / global_count


def _model_rank(rank, world_size, ep):
    mesh = expert_mesh(build_mesh(ParallelDims(dp_shard=world_size, ep=ep), device_type="cpu"), ep)
    model = apply_expert_parallel(build_model(ModelConfig(**MOE), seed=SEED, dtype=torch.float64), mesh)
    loss = _model_loss(model, _model_tokens(rank), world_size * 2 * 6)
    loss.backward()
    grads, ranges = {}, {}
    for name, p in model.named_parameters():
        if getattr(p, "_meshlm_shard", None) == ("ep", 0):
            grads[name] = comm.all_reduce(p.grad.clone(), mesh, "ep_dp")
            ranges[name] = model.get_submodule(name.rsplit(".", 1)[0]).expert_range
        else:
            grads[name] = p.grad.clone()
    return dict(loss=loss.item(), grads=grads, ranges=ranges, ep_bytes=mesh.stats.total(axis="ep").bytes)


@pytest.mark.parametrize("world_size,ep", [(2, 2), (4, 2)])
def test_whole_model_matches_reference(world_size, ep):
    per_rank = run_distributed(_model_rank, world_size, ep)
    ref = build_model(ModelConfig(**MOE), seed=SEED, dtype=torch.float64)
    losses = [_model_loss(ref, _model_tokens(r), world_size * 2 * 6) for r in range(world_size)]
    sum(losses).backward()
    assert_close_seq([sum(r["loss"] for r in per_rank)], [sum(losses).item()], rtol=FP64_TOL, what="loss")
    want = {name: p.grad for name, p in ref.named_parameters()}
    for rank, got in enumerate(per_rank):
        for name, (lo, hi) in got["ranges"].items():
            assert_state_close({name: got["grads"][name]}, {name: want[name][lo:hi]}, atol=FP64_TOL,
                               what=f"rank {rank} experts {lo}..{hi - 1}")
        assert got["ep_bytes"] > 0
    summed = {name: sum(r["grads"][name] for r in per_rank) for name in want if name not in per_rank[0]["ranges"]}
    assert_state_close(summed, {n: want[n] for n in summed}, atol=FP64_TOL, what="replicated gradients summed")


# --------------------------------------------------------------------------------------------
# Aux-loss-free balancing
# --------------------------------------------------------------------------------------------


def _balance_rank(rank, world_size, steps):
    stats = CommStats(keep_events=True)
    mesh = expert_mesh(build_mesh(ParallelDims(dp_shard=world_size, ep=2), device_type="cpu", stats=stats), 2)
    moe = _moe(router_bias_update_rate=0.003, num_shared_experts=0)
    u = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():  # a skewed router: every token's top choice is expert 0
        moe.router.weight[0] += 0.04 * u
    apply_expert_parallel(moe, mesh)
    g = torch.Generator().manual_seed(300 + rank)
    curve = []
    for _ in range(steps):
        x = torch.randn(48, HIDDEN, generator=g, dtype=torch.float64) + u
        moe(x).sum().backward()  # a training forward (the load counts) and the all-to-alls' backward
        curve.append(expert_load_stats(moe, mesh)[""]["imbalance"])
        stats.reset()
        update_router_biases(moe, mesh)
        update_events = [(e.op, e.axis, e.bytes) for e in stats.events]
    return dict(curve=curve, bias=moe.router_bias.clone(), update_events=update_events)


def test_aux_loss_free_balancing_evens_out_a_skewed_router():
    per_rank = run_distributed(_balance_rank, 2, 50)
    curve = per_rank[0]["curve"]
    print("imbalance (max/mean tokens per expert) over 50 bias updates:", " ".join(f"{c:.2f}" for c in curve))
    assert per_rank[1]["curve"] == curve and torch.equal(per_rank[0]["bias"], per_rank[1]["bias"])
    assert per_rank[0]["update_events"] == [("all_reduce", "dp_cp", 8 * 8)]  # one all_reduce of int64 loads
    assert curve[0] >= 3.5, curve[0]
    last = sum(curve[-5:]) / 5
    assert last < 0.5 * curve[0], f"imbalance {curve[0]:.2f} -> {last:.2f} (mean of the last 5 steps)"
    assert per_rank[0]["bias"][0] < 0 < per_rank[0]["bias"][1:].min()  # the hot expert pushed down, others up
