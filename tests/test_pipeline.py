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
from meshlm.parallel.pipeline import PipelineStage, measured_bubble, run_pipeline_step, split_model, token_loss_sum
from meshlm.parallel.schedules import build_schedule, simulate
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
    # measured bubble next to the simulator's, for the record (host clocks: not asserted)
    for k, (name, v, m, _, _) in enumerate(CONFIGS[world_size]):
        tls = [r[k]["timeline"] for r in results]
        print(name, world_size, v, m, "measured bubble fraction", round(_bubble(tls), 3),
              "simulated", round(simulate(build_schedule(name, pp=world_size, num_microbatches=m,
                                                         pp_chunks=v)).bubble_fraction, 3))


def _bubble(tls) -> float:
    from meshlm.parallel.pipeline import TimedAction

    return measured_bubble([[TimedAction(a, s, e) for a, s, e in tl] for tl in tls])[1]


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
    with pytest.raises(ValueError, match="tie_embeddings"):
        split_model(build_model(ModelConfig(**MODEL, num_layers=2, tie_embeddings=True)), pp_rank=0, pp=2)
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
