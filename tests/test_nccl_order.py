"""NCCL's ordering rules, checked on CPU (`meshlm.nccl_order`).

Gloo, which these tests run on, buffers sends, matches receives by tag and raises on a timeout; NCCL runs each
rank's ops on a communicator in order, completes a send only once its receive runs, pairs messages in order
and has no tags. So a communication order can pass every gloo test and hang on its first GPU. Here:
- the replay itself: it finds a deadlock, a mispairing, a collective issued differently, an unmatched op,
  and follows waits across communicators;
- every pipeline schedule's exchange plan (`schedules.exchanges`) at pp 2-8, chunks 1-3 and many micro-batch
  counts, training and validation, replays clean -- and the order the runtime used before (each send alone,
  the next action's receive posted ahead of it) deadlocks, as the checker must show;
- real multi-rank training runs recorded op by op (`CommStats(keep_trace=True)`): every pipeline schedule at
  pp 2 and 4 (chunks 1-2), training and validation; ring and all-gather context parallelism, forward and
  backward (the ring also with document masking: the same ops); ZeRO-3 with its two communicators (also
  under pp=2), tensor parallelism, expert all-to-all, a checkpoint saved and loaded back (with DCP's and the
  checkpoint's own object collectives and barriers, which bypass `meshlm.comm`, recorded beside);
- tp, cp and tp x cp serving: prefill chunks, decodes, the cp ring and split-KV, the driver's broadcasts.
"""

from __future__ import annotations

import contextlib

from dist import run_distributed
from meshlm.nccl_order import TracedOp, TracedWait, replay
from meshlm.schedules import SCHEDULES, build_schedule, exchanges, forward_only_actions


def _p2p(*ops, ranks=(0, 1)):
    return TracedOp("g", ranks, "p2p", 0, tuple(ops), "pp")


def test_lone_sends_to_each_other_deadlock_and_a_paired_exchange_does_not():
    send_to = lambda peer, tag=0: ("send", peer, 8, tag)  # noqa: E731
    recv_from = lambda peer, tag=0: ("recv", peer, 8, tag)  # noqa: E731
    lone = {0: [_p2p(send_to(1)), _p2p(recv_from(1))], 1: [_p2p(send_to(0)), _p2p(recv_from(0))]}
    problems = replay(lone)
    assert len(problems) == 1 and "deadlock" in problems[0]
    assert "rank 0 waits in op 0: [send 8 B to rank 1" in problems[0] and "rank 1 waits in op 0" in problems[0]
    paired = {0: [_p2p(send_to(1), recv_from(1))], 1: [_p2p(recv_from(0), send_to(0))]}
    assert replay(paired) == []
    # one side posts its receive first: the other's lone send completes against it
    assert replay({0: [_p2p(send_to(1)), _p2p(recv_from(1))], 1: [_p2p(recv_from(0)), _p2p(send_to(0))]}) == []


def test_nccl_pairs_in_order_not_by_tag_and_every_op_needs_a_partner():
    crossed = {0: [_p2p(("send", 1, 8, 1)), _p2p(("send", 1, 8, 2))],
               1: [_p2p(("recv", 0, 8, 2)), _p2p(("recv", 0, 8, 1))]}
    problems = replay(crossed)
    assert problems and all("paired by NCCL" in p for p in problems)
    assert "no peer matches" in replay({0: [_p2p(("send", 1, 8, 0))], 1: []})[0]


def test_collectives_must_be_issued_alike_and_waits_order_communicators():
    ar = lambda group, n=4: TracedOp(group, (0, 1), "all_reduce", n, (), group)  # noqa: E731
    assert replay({0: [ar("a"), ar("b")], 1: [ar("b"), ar("a")]}) == []  # two streams: no wait between them
    # a wait makes the next op (any communicator) start only after the waited one: crossed, that hangs
    crossed = {0: [ar("a"), TracedWait(0), ar("b")], 1: [ar("b"), TracedWait(0), ar("a")]}
    assert "deadlock" in replay(crossed)[0]
    bad = replay({0: [ar("a", 4)], 1: [TracedOp("a", (0, 1), "all_gather", 4, (), "a")]})
    assert "differs between ranks" in bad[0]
    assert "never issue" in replay({0: [ar("a"), ar("a")], 1: [ar("a")]})[0]


def _plan_traces(rank_actions, *, pp, num_stages, pairs=None):
    """The ops a pipeline's exchange plan issues per rank, and the waits the runtime makes (before an action
    that needs a received tensor: right after the group that brings it)."""
    traces = []
    for r, actions in enumerate(rank_actions):
        trace, n = [], 0
        for group in exchanges(actions, rank=r, pp=pp, num_stages=num_stages,
                               pairs=pairs[r] if pairs else range(0)):
            if group:
                trace.append(_p2p(*((m.kind, m.peer, 64, hash((m.payload, m.stage, m.microbatch))) for m in group),
                                  ranks=tuple(range(pp))))
                if any(m.kind == "recv" for m in group):
                    trace.append(TracedWait(n))
                n += 1
        traces.append(trace)
    return traces


def _old_runtime_traces(schedule):
    """The order the pipeline used on CUDA before: the next action's receive posted (alone) before the
    current action computes, its output then sent alone."""
    pp, S = schedule.pp, schedule.num_stages
    traces = []
    for r, actions in enumerate(schedule.ranks):
        trace, n, posted = [], 0, {}

        def post(i):
            nonlocal n
            if i >= len(actions) or i in posted:
                return
            a, s = actions[i], schedule.stage(r, actions[i].chunk)
            if (a.kind == "F" and s > 0) or (a.kind == "B" and s < S - 1):
                src = s - 1 if a.kind == "F" else s + 1
                trace.append(_p2p(("recv", src % pp, 64, hash((a.kind, s, a.microbatch))), ranks=tuple(range(pp))))
                posted[i] = n
                n += 1

        for i, a in enumerate(actions):
            s = schedule.stage(r, a.chunk)
            post(i)
            if i in posted:
                trace.append(TracedWait(posted.pop(i)))
            post(i + 1)
            if a.kind == "F" and s < S - 1:
                trace.append(_p2p(("send", (s + 1) % pp, 64, hash(("F", s + 1, a.microbatch))), ranks=tuple(range(pp))))
                n += 1
            elif a.kind == "B" and s > 0:
                trace.append(_p2p(("send", (s - 1) % pp, 64, hash(("B", s - 1, a.microbatch))), ranks=tuple(range(pp))))
                n += 1
        traces.append(trace)
    return traces


def _sizes():
    for name in SCHEDULES:
        for pp in (2, 3, 4, 8):
            for v in ((2, 3) if name == "interleaved" else (1,)):
                for m in (1, 2, 3, 4, 5, 8, 12, 16):
                    try:
                        yield build_schedule(name, pp=pp, num_microbatches=m, pp_chunks=v)
                    except ValueError:
                        continue  # a size the schedule does not take


def test_every_schedules_exchange_plan_runs_under_nccls_rules_and_the_old_order_did_not():
    checked = old_deadlocks = 0
    for sched in _sizes():
        traces = _plan_traces(sched.ranks, pp=sched.pp, num_stages=sched.num_stages,
                              pairs=[sched.steady_pairs(r) for r in range(sched.pp)])
        assert replay(traces) == [], (sched.name, sched.pp, sched.pp_chunks, sched.num_microbatches)
        checked += 1
        if sched.num_microbatches >= 2:
            old = replay(_old_runtime_traces(sched))
            assert old and "deadlock" in old[0], (sched.name, sched.pp, sched.num_microbatches)
            old_deadlocks += 1
    assert checked > 100 and old_deadlocks > 90
    for pp in (2, 3, 4):  # validation: forwards only, any micro-batch count
        for v in (1, 2, 3):
            for m in (1, 2, 3, 5, 8):
                acts = forward_only_actions(pp, v, m)
                assert replay(_plan_traces([acts] * pp, pp=pp, num_stages=pp * v)) == [], (pp, v, m)


# -- real runs, recorded ----------------------------------------------------------------------------------

TRAIN = ["train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1", "train.steps=1",
         "train.val_batches=1", "data.val_fraction=0.1", "train.device=cpu", "train.progress=false",
         "parallel.bucket_size_mb=0.02"]
MOE = ["model.num_experts=4", "model.num_experts_per_token=2", "model.moe_intermediate_size=32"]
LAYOUTS = {  # name -> (world size, overrides)
    "pp2 gpipe x dp2": (4, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    "pp2 1f1b x dp2": (4, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "pp2 interleaved x tp2": (4, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_chunks=2",
                                  "parallel.tp=2"]),
    "pp2 zero_bubble x zero1": (4, ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.zero_stage=1"]),
    # ZeRO-3's gathers on their duplicated communicator, beside the pipeline's p2p groups
    "pp2 zero_bubble x zero3": (4, ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.zero_stage=3",
                                    "parallel.zero3_reshard_after_forward=true"]),
    "pp2 interleaved x zero3": (4, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_chunks=2",
                                    "parallel.zero_stage=3"]),
    "pp4 1f1b": (4, ["parallel.pp=4"]),
    "pp4 gpipe": (4, ["parallel.pp=4", "parallel.pp_schedule=gpipe"]),
    "pp4 interleaved": (4, ["parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_chunks=2",
                            "model.num_layers=8"]),
    "pp4 zero_bubble": (4, ["parallel.pp=4", "parallel.pp_schedule=zero_bubble"]),
    "cp2 ring x dp2": (4, ["parallel.cp=2", "parallel.cp_method=ring"]),
    # document masking: the documents travel with every rank's micro-batch, no collective of their own
    "cp2 ring x dp2 document_mask": (4, ["parallel.cp=2", "parallel.cp_method=ring", "data.document_mask=true"]),
    "cp4 ring": (4, ["parallel.cp=4", "parallel.cp_method=ring"]),
    "cp2 allgather x tp2": (4, ["parallel.cp=2", "parallel.cp_method=allgather", "parallel.tp=2"]),
    "cp2 ulysses x tp2": (4, ["parallel.cp=2", "parallel.cp_method=ulysses", "parallel.tp=2"]),
    "cp4 ring x ulysses2": (4, ["parallel.cp=4", "parallel.cp_ulysses=2"]),
    "zero3 dp4": (4, ["parallel.zero_stage=3"]),
    "zero3 x tp2": (4, ["parallel.zero_stage=3", "parallel.tp=2"]),
    "ep2 x dp2 moe": (4, ["parallel.ep=2", *MOE]),
}


OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "barrier")


@contextlib.contextmanager
def _recording_object_collectives(stats):
    """torch.distributed's object collectives and barriers -- the checkpoint's and DCP's own, which bypass
    `meshlm.comm` -- recorded into `stats`' trace as blocking collectives on their process group (on NCCL each
    is one or two collectives on that group's communicator; their sizes differ by rank, so none is recorded)."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in OBJECT_COLLECTIVES}

    def recorded(name):
        def call(*args, **kwargs):
            group = kwargs.get("group") or kwargs.get("process_group") or dist.group.WORLD
            ranks = tuple(dist.get_process_group_ranks(group))
            index = stats.trace_op(TracedOp(f"{group.group_name}:{','.join(map(str, ranks))}", ranks, name,
                                            axis="world" if group is dist.group.WORLD else ""))
            result = originals[name](*args, **kwargs)
            stats.trace_wait(index)
            return result
        return call

    try:
        for name in OBJECT_COLLECTIVES:
            setattr(dist, name, recorded(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _record(rank, world_size, corpus, root, layouts):
    """Per layout: one training step, one validation pass, a checkpoint saved and loaded back, every op recorded
    (DCP's and the checkpoint's object collectives too)."""
    from meshlm.config import load_config
    from meshlm.train.trainer import Trainer
    from runs import SMALL_MODEL

    out = {}
    for name, (_, overrides) in layouts.items():
        cfg = load_config(overrides=[*SMALL_MODEL, "model.num_layers=4", f"data.path={corpus}",
                                     f"train.run_dir={root}/{name.replace(' ', '_')}", *TRAIN, *overrides])
        trainer = Trainer(cfg)
        stats = trainer.mesh.stats
        stats.reset()
        stats.keep_trace = True
        with _recording_object_collectives(stats):
            trainer.train_step()
            trainer.evaluate()
            path = trainer.save()
            trainer.load(path)
        out[name] = list(stats.trace)
        stats.keep_trace = False
    return out


def test_real_runs_replay_under_nccls_rules(tmp_path, text_file):
    results = run_distributed(_record, 4, str(text_file), str(tmp_path), LAYOUTS, timeout=400)
    for name in LAYOUTS:
        traces = {rank: results[rank][name] for rank in range(4)}
        assert any(traces.values()), name  # something was recorded
        assert replay(traces) == [], name
    # what each layout had to show: p2p groups on pp with sends and receives together, cp's ring, the
    # duplicated ZeRO-3 communicator beside the first, the expert all-to-all
    ops = {name: [op for op in results[0][name] if isinstance(op, TracedOp)] for name in LAYOUTS}
    assert any(op.op == "p2p" and {k for k, *_ in op.p2p} == {"send", "recv"} and op.axis == "pp"
               for op in ops["pp2 1f1b x dp2"])
    assert any(op.op == "p2p" and op.axis == "cp" for op in ops["cp4 ring"])
    assert [op.op for op in ops["cp2 ring x dp2 document_mask"]] == [op.op for op in ops["cp2 ring x dp2"]]
    assert any(op.op == "all_gather" and op.axis == "cp" for op in ops["cp2 allgather x tp2"])
    assert any(op.op == "all_to_all" and op.axis == "cp" for op in ops["cp2 ulysses x tp2"])
    assert {(op.op, op.axis) for op in ops["cp4 ring x ulysses2"]} >= {("all_to_all", "cp_ulysses"), ("p2p", "cp_ring")}
    zero3_groups = {op.group for op in ops["zero3 dp4"] if op.axis == "dp_shard"}
    assert len(zero3_groups) >= 2, zero3_groups
    assert any(op.op == "all_to_all" and op.axis == "ep" for op in ops["ep2 x dp2 moe"])
    # the checkpoint's and DCP's own collectives were seen, in the same order on every rank
    assert all({op.op for op in ops[name]} & set(OBJECT_COLLECTIVES) for name in LAYOUTS)


SERVING = {2: {"tp2": (2, 1), "cp2": (1, 2)}, 4: {"tp2 x cp2": (2, 2)}}  # world size -> name -> (tp, cp)


def _record_serving(rank, world_size):
    """Per layout: greedy generation of prompts long enough for chunked prefill, decodes batched beside
    prefills, over the launch's ranks; every op recorded (the driver's keepalive included, if it fires)."""
    import torch

    from meshlm.comm_stats import CommStats
    from meshlm.config import ModelConfig
    from meshlm.infer.llm import LLM
    from meshlm.infer.sequence import SamplingParams
    from meshlm.models.transformer import build_model

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_seq_len=128)
    prompts = [[(7 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate((5, 40, 23))]
    out = {}
    for name, (tp, cp) in SERVING[world_size].items():
        stats = CommStats(keep_trace=True)
        llm = LLM(build_model(cfg, seed=0), tp=tp, cp=cp, device="cpu", dtype=torch.float32, comm_stats=stats,
                  block_size=4, max_num_batched_tokens=16)
        if llm.is_driver:
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
            llm.close()
        out[name] = list(stats.trace)
    return out


def test_tp_and_cp_serving_steps_replay_under_nccls_rules():
    for world, layouts in SERVING.items():
        results = run_distributed(_record_serving, world, timeout=240)
        for name in layouts:
            traces = {rank: results[rank][name] for rank in range(world)}
            ops = [op for op in traces[0] if isinstance(op, TracedOp)]
            assert len(ops) > 20, (name, len(ops))  # steps were recorded: broadcasts, gathers, the ring
            assert replay(traces) == [], name
            if "cp2" in name:  # the prefill's ring over the cp ranks' KV blocks
                assert any(op.op == "p2p" and op.axis == "cp" for op in ops), name
