"""Pipeline schedules (torch-free): coverage, exact unit-time bubbles, peak activations, deadlock
detection, the planner's bubble formulas against the simulator (issue 4), and the uneven layer split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlm.config import PP_SCHEDULES
from meshlm.schedules import (SCHEDULES, Action, Schedule, balanced_split, build_schedule, plot_schedule,
                                       simulate, split_layers, stage_loads)
from meshlm.planner import cost
from meshlm.planner.placement import rank_split


def test_names_match_config():
    assert SCHEDULES == PP_SCHEDULES


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
                                    ("zero_bubble", 1)])
@pytest.mark.parametrize("pp,m", [(1, 1), (1, 3), (2, 2), (2, 6), (3, 3), (4, 8), (4, 12)])
def test_every_microbatch_and_stage_once(name, v, pp, m):
    sched = build_schedule(name, pp=pp, num_microbatches=m, pp_chunks=v)
    kinds = ("F", "B", "W") if name == "zero_bubble" else ("F", "B")
    runs = [(a.kind, a.microbatch, sched.stage(r, a.chunk)) for r, acts in enumerate(sched.ranks) for a in acts]
    assert sorted(runs) == sorted((k, mb, s) for k in kinds for mb in range(m) for s in range(pp * v))
    simulate(sched)  # no deadlock


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_pp", [1, 2, 3])
def test_unit_time_bubble_slots(pp, m_per_pp):
    m = pp * m_per_pp
    # F = 1, full backward = 2: (p - 1)(F + B) idle slots on every rank
    for name in ("gpipe", "1f1b"):
        sim = simulate(build_schedule(name, pp=pp, num_microbatches=m), t_fwd=1, t_bwd_input=1, t_bwd_weight=1)
        assert sim.bubble_slots == [(pp - 1) * 3] * pp
        assert sim.makespan == (m + pp - 1) * 3
    # interleaved: per-chunk times, so a rank's T = v (F + B) and the bubble is (p - 1) T / v
    for v in (2, 3):
        sim = simulate(build_schedule("interleaved", pp=pp, num_microbatches=m, pp_chunks=v),
                       t_fwd=1, t_bwd_input=1, t_bwd_weight=1)
        assert sim.bubble_slots == [(pp - 1) * 3] * pp
    # ZB-H1 with F = B = W = 1: (p - 1)(F + B - W) = p - 1, a third of 1F1B's
    sim = simulate(build_schedule("zero_bubble", pp=pp, num_microbatches=m))
    assert sim.bubble_slots == [pp - 1] * pp
    assert sim.bubble_fraction == pytest.approx((pp - 1) / (3 * m))


def test_non_integer_times_have_no_slots():
    sim = simulate(build_schedule("1f1b", pp=2, num_microbatches=2), t_fwd=0.5)
    assert sim.bubble_slots is None and sim.bubble == pytest.approx(1 * 2.5)


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 2), (4, 4), (4, 8), (8, 5)])
def test_peak_inflight(pp, m):
    one_f_one_b = simulate(build_schedule("1f1b", pp=pp, num_microbatches=m))
    assert one_f_one_b.peak_activations == [min(pp - r, m) for r in range(pp)]
    assert simulate(build_schedule("gpipe", pp=pp, num_microbatches=m)).peak_activations == [m] * pp
    # ZB-H1 keeps 1F1B's peak (rank 0's), which the deferred W's now reach on every rank
    zb = simulate(build_schedule("zero_bubble", pp=pp, num_microbatches=m))
    assert max(zb.peak_activations) == max(one_f_one_b.peak_activations)
    # the planner's memory model reads rank 0's peak
    for name in ("gpipe", "1f1b", "zero_bubble"):
        sim = simulate(build_schedule(name, pp=pp, num_microbatches=m))
        assert sim.peak_inflight[0] == cost.inflight_microbatches(name, pp=pp, num_microbatches=m)


@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 3), (8, 8, 4)])
def test_interleaved_peak_matches_planner(pp, m, v):
    sim = simulate(build_schedule("interleaved", pp=pp, num_microbatches=m, pp_chunks=v))
    assert sim.peak_inflight[0] == pytest.approx(
        cost.inflight_microbatches("interleaved", pp=pp, num_microbatches=m, pp_chunks=v))
    assert sim.peak_activations == sorted(sim.peak_activations, reverse=True)


# (F, B, W) per action; full backward = B + W
TIMES = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (2, 3, 1), (1, 1, 2), (1, 2, 2), (1.5, 2.5, 0.5)]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                    ("zero_bubble", 1)])
@pytest.mark.parametrize("pp,m_per_pp", [(2, 1), (2, 3), (3, 2), (4, 1), (4, 2), (8, 2)])
@pytest.mark.parametrize("times", TIMES)
def test_planner_bubble_agrees_with_simulator(name, v, pp, m_per_pp, times):
    """Issue 4: the planner's closed-form bubble equals the simulated one. The planner's times are a
    rank's over all its chunks, the simulator's one chunk's."""
    f, b, w = times
    m = pp * m_per_pp
    sim = simulate(build_schedule(name, pp=pp, num_microbatches=m, pp_chunks=v), t_fwd=f, t_bwd_input=b,
                   t_bwd_weight=w)
    formula = cost.pipeline_bubble(name, pp=pp, num_microbatches=m, pp_chunks=v, t_fwd=v * f,
                                   t_bwd_input=v * b, t_bwd_weight=v * w)
    assert sim.bubble == pytest.approx(formula)
    assert sim.bubble_fraction == pytest.approx(formula / (m * v * (f + b + w)))


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)])
@pytest.mark.parametrize("loads", [(4, 4, 4, 6), (4, 4, 4, 4, 4, 4, 4, 7), (3, 3, 5), (4, 6, 4, 4), (6, 4, 4, 5)])
def test_planner_bubble_of_unequal_stages_runs_the_fill_at_the_other_ranks_pace(name, v, loads):
    """Ranks of unequal load (Megatron-LM's uniform split puts the output head on the last): the busiest rank idles
    while the fill and the drain pass through the others at their own pace. The planner's bubble with `others` (their
    mean over the busiest's) equals the simulated one where the busiest rank is the last, and bounds it from above
    where it is another -- below the bubble at the busiest rank's pace, what the planner charged before."""
    pp, m = len(loads), 2 * len(loads)
    schedule = build_schedule(name, pp=pp, num_microbatches=m, pp_chunks=v)
    per_kind = {"F": 1.0, "B": 1.0 if schedule.split_backward else 2.0, "W": 1.0}
    durations = {(r, a): loads[r] / v * per_kind[a.kind] for r in range(pp) for a in schedule.ranks[r]}
    sim = simulate(schedule, durations=durations)
    busiest = max(loads)
    others = (sum(loads) - busiest) / (pp - 1) / busiest
    kw = dict(pp=pp, num_microbatches=m, pp_chunks=v, t_fwd=busiest, t_bwd_input=busiest, t_bwd_weight=busiest)
    formula, at_busiest_pace = cost.pipeline_bubble(name, **kw, others=others), cost.pipeline_bubble(name, **kw)
    if loads[-1] == busiest:
        assert sim.bubble == pytest.approx(formula)
    else:
        assert sim.bubble <= formula + 1e-9
    assert formula < at_busiest_pace


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(SCHEDULES), pp=st.integers(1, 6), groups=st.integers(1, 3), extra=st.integers(0, 3),
       v=st.integers(2, 3), t=st.tuples(*[st.integers(1, 3)] * 3), comm=st.integers(0, 2))
def test_property_valid_and_bounded(name, pp, groups, extra, v, t, comm):
    """Any size: valid, no deadlock, the bubble is at least the pipeline's fill, at most all-serial."""
    m = pp * groups + (0 if name == "interleaved" else extra)
    v = v if name == "interleaved" else 1
    sim = simulate(build_schedule(name, pp=pp, num_microbatches=m, pp_chunks=v), t_fwd=t[0], t_bwd_input=t[1],
                   t_bwd_weight=t[2], t_comm=comm)
    per_action = sum(t)
    assert sim.busy == [m * v * per_action] * pp
    assert sim.bubble >= (pp - 1) * (t[0] + comm) - 1e-9
    assert sim.makespan <= m * v * pp * per_action + 2 * pp * v * m * comm + 1e-9
    assert all(isinstance(s, int) for s in sim.bubble_slots)


def test_comm_time_adds_to_cross_rank_dependencies():
    def makespan(name, c):
        return simulate(build_schedule(name, pp=4, num_microbatches=8), t_comm=c).makespan

    # GPipe: the fill and the drain each cross p - 1 links
    assert makespan("gpipe", 1) == makespan("gpipe", 0) + 2 * 3
    # 1F1B's steady state waits on a round trip through all ranks, so latency costs it more
    assert makespan("1f1b", 1) > makespan("1f1b", 0) + 2 * 3


def test_interleaved_needs_divisible_microbatches():
    with pytest.raises(ValueError, match="divisible by pp=4"):
        build_schedule("interleaved", pp=4, num_microbatches=6, pp_chunks=2)
    with pytest.raises(ValueError, match="needs pp_schedule='interleaved'"):
        build_schedule("1f1b", pp=4, num_microbatches=8, pp_chunks=2)
    with pytest.raises(ValueError, match="must be one of"):
        build_schedule("pipedream", pp=4, num_microbatches=8)


def test_deadlock_and_bad_schedules_are_detected():
    # rank 0 waits for the backward of microbatch 1 before sending microbatch 1's forward
    ranks = ((Action("F", 0), Action("B", 1), Action("F", 1), Action("B", 0)),
             (Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)))
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(Schedule("custom", pp=2, num_microbatches=2, pp_chunks=1, split_backward=False, ranks=ranks))
    twice = ((Action("F", 0), Action("F", 0), Action("B", 0)), (Action("F", 0), Action("B", 0)))
    with pytest.raises(ValueError, match="runs 2 times"):
        simulate(Schedule("custom", pp=2, num_microbatches=1, pp_chunks=1, split_backward=False, ranks=twice))
    w_unsplit = ((Action("F", 0), Action("B", 0), Action("W", 0)),)
    with pytest.raises(ValueError, match="has kind 'W'"):
        simulate(Schedule("custom", pp=1, num_microbatches=1, pp_chunks=1, split_backward=False, ranks=w_unsplit))


def test_plot(tmp_path):
    sim = simulate(build_schedule("zero_bubble", pp=2, num_microbatches=2))
    path = plot_schedule(sim, str(tmp_path / "zb.png"))
    assert (tmp_path / "zb.png").stat().st_size > 1000 and path.endswith("zb.png")


# --------------------------------------------------------------------------------------------
# Uneven layer split (the planner's placement.rank_split uses the runtime's split_layers)
# --------------------------------------------------------------------------------------------


def test_split_layers_spreads_the_remainder():
    assert split_layers(10, 4) == [3, 3, 2, 2]
    assert split_layers(8, 4) == [2, 2, 2, 2]
    assert split_layers(10, 4, last_stage_layers=1) == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="num_layers=3"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match="last_stage_layers=8"):
        split_layers(10, 4, last_stage_layers=8)


def test_balanced_split_rule():
    """The one default split (planner and runtime): >= 1 block per stage, the last stage lightened by the
    head's units, ties to the fewest blocks on a rank, then the lightest last stage."""
    assert balanced_split(8, pp=4, head_units=0.2) == [2, 2, 2, 2]  # even is already optimal
    assert balanced_split(8, pp=4, head_units=3.0) == [3, 2, 2, 1]  # a big vocabulary: the last stage gets fewer
    assert balanced_split(8, pp=4, head_units=90.0) == [3, 2, 2, 1]  # never an empty stage
    assert balanced_split(4, pp=2, head_units=1.45) == [3, 1]
    assert balanced_split(10, pp=4) == [3, 3, 3, 1]  # tie on the busiest rank (3): the lighter last stage
    assert balanced_split(5, pp=1, head_units=9.0) == [5]
    assert balanced_split(8, pp=2, pp_chunks=2, head_units=0.5) == [2, 2, 2, 2]
    # the embedding's units lighten the first stage the same way (today both callers pass 0: a lookup)
    assert balanced_split(12, pp=4, head_units=2.0, embed_units=2.0) == [2, 4, 4, 2]
    for L, pp, v, h in ((9, 4, 1, 5.0), (16, 4, 2, 2.5), (7, 7, 1, 3.0), (126, 16, 7, 1.5)):
        counts = balanced_split(L, pp=pp, pp_chunks=v, head_units=h)
        assert len(counts) == pp * v and sum(counts) == L and min(counts) >= 1, counts
    with pytest.raises(ValueError, match="num_layers=3"):
        balanced_split(3, pp=4)
    with pytest.raises(ValueError, match="head_units=-1"):
        balanced_split(8, pp=2, head_units=-1)


def test_planner_uneven_interleaved_split():
    """126 layers on 16 ranks x 7 chunks: 8 layers on the busiest rank, not 7 chunks x 2 = 14. The last
    rank's 7 chunks keep a layer each (the runtime runs no empty stage): 7 + the head's 1.5 = 8.5; a
    head-only last stage (min_blocks=0, not run by meshlm) would make it 8."""
    per_rank, load = rank_split(126, pp=16, chunks=7, head_units=1.5)
    assert sum(per_rank) == 126 and max(per_rank) == 8 and load == pytest.approx(8.5)
    counts = balanced_split(126, pp=16, pp_chunks=7, head_units=1.5, min_blocks=0)
    assert counts[-1] == 0 and stage_loads(counts, pp=16, pp_chunks=7, head_units=1.5)[1] == pytest.approx(8)
    per_rank, load = rank_split(32, pp=4, chunks=1, head_units=0.4)
    assert per_rank == [8, 8, 8, 8] and load == pytest.approx(8.4)
    per_rank, load = rank_split(30, pp=4, chunks=1, head_units=2.0)
    assert sum(per_rank) == 30 and per_rank[-1] < per_rank[0] and load == pytest.approx(8)


def test_405b_interleaved_v7_memory_is_not_overstated():
    from meshlm.config import ModelConfig
    from meshlm.planner.cluster import get_cluster

    cfg = ModelConfig.from_preset("llama3-405b")
    job = cost.Job(seq_len=8192, global_batch_size=2048)
    plain = cost.estimate(cfg, get_cluster("h100"), job, cost.parse_layout("tp=8,pp=16,zero_stage=1", gpus=16384))
    v7 = cost.estimate(cfg, get_cluster("h100"), job, cost.parse_layout(
        "tp=8,pp=16,pp_chunks=7,pp_schedule=interleaved,zero_stage=1", gpus=16384))
    # same layers per rank (8) as the plain split, so the same weights; it was 159 GiB with 14 layers
    assert v7.memory_gib["weights"] == pytest.approx(plain.memory_gib["weights"])
    assert v7.memory_gib["total"] < 100
    assert v7.time_s["pp_bubble"] < plain.time_s["pp_bubble"]


def test_plan_schedule_cli(tmp_path, capsys):
    import json

    from meshlm.cli import main

    png = tmp_path / "pp.png"
    assert main(["plan", "schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--json",
                 "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_fraction"] == pytest.approx(3 / 8) and out["peak_inflight"] == [4, 3, 2, 1]
    assert png.stat().st_size > 1000
    assert main(["plan", "schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved",
                 "--chunks", "2"]) == 2
    assert "divisible by pp=4" in capsys.readouterr().err
