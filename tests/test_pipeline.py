"""Pipeline runtime (meshlm.parallel.pipeline) against one process, in float64.

One `run_distributed` launch per world size runs every configuration: each rank splits a fresh
model, runs one pipeline step over the same micro-batches, and returns its loss, its gradients by
name, the order of its actions, its p2p bytes and its peak of held activations. The test merges the
gradients of all stages (each parameter lives on exactly one) and compares them with the single-
process step.
"""

import pytest
import torch

from meshlm.config import ModelConfig
from meshlm.models import build_model
from meshlm.parallel.pipeline import PipelineStage, run_pipeline_step, split_model, token_loss_sum
from meshlm.schedules import build_schedule, simulate
from meshlm.timeline import TimedAction, measured_overheads, measured_timeline, simulate_measured
from dist import run_distributed
from parity import FP64_TOL, assert_close_seq, assert_state_close

SEED = 7
MICRO, SEQ = 2, 8
MODEL = dict(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, max_seq_len=32)

# (schedule, pp_chunks, num_microbatches, num_layers, layers_per_stage)
CONFIGS = {
    2: [(name, 2 if name == "interleaved" else 1, m, 4, None)
        for name in ("gpipe", "1f1b", "interleaved", "zero_bubble") for m in (4, 8)]
       + [("1f1b", 1, 4, 3, None), ("zero_bubble", 1, 4, 5, None), ("gpipe", 1, 4, 5, [4, 1])],
    4: [(name, 2 if name == "interleaved" else 1, m, 8, None)
        for name in ("gpipe", "1f1b", "interleaved", "zero_bubble") for m in (4, 8)],
}


def _model_config(num_layers: int) -> ModelConfig:
    return ModelConfig(**MODEL, num_layers=num_layers)


def _micro_batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED + m)
    tokens = torch.randint(0, MODEL["vocab_size"], (m, MICRO, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference(num_layers: int, m: int) -> tuple[float, dict]:
    model = build_model(_model_config(num_layers), seed=SEED, dtype=torch.float64)
    num_tokens = m * MICRO * SEQ
    loss = 0.0
    for inputs, targets in _micro_batches(m):
        part = token_loss_sum(model(inputs), targets) / num_tokens
        part.backward()
        loss += float(part.detach())
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _pipeline_rank(rank, world_size):
    from meshlm.mesh import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims(pp=world_size), device_type="cpu")
    out = []
    for name, v, m, num_layers, counts in CONFIGS[world_size]:
        model = build_model(_model_config(num_layers), seed=SEED, dtype=torch.float64)
        stage = split_model(model, pp_rank=mesh.local_rank("pp"), pp=world_size, pp_chunks=v, layers_per_stage=counts)
        sched = build_schedule(name, pp=world_size, num_microbatches=m, pp_chunks=v)
        mesh.stats.reset()
        res = run_pipeline_step(stage, sched, _micro_batches(m), mesh=mesh, num_tokens=m * MICRO * SEQ)
        sent = mesh.stats.total(op="send", axis="pp")
        received = mesh.stats.total(op="recv", axis="pp")
        # forward only (validation): the same loss, no gradient touched
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        fwd = run_pipeline_step(stage, sched, _micro_batches(m), mesh=mesh, num_tokens=m * MICRO * SEQ,
                                forward_only=True)
        unchanged = all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
        out.append(dict(loss=float(res.loss), fwd_loss=float(fwd.loss), unchanged=unchanged, grads=grads,
                        order=[t.action for t in res.timeline], sent=sent.bytes, received=received.bytes,
                        peak=res.peak_activations, timeline=[(t.action, t.start, t.end) for t in res.timeline],
                        t0_wall=res.t0_wall, seconds=res.seconds,
                        modules=(model.embed is not None, model.lm_head is not None, sorted(model.layers.keys()))))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_matches_one_process(world_size):
    results = run_distributed(_pipeline_rank, world_size, timeout=240)
    act_bytes = MICRO * SEQ * MODEL["hidden_size"] * 8  # float64
    for k, (name, v, m, num_layers, counts) in enumerate(CONFIGS[world_size]):
        what = f"{name} pp={world_size} v={v} m={m} layers={num_layers}{counts or ''}"
        ranks = [r[k] for r in results]
        ref_loss, ref_grads = _reference(num_layers, m)
        for r, got in enumerate(ranks):
            assert_close_seq([got["loss"], got["fwd_loss"]], [ref_loss, ref_loss], rtol=FP64_TOL,
                             what=f"{what} loss on rank {r}")
            assert got["unchanged"], f"{what}: the forward-only step changed gradients on rank {r}"
        # every parameter on exactly one stage; together they are the whole model
        merged = {}
        for got in ranks:
            assert not merged.keys() & got["grads"].keys(), f"{what}: a parameter lives on two stages"
            merged.update(got["grads"])
        assert_state_close(merged, ref_grads, atol=FP64_TOL, what=f"{what} gradients")
        sched = build_schedule(name, pp=world_size, num_microbatches=m, pp_chunks=v)
        for r, got in enumerate(ranks):
            assert got["order"] == list(sched.ranks[r]), f"{what}: rank {r} ran its actions out of order"
        # each of the S - 1 stage boundaries carries m activations forward and m gradients back
        boundaries = world_size * v - 1
        assert sum(g["sent"] for g in ranks) == 2 * m * act_bytes * boundaries, what
        assert sum(g["received"] for g in ranks) == 2 * m * act_bytes * boundaries, what
        assert [g["peak"] for g in ranks] == sched.peak_activations(), what
        if name == "1f1b":
            assert [g["peak"] for g in ranks] == [min(m, world_size - r) for r in range(world_size)], what
        embeds = [r for r, g in enumerate(ranks) if g["modules"][0]]
        heads = [r for r, g in enumerate(ranks) if g["modules"][1]]
        assert embeds == [0] and heads == [world_size - 1], what
    # measured bubble next to the simulator's prediction for the same run (every action its measured
    # time, the measured comm latency and host gap between actions), printed; asserted: timing-free facts
    for k, (name, v, m, num_layers, counts) in enumerate(CONFIGS[world_size]):
        what = f"{name} pp={world_size} v={v} m={m} layers={num_layers}{counts or ''}"
        sched = build_schedule(name, pp=world_size, num_microbatches=m, pp_chunks=v)
        ranks = [r[k] for r in results]
        for r, got in enumerate(ranks):  # every action inside the step, one at a time, in order
            bounds = [0.0] + [x for _, s, e in got["timeline"] for x in (s, e)] + [got["seconds"]]
            assert bounds == sorted(bounds), f"{what}: rank {r}'s action intervals overlap or leave the step"
        measured = measured_timeline(sched, [[TimedAction(*t) for t in g["timeline"]] for g in ranks],
                                     [g["t0_wall"] for g in ranks])
        t_comm, t_gap = measured_overheads(measured)
        predicted = simulate_measured(measured, t_comm=t_comm, t_gap=t_gap)
        assert t_comm >= 0 and t_gap >= 0
        # the same actions in the same order with the same durations: only the idle time is predicted
        assert [[t.action for t in tl] for tl in predicted.timeline] == [list(a) for a in sched.ranks], what
        assert predicted.busy == pytest.approx(measured.busy, rel=1e-9), what
        print(f"{what}: bubble fraction measured {measured.bubble_fraction:.3f}, simulated with the measured "
              f"times {predicted.bubble_fraction:.3f} (comm {t_comm * 1e3:.2f} ms, gap {t_gap * 1e3:.2f} ms; "
              f"equal times {simulate(sched).bubble_fraction:.3f}); idle ms per rank measured "
              f"{[round(x * 1e3, 1) for x in measured.idle]}, simulated {[round(x * 1e3, 1) for x in predicted.idle]}")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zero_bubble"])
def test_simulate_measured_recovers_a_known_timeline(name):
    # A "measured" timeline made by the simulator itself, every action its own duration, known comm
    # latency and gap between actions: `measured_overheads` finds them, and `simulate_measured`
    # reproduces the timeline exactly (busy, idle per rank, makespan, bubble).
    from meshlm.schedules import Action

    pp, v = 3, 2 if name == "interleaved" else 1
    sched = build_schedule(name, pp=pp, num_microbatches=6, pp_chunks=v)
    durations = {(r, a): {"F": 4.0, "B": 6.0, "W": 3.0}[a.kind] + r + (a.microbatch % 3) / 4
                 for r in range(pp) for a in sched.ranks[r]}
    truth = simulate(sched, durations=durations, t_comm=0.5, t_gap=0.25)
    assert measured_overheads(truth) == pytest.approx((0.5, 0.25))
    again = simulate_measured(truth)
    assert again.makespan == pytest.approx(truth.makespan) and again.bubble == pytest.approx(truth.bubble)
    assert again.idle == pytest.approx(truth.idle) and again.busy == pytest.approx(truth.busy)
    assert [[(t.action, t.start) for t in tl] for tl in again.timeline] == \
        [[(t.action, pytest.approx(t.start)) for t in tl] for tl in truth.timeline]
    # without the latency and gap the same durations finish earlier, never later
    assert simulate_measured(truth, t_comm=0.0, t_gap=0.0).makespan < truth.makespan
    assert simulate(sched, durations={(0, Action("F", 0)): 9.0}).timeline[0][0].end == 9.0


def test_split_model_keeps_names_and_refuses_what_it_cannot_split():
    model = build_model(_model_config(5), seed=SEED)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage = split_model(model, pp_rank=1, pp=2, pp_chunks=1)
    assert isinstance(stage, PipelineStage)
    assert stage.chunk_layers == [["3", "4"]]
    assert model.embed is None and model.lm_head is not None
    for n, p in model.named_parameters():
        assert torch.equal(p, full[n]), n
    stage0 = split_model(build_model(_model_config(8), seed=SEED), pp_rank=0, pp=2, pp_chunks=2)
    assert stage0.chunk_layers == [["0", "1"], ["4", "5"]]
    # the default is the planner's cost-balanced split (schedules.balanced_split): with this small vocabulary
    # the even one; with a big one the last stage, which also runs the output head, gets fewer blocks
    from meshlm.parallel.pipeline import default_layers_per_stage

    assert stage.layers_per_stage == default_layers_per_stage(model.config, pp=2, seq_len=MODEL["max_seq_len"])
    big = ModelConfig(**{**MODEL, "vocab_size": 4096}, num_layers=8)
    last = split_model(build_model(big, seed=SEED), pp_rank=3, pp=4)
    assert last.layers_per_stage == default_layers_per_stage(big, pp=4, seq_len=big.max_seq_len) == [3, 2, 2, 1]
    assert last.chunk_layers == [["7"]]
    # tied embeddings: the last stage keeps the head, a copy of the embedding (summed over "pp_ends" in training)
    tied = build_model(ModelConfig(**MODEL, num_layers=2, tie_embeddings=True))
    embedding = tied.embed.weight.detach().clone()
    tail = split_model(tied, pp_rank=1, pp=2)
    assert tail.model.embed is None and torch.equal(tail.model.lm_head.weight, embedding)
    with pytest.raises(ValueError, match="layers per stage"):
        split_model(build_model(_model_config(4)), pp_rank=0, pp=2, layers_per_stage=[4, 0])


def _messages(sched, rank: int, *, sent: bool) -> dict[int, list[tuple]]:
    """Per peer, the (kind, to stage, microbatch) messages rank `rank` sends (or receives), in the order
    the executor posts them: its action order."""
    S, pp = sched.num_stages, sched.pp
    out: dict[int, list[tuple]] = {}
    for a in sched.ranks[rank]:
        s = sched.stage(rank, a.chunk)
        if sent:
            if a.kind == "F" and s < S - 1:
                out.setdefault((s + 1) % pp, []).append(("act", s + 1, a.microbatch))
            if a.kind == "B" and s > 0:
                out.setdefault((s - 1) % pp, []).append(("grad", s - 1, a.microbatch))
        else:
            if a.kind == "F" and s > 0:
                out.setdefault((s - 1) % pp, []).append(("act", s, a.microbatch))
            if a.kind == "B" and s < S - 1:
                out.setdefault((s + 1) % pp, []).append(("grad", s, a.microbatch))
    return out


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zero_bubble"])
def test_messages_match_in_posting_order(name):
    # gloo matches a receive to its send by tag; NCCL ignores tags and matches each pair of ranks in
    # posting order. Both ends post in their own action order: prove the two orders agree, so the
    # executor needs no tags on backends that ignore them.
    for pp in (2, 3, 4):
        for v in ((1, 2, 3) if name == "interleaved" else (1,)):
            for m in range(pp if name == "interleaved" else 1, 13, pp if name == "interleaved" else 1):
                sched = build_schedule(name, pp=pp, num_microbatches=m, pp_chunks=v)
                for src in range(pp):
                    for dst, msgs in _messages(sched, src, sent=True).items():
                        assert msgs == _messages(sched, dst, sent=False)[src], (name, pp, v, m, src, dst)


def _split_backward_run(rank: int, how: str, *, qk_norm: bool = False, recompute: str = "none"):
    """One chunk (pp=2, stage `rank`) forward, then its backward fused or split ("split": B + W of
    SplitBackward; "rewalk": W walking the chain again, the fallback). Returns (B counts, W counts, grads,
    input grad); counts are (matmul FLOPs, aten ops by name)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from meshlm.parallel.pipeline import SplitBackward
    from meshlm.parallel.recompute import apply_recompute

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    def measured(fn):
        with FlopCounterMode(display=False) as flops, Ops() as ops:
            out = fn()
        return out, (flops.get_total_flops(), ops.ops)

    model = build_model(ModelConfig(**MODEL, num_layers=4, qk_norm=qk_norm), seed=SEED, dtype=torch.float64)
    apply_recompute(model, recompute)
    stage = split_model(model, pp_rank=rank, pp=2, pp_chunks=1)
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ + 1), generator=g)
    x = tokens[:, :-1] if rank == 0 else torch.randn(MICRO, SEQ, MODEL["hidden_size"], dtype=torch.float64,
                                                      generator=g).requires_grad_()
    split, key = SplitBackward(stage), (0, 0)
    y = split.forward(key, lambda: stage.forward_chunk(0, x, seq_len=SEQ))
    grad_out = torch.randn(y.shape, dtype=torch.float64, generator=g) if rank == 0 else None
    if rank == 1:
        y = token_loss_sum(y, tokens[:, 1:]) / (MICRO * SEQ)
    if how == "fused":
        _, b = measured(lambda: torch.autograd.backward(y, grad_out))
        w, gx = (0, collections.Counter()), x.grad if rank else None
    else:
        if how == "rewalk":
            split.outputs[key] = None
        (gx, saved), b = measured(lambda: split.backward_input(key, y, x if rank else None, grad_out))
        _, w = measured(lambda: split.backward_weight(key, y, saved))
    split.remove()
    return b, w, {n: p.grad.clone() for n, p in model.named_parameters()}, gx


@pytest.mark.parametrize("rank", [0, 1])  # first stage (embedding, no input gradient), last (head + loss)
@pytest.mark.parametrize("qk_norm,recompute", [(False, "none"), (True, "none"), (False, "selective")])
def test_split_backward_costs_one_fused_backward(rank, qk_norm, recompute):
    # W backpropagates from each parameter-owning module's output to its own parameters only: B + W run
    # the ops of one fused backward (the same matmul FLOPs, the same aten ops but one view per Linear:
    # its output's view node runs in B for the input gradient and again in W for the weight gradient,
    # a metadata op), where a W that re-walks the chain costs ~1.5x. Gradients are bit-identical.
    (fb, fops), _, fgrads, fgx = _split_backward_run(rank, "fused", qk_norm=qk_norm, recompute=recompute)
    (bb, bops), (wb, wops), grads, gx = _split_backward_run(rank, "split", qk_norm=qk_norm, recompute=recompute)
    (rb, _), (rw, _), rgrads, _ = _split_backward_run(rank, "rewalk", qk_norm=qk_norm, recompute=recompute)
    assert fb > 0 and bb > 0 and wb > 0
    assert bb + wb == fb, (bb, wb, fb)
    if rank == 1:  # the fallback (and the old W): the chain walked twice, ~1.5x
        assert rb + rw > 1.4 * fb, (rb, rw, fb)
    else:  # no input gradient on the first stage: the old B did nothing, its W was the whole backward
        assert (rb, rw) == (0, fb)
    diff = bops + wops
    diff.subtract(fops)
    model = split_model(build_model(_model_config(4)), pp_rank=rank, pp=2, pp_chunks=1).model
    num_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    extra = {k: v for k, v in diff.items() if v and k != "aten.detach.default"}  # detach: autograd bookkeeping
    assert extra == {"aten.view.default": num_linear}, diff
    assert set(grads) == set(fgrads) == set(rgrads)
    for n in fgrads:
        assert torch.equal(grads[n], fgrads[n]) and torch.equal(rgrads[n], fgrads[n]), n
    if rank == 1:
        assert torch.equal(gx, fgx)


def test_split_backward_falls_back_where_it_cannot_split():
    from meshlm.parallel.pipeline import SplitBackward
    from meshlm.parallel.recompute import apply_recompute

    model = apply_recompute(build_model(_model_config(4), seed=SEED, dtype=torch.float64), "full")
    split = SplitBackward(split_model(model, pp_rank=0, pp=2, pp_chunks=1))
    assert split.owners[0] is None  # full recomputation: each per-module W would recompute the block again
    split.remove()


@pytest.mark.parametrize("chained", [False, True])
def test_split_backward_module_called_twice(chained):
    # A module called twice: its parameters get both calls' gradients. Called on its own earlier
    # output, its parameters sit upstream of itself (W from the second output would count the first
    # call again), so that microbatch falls back to a W that walks the chain; both match fused.
    from types import SimpleNamespace

    from meshlm.parallel.pipeline import SplitBackward

    torch.manual_seed(SEED)
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(4, 4).double(), "norm": torch.nn.LayerNorm(4).double()})
    stage = SimpleNamespace(model=model, pp_chunks=1, chunk_parameters=lambda c: list(model.parameters()))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def forward():
        a = model["lin"](x)
        b = model["lin"](torch.tanh(a) if chained else x.flip(0))
        return model["norm"](a * b).sum()

    ref = torch.autograd.grad(forward(), [x, *model.parameters()])
    split = SplitBackward(stage)
    y = split.forward((0, 0), forward)
    assert (split.outputs[(0, 0)] is None) == chained
    gx, saved = split.backward_input((0, 0), y, x, None)
    split.backward_weight((0, 0), y, saved)
    split.remove()
    torch.testing.assert_close(gx, ref[0], rtol=0, atol=1e-14)
    for p, want in zip(model.parameters(), ref[1:]):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-14)
